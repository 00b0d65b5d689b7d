"""The layout lab's predictions beside one accelerator's measurements: a ~1B model's train step in three
settings and its prefill and decode steps at two batches, on one GPU.

    python benchmarks/lab_gpu.py --out $OUT/lab_gpu.json     # one H100/H200: llama3.2-1b, bf16
    python benchmarks/lab_gpu.py --quick                      # the same code on CPU with tiny (~1 min)

Predictions are what a user gets from ``jaxpar plan ... --json`` and ``jaxpar plan --inference ... --json``
for one device of the hardware profile (``--hardware``, else the device's own: ``hardware_of_device``).
They run as subprocesses on the host's CPU (``JAX_PLATFORMS=cpu``), all started before the accelerator
is touched, so the lab never sees the device it predicts.

- Train (``make_train_step`` on a one-device ``dp`` layout, params float32, compute bfloat16): each case
  is compiled, run ``--warmup`` steps, then ``--steps`` timed steps (each to its loss); the median is the
  measured step. Cases, with cuDNN's flash attention: full remat at batch 8 × 2048; no remat at 4 × 2048
  (no recompute); full remat at 2 × 8192 (the same tokens, four times the attention per token); and full
  remat at 8 × 2048 with XLA's attention (jaxpar's default: every score materialized). A case that fails
  records its error and the others run. A case the lab's memory estimate
  (``estimated_memory_bytes``, what ``fits`` reads) puts beyond the device's memory is skipped, and says so.
  ``peak_bytes`` is the device allocator's peak after the
  case (``memory_stats``; the peaks only grow, so it is the largest case so far).
- Decode (``benchmarks/generate.py``'s ``bench_model``: a ``Generator`` on one device, bf16 weights,
  random prompts of ``--prompt`` tokens, ``--new`` greedy tokens): its prefill time beside the lab's
  prefill at the prompt's bucket, and its median decode step beside the lab's decode step at the cache's
  slots (the decode attends over every slot).

``device_rates``: an 8192³ bf16 matmul's rate and an on-device copy's bandwidth, beside the profile's peaks.
The JSON is rewritten after every case, so a run stopped at its limit keeps what it measured.
``error`` is predicted / measured − 1 for each time. On CPU (``--quick``) the profile is still a GPU's,
so the errors say nothing about the lab: the run checks that the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # generate.py's and layouts.py's measurements
TRAIN = (
    ("cudnn, full remat, 8 x 2048", 8, 2048, "full", "cudnn"),  # (case, batch, seq, remat, attention)
    ("cudnn, no remat, 4 x 2048", 4, 2048, "none", "cudnn"),
    ("cudnn, full remat, 2 x 8192", 2, 8192, "full", "cudnn"),
    ("xla, full remat, 8 x 2048", 8, 2048, "full", "xla"),
)
QUICK_TRAIN = (("xla, full remat, 2 x 64", 2, 64, "full", "xla"), ("xla, no remat, 2 x 64", 2, 64, "none", "xla"))


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--hardware", help="profile to predict for (default: the device's own)")
    p.add_argument("--batches", default="1,64", help="decode batches")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny, two small train cases, decode batch 1 and 2")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    args.train = QUICK_TRAIN if args.quick else TRAIN
    if args.quick:
        args.model, args.batches, args.prompt, args.new, args.steps, args.warmup = "tiny", "1,2", 16, 8, 3, 1
    return args


# ------------------------------------------------------------------------------------ the predictions
def plan_command(args, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "jaxpar",
        "plan",
        "--model",
        args.model,
        "--devices",
        "1",
        "--hardware",
        args.hardware,
        "--json",
        *extra,
    ]


def train_plan(args, batch, seq, remat, attention) -> list[str]:
    return plan_command(
        args,
        "--mesh",
        "dp",
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--set",
        "execution.dtype=bfloat16",
        "--set",
        f"execution.remat={remat}",
        "--set",
        f"execution.attention_impl={attention}",
    )


def decode_plan(args, batch, context) -> list[str]:
    return plan_command(
        args,
        "--inference",
        "--mesh",
        "decode_dp",
        "--batch",
        str(batch),
        "--context",
        str(context),
        "--set",
        "execution.dtype=bfloat16",
        "--set",
        "model.param_dtype=bfloat16",
    )


def run_plans(commands: dict) -> dict:
    """Every ``jaxpar plan`` at once on the host's CPU; their parsed JSON by key."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = {
        key: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for key, cmd in commands.items()
    }
    out = {}
    for key, proc in procs.items():
        stdout, stderr = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{' '.join(commands[key])} exited {proc.returncode}:\n{stderr[-2000:]}")
        out[key] = json.loads(stdout)
    return out


def error(predicted: float, measured: float) -> float:
    return round(predicted / measured - 1, 4)


# ------------------------------------------------------------------------------------ the measurements
def peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def measure_train(model: str, batch: int, seq: int, remat: str, attention: str, steps: int, warmup: int) -> dict:
    """Compile time, median and min step of a one-device train step (``layouts.py``'s ``time_train_step``);
    the allocator's peak after it."""
    import jax
    from layouts import time_train_step

    from jaxpar.models import ExecutionConfig, get_model_preset

    cfg, run = get_model_preset(model), ExecutionConfig(dtype="bfloat16", remat=remat, attention_impl=attention)
    _, _, compile_s, times, loss = time_train_step(
        cfg, "dp", batch=batch, seq=seq, steps=steps, warmup=warmup, devices=jax.devices()[:1], execution=run
    )
    return {
        "compile_s": round(compile_s, 2),
        "step_s": statistics.median(times),
        "step_s_min": min(times),
        "loss": loss,
        "peak_bytes": peak_bytes(),
    }


