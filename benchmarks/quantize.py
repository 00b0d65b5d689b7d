"""What storing the weights quantized (``model.quantize``: int8, int4, fp8; ``jaxpar.layers.codes``) saves
and costs on this machine, against the same model in bfloat16.

For MODEL with random weights (bfloat16 parameters), each format:

* the projections' stored bytes, and the compiled forward's argument and temporary bytes;
* greedy decode tokens/s at batch 1 and 8 (``Generator``, one CPU device; the second of two runs, so
  no compile is timed): on a CPU the dequantization is extra work in every step, not saved bandwidth;
* agreement with the bfloat16 model on PROMPTS prompts of NEW tokens: the logit error along the
  bfloat16 model's own sequences (teacher-forced), as a share of its logits' spread, and how many
  tokens agree before the first difference (a difference where the bfloat16 model's top-two gap is
  within twice the error is the margin rule's allowance, counted apart).

    python benchmarks/quantize.py --out benchmarks/results/quantize_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
from machine import machine

MODEL, PROMPTS, PROMPT, NEW = "llama-100m", 8, 16, 32
FORMATS = ("none", "int8", "fp8", "int4")


def _bytes(model) -> dict:
    import jax
    from flax import nnx

    from jaxpar.layers.lora import SPECS
    from jaxpar.layers.quant import Quantized

    graphdef, state = nnx.split(model)
    compiled = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, np.zeros((1, 1), np.int32)).compile()
    stored = sum(
        var.get_value().nbytes
        for path, var in nnx.to_flat_state(state)
        if isinstance(var, Quantized) or str(path[-1]) in SPECS
    )
    memory = compiled.memory_analysis()
    return dict(weights=stored, arguments=memory.argument_size_in_bytes, temporaries=memory.temp_size_in_bytes)


def _speed(model, prompts) -> dict:
    from jaxpar.inference.generate import Generator

    gen, out = Generator(model), {}
    for batch in (1, 8):
        for _ in range(2):  # the second: compiled
            result = gen.generate(prompts[:batch], max_new_tokens=NEW)
        out[f"batch_{batch}_tokens_per_s"] = round(result.decode_tokens_per_s, 1)
    return out


def _agreement(reference, model, prompts, tokens, logits) -> dict:
    """The logit error along the reference's sequences and the tokens agreed before the first difference."""
    import jax

    run = jax.jit(lambda m, ids: m(ids))
    error, spread, agreed, allowed = 0.0, 0.0, 0, 0
    got = _greedy(model, prompts)[0]
    for prompt, want, want_logits, mine in zip(prompts, tokens, logits, got):
        seq = np.asarray([prompt + want], np.int32)
        rows = slice(len(prompt) - 1, seq.shape[1] - 1)
        f = np.asarray(run(reference, seq), np.float32)[0, rows]
        q = np.asarray(run(model, seq), np.float32)[0, rows]
        error, spread = max(error, float(np.abs(f - q).max())), max(spread, float(f.std()))
        same = next((i for i, (a, b) in enumerate(zip(want, mine)) if a != b), len(want))
        agreed += same
        if same < len(want):
            top2 = np.sort(np.asarray(want_logits[same]))[-2:]
            allowed += int(top2[1] - top2[0] <= 2 * error)
    return dict(
        logit_error=round(error, 5),
        relative_error=round(error / spread, 4),
        tokens_agreed=agreed,
        tokens=len(prompts) * NEW,
        differences_within_margin=allowed,
        differences=sum(1 for t, m in zip(tokens, got) if t != m),
    )


def _greedy(model, prompts):
    from jaxpar.inference.generate import Generator

    out = Generator(model).generate(prompts, max_new_tokens=NEW, return_logits=True)
    return out.tokens, out.logits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import jax
    from flax import nnx

    from jaxpar.convert import quantized_model
    from jaxpar.models import build_model, get_model_preset
    from jaxpar.shardings import default_layout

    cfg = dataclasses.replace(get_model_preset(MODEL), param_dtype="bfloat16")
    base = build_model(cfg, rngs=nnx.Rngs(0))
    layout = default_layout(cfg, "dp", devices=jax.devices()[:1])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, PROMPT).tolist() for _ in range(PROMPTS)]
    tokens, logits = _greedy(base, prompts)
    formats = {}
    for kind in FORMATS:
        model = base if kind == "none" else quantized_model(base, kind, layout)
        formats[kind] = dict(bytes=_bytes(model), decode=_speed(model, prompts))
        if kind != "none":
            formats[kind]["agreement"] = _agreement(base, model, prompts, tokens, logits)
        print(kind, json.dumps(formats[kind]))
    plain = formats["none"]
    for entry in formats.values():
        entry["weights_over_bf16"] = round(entry["bytes"]["weights"] / plain["bytes"]["weights"], 3)
        entry["speed_over_bf16"] = {k: round(v / plain["decode"][k], 3) for k, v in entry["decode"].items()}
    result = dict(
        benchmark="quantize",
        model=MODEL,
        param_dtype="bfloat16",
        prompts=PROMPTS,
        prompt=PROMPT,
        new_tokens=NEW,
        **machine(),
        formats=formats,
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
