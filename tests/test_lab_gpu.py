"""benchmarks/lab_gpu.py, the GPU check of the layout lab, and benchmarks/decode_gpu.py run end to end on
CPU (``--quick``) with none of the packages the device machine lacks (grain, tensorboardX, starlette,
uvicorn), so a session that is lent a GPU spends it measuring, not debugging. The lab's decode rows tie
the inference plan to the generator: the bytes the plan says a decode step reads are the ones the
generator's step reads."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ABSENT_ON_DEVICE = ("grain", "tensorboardX", "starlette", "uvicorn")


def _run_as_on_device(tmp_path, script: str, *args: str) -> None:
    """``benchmarks/<script> args`` on CPU, with every package the device machine lacks made to fail."""
    for name in ABSENT_ON_DEVICE:
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the device machine')\n")
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu"
    )
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]


def test_lab_gpu_quick(tmp_path):
    out = tmp_path / "lab.json"
    _run_as_on_device(tmp_path, "lab_gpu.py", "--quick", "--out", str(out))
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


def test_decode_gpu_quick(tmp_path):
    """benchmarks/decode_gpu.py (``--quick``: tiny, float32) on CPU: both variants run both decoders, each
    with its loop, chained and dispatch times and its kernels, and the profile comes back as a tarball
    holding a trace; benchmarks/gpu_checks.sh, which runs it on the device, parses."""
    out, trace = tmp_path / "decode.json", tmp_path / "trace.tar.gz"
    _run_as_on_device(tmp_path, "decode_gpu.py", "--quick", "--limit", "300", "--out", str(out), "--trace", str(trace))
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["default", "command buffers off"]
    for variant in result["variants"].values():
        for decoder in ("jaxpar generate", "plain JAX"):
            r = variant[decoder]
            assert min(r["loop_step_ms"], r["chained_step_ms"], r["dispatch_ms"]) > 0, r
            assert r["hlo"]["fusions"] > 0 and r["hlo"]["bytes_accessed"] > 0
    with tarfile.open(trace) as tar:
        assert any(name.endswith(".trace.json.gz") for name in tar.getnames())
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_checks.sh")]).returncode == 0
