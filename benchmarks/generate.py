"""Generation throughput and latency: prefill tokens/s, time to first token, decode tokens/s, inter-token
latency, the KV cache's bytes per token, and how close a decode step comes to the memory roofline.

    python benchmarks/generate.py --out benchmarks/results/generate_cpu.json        # CPU, ~3 min idle
    python benchmarks/generate.py --quick                                           # tiny only, ~40 s
    python benchmarks/generate.py --gpu --out benchmarks/results/generate_gpu.json   # llama3-8b shape, bf16

Prints one JSON object (and writes it to ``--out``). For each model (``--models``; float32 on CPU) and
batch (``--batches``) it builds the model with random weights (a jitted init with ``out_shardings``, so
the weights are born on the device), makes a one-device ``Generator`` and runs ``generate`` twice on
random prompts of ``--prompt`` tokens (128) for ``--new`` greedy tokens (64; so 256 cache slots; no EOS,
every row runs to the end): the first call compiles (its ``compile_s`` is reported), the second is the
one measured. Reported:

- ``prefill_tokens_per_s`` = batch × prompt / prefill_s; ``ttft_s``; ``decode_tokens_per_s`` (all rows)
  and per sequence; inter-token latency p50/p99 from the per-step times (each step includes the host
  fetch of the sampled tokens, as a streaming client would see).
- ``kv_bytes_per_token``: the nbytes of the cache pytree (``model.empty_cache(batch, slots)``, asserted
  to have the shapes and dtypes of the cache the compiled prefill returns and decode takes) ÷ (batch ×
  slots), beside the formula 2·L·K·H·bytes (GQA) or (kv_lora_rank + qk_rope_head_dim)·L·bytes (MLA); the
  script asserts they are equal. ``--kv-models`` (default tiny-deepseek, MLA) are checked this way only.
- ``roofline``: a decode step must read every weight and the whole cache it attends over (the decode
  attends over all ``slots``, masked, not only the filled ones), so bytes/step = weight bytes (all
  parameters' nbytes) + batch × slots × KV bytes per token. Achieved bandwidth = bytes / median step;
  ``ratio`` = achieved / peak. The embedding table is read by a gather of ``batch`` rows only, so
  ``ratio_without_embedding`` leaves it out. For scale, ``flops`` per step (2 × non-embedding params ×
  batch + attention over every slot) and the step's compute floor at the measured matmul rate, and
  ``sampler_ms``: the step's sampler alone (greedy settings) on [batch, vocab] logits.

Peak bandwidth (``peak``): on CPU, measured once — a large numpy copy (bytes read + written / time) and a
numpy sum (bytes read / time), best of ``--bw-repeats``, on one thread and on every core; the largest is
the peak (``used`` names it). With ``--gpu``, the HBM bandwidth of the device's
``jaxpar.analysis.hardware`` profile (H100, H200, B200: SXM datasheet numbers), beside a measured
on-device copy, which is used only when no profile matches. On a shared host the CPU numbers move with
the load (the JSON records the load average before and after).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time

from peaks import best_seconds, device_bandwidth, gpu_peak, host_bandwidth, matmul_gflops  # noqa: F401 (lab_gpu.py)


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,llama-100m")
    p.add_argument("--kv-models", default="tiny-deepseek", help="models checked for KV bytes/token only")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--new", type=int, default=64, help="new tokens per sequence")
    p.add_argument("--bw-mib", type=int, default=512, help="array size of the bandwidth copy")
    p.add_argument("--bw-repeats", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="tiny only, batch 1 and 8, 32 + 16 tokens")
    p.add_argument("--gpu", action="store_true", help="llama3-8b shape in bf16 at batch 1 and 64, one device")
    p.add_argument("--peers", action="store_true", help="compare decoders (benchmarks/decoders.py) instead")
    p.add_argument("--rounds", type=int, default=3, help="--peers: interleaved rounds")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.kv_models, args.batches, args.prompt, args.new = "tiny", "tiny-deepseek", "1,8", 32, 16
    if args.gpu:
        args.models, args.kv_models, args.batches = "llama3-8b", "", "1,64"
    return args


# --------------------------------------------------------------------------------------- the model
def init_model(cfg, execution=None):
    """The model (run as ``execution`` says) with random weights born on one device: the init jitted with
    ``out_shardings`` of the decode layout the ``Generator`` uses, so no host copy of the weights is ever
    made."""
    import jax
    from flax import nnx

    from jaxpar.inference.layouts import build_inference_mesh, weight_layout
    from jaxpar.models import build_model

    name, mesh = build_inference_mesh("decode_dp", devices=jax.devices()[:1])
    layout = weight_layout(cfg, mesh, name)
    create = lambda: build_model(cfg, execution=execution, rngs=nnx.Rngs(params=0))
    with layout.activate():
        graphdef, abstract = nnx.split(nnx.eval_shape(create))
        shardings = nnx.get_named_sharding(abstract, mesh)
        state = jax.jit(lambda: nnx.state(create()), out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def tree_bytes(tree) -> int:
    import jax

    return sum(int(x.nbytes) for x in jax.tree.leaves(tree))


def kv_formula(cfg, execution) -> tuple[int, str]:
    """KV-cache bytes per token by formula (the cache holds the compute dtype), and the formula in words."""
    import jax.numpy as jnp

    size = jnp.dtype(str(execution.dtype)).itemsize
    if cfg.uses_mla:
        m = cfg.mla
        return (
            (m.kv_lora_rank + m.qk_rope_head_dim) * cfg.num_layers * size,
            f"(kv_lora_rank {m.kv_lora_rank} + qk_rope_head_dim {m.qk_rope_head_dim}) · L {cfg.num_layers} · {size} B",
        )
    return (
        2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size,
        f"2 · L {cfg.num_layers} · K {cfg.num_kv_heads} · H {cfg.head_dim} · {size} B",
    )


def model_facts(model) -> dict:
    """Weight bytes (all parameters), the embedding table's bytes and the non-embedding element count."""
    import jax
    from flax import nnx

    params, embed = nnx.state(model, nnx.Param), nnx.state(model.embed, nnx.Param)
    count = lambda t: sum(int(x.size) for x in jax.tree.leaves(t))
    return {
        "params": count(params),
        "weight_bytes": tree_bytes(params),
        "embedding_bytes": tree_bytes(embed),
        "matmul_params": count(params) - count(embed),
    }


