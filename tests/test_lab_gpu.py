"""benchmarks/lab_gpu.py, the GPU check of the layout lab, runs end to end on CPU (``--quick``) with none of
the packages the device machine lacks (grain, tensorboardX, starlette, uvicorn), so a session that is lent
a GPU spends it measuring, not debugging. Its decode rows tie the inference plan to the generator: the
bytes the plan says a decode step reads are the ones the generator's step reads."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_DEVICE = ("grain", "tensorboardX", "starlette", "uvicorn")


def test_lab_gpu_quick(tmp_path):
    for name in ABSENT_ON_DEVICE:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the device machine')\n")
    out = tmp_path / "lab.json"
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu"
    )
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lab_gpu.py"), "--quick", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["hardware"] == "h100" and not result["comparable"] and result["model"] == "tiny"
    assert result["device_rates"]["matmul_tflops"] > 0 and result["device_rates"]["copy_gb_s"] > 0
    assert [r["remat"] for r in result["train"]] == ["full", "none"]
    for row in result["train"]:
        got, want = row["measured"], row["predicted"]
        assert got["step_s"] > 0 and row["error"]["step_s"] == round(want["step_s"] / got["step_s"] - 1, 4)
    full, none = result["train"]
    assert none["predicted"]["memory_bytes"] > full["predicted"]["memory_bytes"]  # no remat keeps more
    assert [r["batch"] for r in result["decode"]] == [1, 2]
    for row in result["decode"]:
        assert row["predicted"]["decode_bytes"] == row["measured"]["decode_bytes"]
        assert row["slots"] == 32 and row["measured"]["decode_step_s"] > 0
