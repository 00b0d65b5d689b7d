"""colab/03_pipeline.ipynb runs, and what it shows holds."""

import pytest
from notebooks import figures, run_tutorial

P = 4
MS = (4, 8, 12, 16, 24, 32)


@pytest.fixture(scope="module")
def k():
    return run_tutorial("03_pipeline")


def test_figures(k):
    assert figures("03_pipeline") >= 3  # the Gantt charts, bubble against m, memory against m


def test_bubble_counted_from_the_tables_is_the_closed_form(k):
    # Idle cells / all cells of the unit-tick tables. Fill and drain are p-1 ticks each way; the work
    # per stage is 2m ticks (F, B), 2·v·m for v chunks, 3m when the backward is split into B and W.
    # Both sides are ratios of small integers: equal to float rounding.
    work = {
        "gpipe": lambda m: 2 * m,
        "1f1b": lambda m: 2 * m,
        "interleaved": lambda m: 4 * m,
        "zero_bubble": lambda m: 3 * m,
    }
    for name, w in work.items():
        for m in MS:
            idle = {"zero_bubble": P - 1}.get(name, 2 * (P - 1))  # ZB-H1: W's fill 2/3 of the drain
            want = idle / (w(m) + idle)
            assert k["bubble_counted"][f"{name}/m={m}"] == pytest.approx(want, abs=1e-12), (name, m)
            assert k["bubble_formula"][f"{name}/m={m}"] == pytest.approx(want, abs=1e-12), (name, m)


def test_the_texts_43_percent(k):
    # p = 4, m = 4 under GPipe: (m + p - 1) = 7 ticks each way, 4 stages, 2 · 3 idle ticks per stage.
    assert (k["claim_idle_cells"], k["claim_cells"]) == (4 * 2 * 3, 4 * 2 * 7)
    assert round(100 * k["claim_idle_cells"] / k["claim_cells"]) == 43
    assert k["single_microbatch_bubble"] == pytest.approx(3 / 4)
    # Forward only (the text's serving pipeline): m + p - 1 = 7 ticks, m = 4 busy on each of 4 stages.
    assert (k["claim_forward_idle_cells"], k["claim_forward_cells"]) == (4 * 3, 4 * 7)
    # "Roughly double m to halve the bubble": from m = 4, (p-1)/(m+p-1) <= 3/14 first at m = 11.
    assert k["halving_m"] == min(m for m in range(4, 64) if 3 / (m + 3) <= 3 / 14)


def test_what_each_stage_holds(k):
    peaks = k["peak_in_flight"]
    for m in (4, 8, 16):
        assert peaks[f"gpipe/m={m}"] == [m] * P
        assert peaks[f"1f1b/m={m}"] == [P - s for s in range(P)]
        assert peaks[f"interleaved/m={m}"] == [2 * P - s for s in range(P)]  # (microbatch, chunk) pairs
        assert max(peaks[f"zero_bubble/m={m}"]) <= P


def test_executor_bubble(k):
    m = 8
    assert k["executor_bubble"]["gpipe"] == pytest.approx((P - 1) / (m + P - 1))
    # 1F1B in lockstep, F = 1, B = 2: of its 2(m+p-1) ticks the first p hold forwards only (cost 1) and
    # every later one holds a backward somewhere (cost 2): 4m + 3p - 4 time units against 3m of work
    # per stage.
    assert k["executor_bubble"]["1f1b"] == pytest.approx(1 - 3 * m / (4 * m + 3 * P - 4))
    assert k["executor_bubble"]["zero_bubble"] > (P - 1) / (3 * m + P - 1)  # W ticks cost a full backward


def test_activation_memory_from_the_compiled_step(k):
    temp, one = k["temp_bytes"], k["stage_input_bytes"]
    assert one == 2 * 64 * 64 * 4  # rows × tokens × tiny's embed × float32
    gpipe = (temp["gpipe/m=16"] - temp["gpipe/m=4"]) / 12
    onef1b = (temp["1f1b/m=16"] - temp["1f1b/m=4"]) / 12
    # GPipe keeps every microbatch's stage input: at least one per extra microbatch; the 10% slack
    # covers what comes along with it (its token ids, 2 × 2 × 64 int32 = 3% here) and XLA's buffer packing.
    assert one <= gpipe <= 1.1 * one, (gpipe, one)
    # 1F1B keeps at most p: no stage input's worth of growth per microbatch (the token ids only).
    assert onef1b < 0.1 * one, (onef1b, one)
    assert temp["gpipe/m=8"] > temp["1f1b/m=8"] + 3 * one
    assert abs(temp["gpipe/m=4"] - temp["1f1b/m=4"]) < 0.01 * temp["1f1b/m=4"]


def test_pipelined_loss_is_one_devices(k):
    # Same weights and batch: only the order of float32 sums differs.
    assert abs(k["loss_pipelined"] - k["loss_one_device"]) <= 1e-5 * k["loss_one_device"]