def prompts(cfg, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, length)).tolist()


def measured_cache(gen, batch: int, prompt: int, new: int) -> dict:
    """The cache arrays for this shape (``empty_cache``, checked against the cache the compiled prefill
    returns and decode takes): total bytes, slots, and bytes per token (÷ batch × slots), asserted equal
    to the formula."""
    import jax

    from jaxpar.inference.generate import bucket
    from jaxpar.layers.kvcache import slot_axis

    slots = bucket(prompt + new)
    prefill, _ = gen.programs(batch, bucket(prompt), slots)
    cache = gen.model.empty_cache(batch, slots)
    spec = lambda tree: jax.tree.map(lambda x: (x.shape, str(x.dtype)), tree)
    assert spec(cache) == spec(prefill.out_info[2]), (spec(cache), spec(prefill.out_info[2]))
    total = tree_bytes(cache)
    layers = jax.tree.leaves(cache, is_leaf=lambda c: hasattr(c, "NAMES"))
    kept = {x.shape[slot_axis(names)] for c in layers for x, names in zip(jax.tree.leaves(c), c.NAMES)}  # S per array
    assert len(kept) == 1, kept
    per_token, words = kv_formula(gen.cfg, gen.model.execution)
    measured = total / (batch * kept.pop())
    assert measured == per_token, (gen.cfg, measured, per_token)
    return {
        "slots": slots,
        "cache_bytes": total,
        "kv_bytes_per_token": int(measured),
        "kv_bytes_per_token_formula": per_token,
        "formula": words,
    }


def sampler_ms(cfg, batch: int, repeats: int = 20) -> float:
    """Median ms of the decode step's sampler alone (``sample``, greedy: the generator's greedy program) on
    [batch, vocab] logits."""
    import jax
    import jax.numpy as jnp

    from jaxpar.inference.sampling import SamplingParams, sample

    logits = jax.random.normal(jax.random.key(0), (batch, cfg.padded_vocab), jnp.float32)
    params, positions = SamplingParams.greedy(batch), jnp.zeros(batch, jnp.int32)
    f = jax.jit(functools.partial(sample, draws=False))
    jax.block_until_ready(f(logits, params, positions))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(logits, params, positions))
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


def roofline(facts: dict, kv: dict, cfg, batch: int, step_s: float, peak_gb_s: float, gflops: float) -> dict:
    """Bytes a decode step reads (weights + the whole cache), achieved GB/s and its share of the peak;
    the step's FLOPs and their floor at the measured matmul rate."""
    read = facts["weight_bytes"] + kv["cache_bytes"]
    lean = read - facts["embedding_bytes"]
    heads = cfg.num_heads * (cfg.mla.kv_lora_rank if cfg.uses_mla else cfg.head_dim)
    flops = 2 * facts["matmul_params"] * batch + 4 * batch * cfg.num_layers * heads * kv["slots"]
    gb_s = read / step_s / 1e9
    return {
        "bytes_per_step": read,
        "weight_bytes": facts["weight_bytes"],
        "kv_bytes_read": kv["cache_bytes"],
        "achieved_gb_s": round(gb_s, 2),
        "ratio": round(gb_s / peak_gb_s, 4),
        "ratio_without_embedding": round(lean / step_s / 1e9 / peak_gb_s, 4),
        "memory_floor_ms": round(read / peak_gb_s / 1e6, 3),
        "flops_per_step": flops,
        "compute_floor_ms": round(flops / gflops / 1e6, 3),
        "median_step_ms": round(step_s * 1e3, 3),
    }