def train_row(args, hw, case, plan) -> dict:
    name, batch, seq, remat, attention = case
    row = {
        "case": name,
        "batch": batch,
        "seq": seq,
        "remat": remat,
        "attention": attention,
        "predicted": {
            "step_s": plan["predicted_step_s"],
            "mfu": plan["predicted_mfu"],
            "memory_bytes": plan["estimated_memory_bytes"],
            "memory_parts": plan["memory_parts"],
            "cpu_compiled_memory_bytes": plan["per_device_memory_bytes"],
            "parts": plan["times"]["parts"],
        },
    }
    if not plan["fits"]:
        return row | {
            "skipped": f"the lab's memory ({plan['estimated_memory_bytes'] / 1e9:.1f} GB) exceeds "
            f"{hw.name}'s {hw.hbm_bytes / 1e9:.0f} GB"
        }
    try:
        got = measure_train(args.model, batch, seq, remat, attention, args.steps, args.warmup)
    except Exception as e:  # one case's failure (cuDNN, memory) leaves the others to run
        return row | {"failed": f"{type(e).__name__}: {str(e)[:600]}"}
    got["mfu"] = plan["model_flops_per_device"] / got["step_s"] / hw.peak_bf16_flops
    return row | {"measured": got, "error": {"step_s": error(plan["predicted_step_s"], got["step_s"])}}


def decode_rows(args, plans) -> list[dict]:
    """``generate.py``'s measurement of each batch beside the lab's prefill and decode step."""
    import generate

    from jaxpar.analysis.hardware import get_hardware

    bench = argparse.Namespace(prompt=args.prompt, new=args.new, batches=args.batches)
    peak = get_hardware(args.hardware).hbm_bandwidth / 1e9
    got = generate.bench_model(
        args.model, bench, peak, generate.matmul_gflops("bfloat16", 2048), dtype="bfloat16", param_dtype="bfloat16"
    )
    rows = []
    for measured in got["batches"]:
        b = measured["batch"]
        prefill, decode = plans[("prefill", b)], plans[("decode", b)]
        step = measured["roofline"]["median_step_ms"] / 1e3
        assert measured["kv"]["slots"] == decode["context"], (measured["kv"], decode["context"])
        rows.append(
            {
                "batch": b,
                "prompt": args.prompt,
                "new": args.new,
                "slots": measured["kv"]["slots"],
                "predicted": {
                    "prefill_s": prefill["prefill_s"],
                    "decode_step_s": decode["decode_step_s"],
                    "decode_bytes": decode["decode_bytes_read_per_device"],
                },
                "measured": {
                    "prefill_s": measured["prefill_s"],
                    "decode_step_s": step,
                    "inter_token_ms_p50": measured["inter_token_ms_p50"],
                    "decode_bytes": measured["roofline"]["bytes_per_step"],
                    "achieved_gb_s": measured["roofline"]["achieved_gb_s"],
                },
                "error": {
                    "prefill_s": error(prefill["prefill_s"], measured["prefill_s"]),
                    "decode_step_s": error(decode["decode_step_s"], step),
                },
            }
        )
    return rows


def save(result: dict, path: str | None) -> None:
    """The JSON so far, rewritten after every case: a run stopped at its time limit keeps what it measured."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")


def device_rates(hw, quick: bool) -> dict:
    """What this device does beside its profile's datasheet: a large bf16 matmul's rate and an on-device
    copy's bandwidth (``generate.py``'s measurements), so that a miss can be told from a slow device."""
    import generate

    n, mib = (512, 64) if quick else (8192, 2048)
    gflops, gb_s = generate.matmul_gflops("bfloat16", n), generate.device_bandwidth(mib, 5)
    return {
        "matmul_tflops": round(gflops / 1e3, 1),
        "matmul_n": n,
        "matmul_share_of_peak": round(gflops * 1e9 / hw.peak_bf16_flops, 3),
        "copy_gb_s": gb_s,
        "copy_share_of_hbm": round(gb_s * 1e9 / hw.hbm_bandwidth, 3),
    }


def main(argv=None) -> int:
    args = _args(argv)
    import jax

    from jaxpar.analysis.hardware import get_hardware, hardware_of_device
    from jaxpar.inference.generate import bucket

    kind = jax.devices()[0].device_kind
    args.hardware = args.hardware or hardware_of_device(kind) or ("h100" if args.quick else None)
    if args.hardware is None:
        raise SystemExit(f"--hardware: no profile matches the device {kind!r}; name one")
    hw = get_hardware(args.hardware)
    batches = [int(b) for b in args.batches.split(",")]
    commands = {("train", c[0]): train_plan(args, *c[1:]) for c in args.train}
    for b in batches:
        commands[("prefill", b)] = decode_plan(args, b, bucket(args.prompt))
        commands[("decode", b)] = decode_plan(args, b, bucket(bucket(args.prompt) + args.new))
    t0 = time.perf_counter()
    plans = run_plans(commands)
    result = {
        "device": kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "hardware": hw.name,
        "comparable": hardware_of_device(kind) == hw.name,
        "model": args.model,
        "host": platform.machine(),
        "plan_s": round(time.perf_counter() - t0, 1),
        "device_rates": device_rates(hw, args.quick),
        "train": [],
    }
    save(result, args.out)
    for case in args.train:
        result["train"].append(train_row(args, hw, case, plans[("train", case[0])]))
        print(json.dumps(result["train"][-1]), file=sys.stderr, flush=True)
        save(result, args.out)
    try:
        result["decode"] = decode_rows(args, plans)
    except Exception as e:  # the training rows are kept either way
        result["decode"] = {"failed": f"{type(e).__name__}: {str(e)[:600]}"}
    print(json.dumps(result, indent=1))
    save(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
