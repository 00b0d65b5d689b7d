"""Where a decode step's time goes on one device: ``jaxpar generate``'s step beside the same compiled step
chained on the device, beside the plain-JAX decoder (``decoders.py``: per-layer arrays, unrolled, donated),
with and without XLA's command buffers (CUDA graphs).

    python benchmarks/decode_gpu.py --out $OUT/decode_gpu.json --trace $OUT/trace.tar.gz   # one GPU, ~2 min
    python benchmarks/decode_gpu.py --quick                                                 # tiny, on CPU

Each variant (``XLA_FLAGS``, ``VARIANTS``) runs in a process of its own, since XLA reads its flags once.
For each decoder, at batch 1 and ``--prompt`` tokens, bf16 weights and compute (``--quick``: float32):

- ``loop_step_ms``: the median step of the host loop a user runs (``Generator.generate``; the plain
  decoder's own loop), each step ending with its tokens on the host;
- ``chained_step_ms``: the same compiled step called ``--steps`` times with its outputs fed back on the
  device and one wait at the end: the device's time per step, unless dispatching is slower;
- ``dispatch_ms``: the mean time a chained call takes to return (the host's cost of a step);
- ``hlo``: the optimized program's instructions that launch work (fusions, custom calls for cuBLAS /
  cuDNN, copies), its command-buffer calls, and XLA's bytes accessed per step.

``--trace`` (first variant only) records a profile of a few chained steps of each decoder and writes it as
one ``.tar.gz`` (the ``*.trace.json.gz`` inside lists every kernel with its duration).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # generate.py's model init, decoders.py's plain decoder
VARIANTS = {"default": "", "command buffers off": "--xla_gpu_enable_command_buffer="}


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--steps", type=int, default=64, help="chained steps")
    p.add_argument("--quick", action="store_true", help="tiny, float32, 16 + 8 tokens")
    p.add_argument("--limit", type=int, default=150, help="seconds per variant")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--trace", help="a .tar.gz for the first variant's profile")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a variant's name: run it here, print its JSON
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.prompt, args.new, args.steps = "tiny", 16, 8, 8
    return args


def hlo_stats(compiled) -> dict:
    """What the optimized program launches: its top-level kernels' kinds, and XLA's bytes per call."""
    text = compiled.as_text()
    entry = text[text.index("\nENTRY ") :]
    count = lambda pattern: len(re.findall(pattern, entry))
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "fusions": count(r"= \S+ fusion\("),
        "custom_calls": count(r"custom-call\("),
        "copies": count(r"= \S+ copy\("),
        "command_buffer_calls": count(r"command_buffer"),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
    }


def chained(step, carry, steps: int) -> dict:
    """``step(carry) -> carry`` ``steps`` times with no wait between calls: (ms per step and per dispatch,
    the last carry: the first one's buffers are donated)."""
    import jax

    carry = jax.block_until_ready(step(carry))  # warm
    dispatch, t0 = 0.0, time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        carry = step(carry)
        dispatch += time.perf_counter() - t
    jax.block_until_ready(carry)
    total = time.perf_counter() - t0
    return {"chained_step_ms": round(total / steps * 1e3, 4), "dispatch_ms": round(dispatch / steps * 1e3, 4)}, carry


def jaxpar_decoder(model, args):
    """(report, step for ``chained``, its first carry) of ``Generator``'s decode."""
    import jax
    import numpy as np
    from generate import prompts

    from jaxpar.inference.generate import Generator, shapes
    from jaxpar.inference.sampling import SamplingParams

    gen = Generator(model)
    rows = prompts(gen.cfg, 1, args.prompt)
    gen.generate(rows, max_new_tokens=args.new)  # compiles
    run = gen.generate(rows, max_new_tokens=args.new)
    prefill, decode = gen.programs(1, *shapes(rows, [args.new]))
    params = jax.device_put(SamplingParams.greedy(1))
    ids = np.zeros((1, shapes(rows, [args.new])[0]), np.int32)
    ids[0, : args.prompt] = rows[0]
    lengths = jax.device_put(np.array([args.prompt], np.int32))
    token, _, cache = prefill(gen.state, ids, lengths, params)
    step = lambda c: decode(gen.state, c[1], c[0], lengths, params)[::2]
    report = {"loop_step_ms": round(statistics.median(run.step_s) * 1e3, 4), "hlo": hlo_stats(decode)}
    return report, step, (token, cache)


def plain_decoder(model, args):
    """(report, step, first carry) of the plain-JAX decoder on the same weights."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from decoders import plain_forward, plain_generate, plain_weights
    from generate import prompts

    from jaxpar.inference.generate import bucket

    cfg, dtype = model.cfg, jnp.dtype(str(model.execution.dtype))
    weights, slots = plain_weights(model), bucket(args.prompt + args.new)
    rows = np.array(prompts(cfg, 1, args.prompt))
    plain_generate(weights, cfg, rows, args.new, slots, dtype)  # compiles
    _, times = plain_generate(weights, cfg, rows, args.new, slots, dtype)
    shape = (1, cfg.num_kv_heads, slots, cfg.head_dim)
    caches = [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(cfg.num_layers)]
    jitted = jax.jit(plain_forward, static_argnums=4, donate_argnums=1)
    start = jnp.int32(args.prompt)
    token = jnp.zeros((1,), jnp.int32)
    compiled = jitted.lower(weights, caches, token[:, None], start, cfg).compile()
    step = lambda c: compiled(weights, c[1], c[0][:, None], start)
    report = {"loop_step_ms": round(statistics.median(times) * 1e3, 4), "hlo": hlo_stats(compiled)}
    return report, step, (token, caches)


def child(args) -> dict:
    """One variant, in this process: both decoders, and the profile if asked."""
    import jax
    from generate import init_model

    from jaxpar.models import ExecutionConfig, get_model_preset

    dtype = "float32" if args.quick else "bfloat16"
    cfg = get_model_preset(args.model, param_dtype=dtype)
    model = init_model(cfg, ExecutionConfig(dtype=dtype))
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dtype": dtype}
    decoders = {"jaxpar generate": jaxpar_decoder, "plain JAX": plain_decoder}
    steps = {}
    for name, make in decoders.items():
        try:
            report, step, carry = make(model, args)
            timing, carry = chained(step, carry, args.steps)
            steps[name], out[name] = (step, carry), report | timing
        except Exception as e:  # noqa: BLE001 (the other decoder still runs; the error is the result)
            out[name] = {"error": repr(e)[-2000:]}
    if args.trace:
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                for name, (step, carry) in steps.items():
                    with jax.profiler.TraceAnnotation(name):
                        chained(step, carry, 4)  # each decoder's last use
            with tarfile.open(args.trace, "w:gz") as tar:
                tar.add(tmp, arcname="trace")
    return out


def main(argv=None) -> int:
    from generate import emit

    args = _args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(args)))
        return 0
    result = {"model": args.model, "prompt": args.prompt, "new": args.new, "batch": 1, "variants": {}}
    for i, (name, flags) in enumerate(VARIANTS.items()):
        cmd = [sys.executable, __file__, "--child", name, "--model", args.model, "--prompt", str(args.prompt)]
        cmd += ["--new", str(args.new), "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
        cmd += ["--trace", args.trace] if args.trace and i == 0 else []
        env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.limit)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            found = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            found = {"error": f"over {args.limit} s"}
        result["variants"][name] = {"xla_flags": flags} | found
        emit(result, args.out)  # after every variant: a run stopped at its limit keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