# --------------------------------------------------------------------------------------- the runs
def bench_batch(gen, facts: dict, batch: int, args, peak_gb_s: float, gflops: float) -> dict:
    """Two ``generate`` calls at ``batch``; the second measured, the first's compile time reported."""
    import numpy as np

    batch_prompts = prompts(gen.cfg, batch, args.prompt, seed=batch)
    first = gen.generate(batch_prompts, max_new_tokens=args.new)
    run = gen.generate(batch_prompts, max_new_tokens=args.new)
    assert all(len(t) == args.new for t in run.tokens), "a row stopped early"
    kv = measured_cache(gen, batch, args.prompt, args.new)
    median = statistics.median(run.step_s)
    p50, p99 = (float(np.percentile(run.step_s, q)) for q in (50, 99))
    row = {
        "batch": batch,
        "compile_s": round(first.compile_s, 2),
        "prefill_s": round(run.prefill_s, 6),
        "prefill_tokens_per_s": round(batch * args.prompt / run.prefill_s, 1),
        "ttft_s": round(run.time_to_first_token_s, 4),
        "decode_s": round(run.decode_s, 4),
        "decode_steps": len(run.step_s),
        "decode_tokens_per_s": round(run.decode_tokens_per_s, 1),
        "decode_tokens_per_s_per_sequence": round(run.decode_tokens_per_s / batch, 2),
        "inter_token_ms_p50": round(p50 * 1e3, 3),
        "inter_token_ms_p99": round(p99 * 1e3, 3),
        "inter_token_ms_max": round(max(run.step_s) * 1e3, 3),
    }
    line = roofline(facts, kv, gen.cfg, batch, median, peak_gb_s, gflops) | {"sampler_ms": sampler_ms(gen.cfg, batch)}
    return row | {"kv": kv, "roofline": line}


def bench_model(name: str, args, peak_gb_s: float, gflops: float, *, dtype: str = "float32", **overrides) -> dict:
    """``dtype``: the compute dtype (``execution.dtype``); ``overrides``: model config fields."""
    from jaxpar.inference.generate import Generator
    from jaxpar.models import ExecutionConfig, get_model_preset

    cfg = get_model_preset(name, **overrides)
    t0 = time.perf_counter()
    model = init_model(cfg, ExecutionConfig(dtype=dtype))
    gen = Generator(model)
    init_s = time.perf_counter() - t0
    facts = model_facts(gen.model)
    rows = []
    for batch in map(int, args.batches.split(",")):
        rows.append(bench_batch(gen, facts, batch, args, peak_gb_s, gflops))
        print(json.dumps({name: rows[-1]}), file=sys.stderr)
    return {
        "dtype": dtype,
        "param_dtype": str(cfg.param_dtype),
        "init_s": round(init_s, 2),
        **facts,
        "batches": rows,
    }


def kv_only(name: str, args) -> dict:
    """The KV-bytes check alone (for MLA): one compiled prefill at batch 2."""
    from jaxpar.inference.generate import Generator
    from jaxpar.models import get_model_preset

    gen = Generator(init_model(get_model_preset(name)))
    return measured_cache(gen, 2, args.prompt, args.new) | {"batch": 2, "mla": gen.cfg.uses_mla}


def _load() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def main(argv=None) -> int:
    args = _args(argv)
    import jax

    result = {
        "host": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "prompt": args.prompt,
        "new_tokens": args.new,
        "sampling": "greedy",
        "load_avg_before": _load(),
    }
    if args.gpu:
        overrides = dict(dtype="bfloat16", param_dtype="bfloat16")
        result["peak"] = gpu_peak(2048, args.bw_repeats)
    else:
        overrides = {}
        result["peak"] = {
            "source": "measured on the host: the best of a numpy copy (read + written bytes / s) "
            "and a numpy sum (read bytes / s), on one thread and on all cores"
        } | host_bandwidth(args.bw_mib, args.bw_repeats)
    if args.peers:
        from decoders import compare  # benchmarks/decoders.py, beside this script

        batches = [int(b) for b in args.batches.split(",")]
        result["peers"] = [
            compare(m, batches, args.prompt, args.new, args.rounds, result["peak"]["gb_s"])
            for m in args.models.split(",")
        ]
        return _finish(result, args)
    dtype = overrides.get("dtype", "float32")
    result["matmul_gflops"] = {"dtype": dtype, "gflops": matmul_gflops(dtype, 4096 if args.gpu else 2048)}
    print(json.dumps({"peak": result["peak"], "matmul_gflops": result["matmul_gflops"]}), file=sys.stderr)
    result["models"] = {
        name: bench_model(name, args, result["peak"]["gb_s"], result["matmul_gflops"]["gflops"], **overrides)
        for name in args.models.split(",")
        if name
    }
    result["kv_check"] = {name: kv_only(name, args) for name in args.kv_models.split(",") if name}
    return _finish(result, args)


def _finish(result: dict, args) -> int:
    result["load_avg_after"] = _load()
    emit(result, args.out)
    return 0


def emit(result: dict, out: str | None) -> None:
    """``result`` printed as JSON, and written to ``out`` when given (decode_gpu.py's too)."""
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
