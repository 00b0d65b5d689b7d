"""colab/00_start.ipynb runs, and what it shows holds."""

from notebooks import figures, run_tutorial

GIB = 2**30


def test_start_notebook():
    k = run_tutorial("00_start")
    assert k["devices"] == 8
    assert figures("00_start") >= 1
    # params + two fp32 moments, 4 + 8 bytes a parameter: whole on every device under dp, an 8th
    # under fully sharded layouts, a 4th under 3d and hsdp (data=2 replicates).
    full = 12 * k["llama3_8b_params"] / GIB
    gib = k["per_device_gib"]
    assert abs(gib["dp"] - full) < 1e-6 * full
    for name in ("fsdp", "tp", "fsdp_tp"):
        assert abs(gib[name] - full / 8) < 0.01 * full / 8, name
    for name in ("3d", "hsdp"):
        assert abs(gib[name] - full / 4) < 0.01 * full / 4, name
    assert abs(k["loss_one_device"] - k["loss_8_devices"]) <= 1e-5 * k["loss_one_device"]
