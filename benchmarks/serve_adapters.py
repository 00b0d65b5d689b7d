"""What serving LoRA adapters from a bank costs (``jaxpar.inference.adapters``): the same requests through
one engine without adapters, and through one with a bank of ADAPTERS adapters (rank RANK on every
projection), every request on the base model and every request on an adapter, spread over all of them.

Each run: REQUESTS greedy requests of PROMPT prompt tokens and NEW new tokens, all submitted at once,
SLOTS rows decoding together (after ``warm_up``: no compile inside). The decode step's time is the
median over the engine's steps that decoded SLOTS rows and prefilled nothing, and the decode rate
SLOTS tokens over it. One CPU device.

    python benchmarks/serve_adapters.py --out benchmarks/results/serve_adapters_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
from machine import machine

MODEL, RANK, ADAPTERS = "llama-100m", 16, 4
TARGETS = "q,k,v,o,gate_up,down"
REQUESTS, PROMPT, NEW, SLOTS = 16, 32, 64, 8


def _adapters(base, folder: Path) -> list:
    """ADAPTERS PEFT folders for ``base`` (random A and B), read back as bank entries."""
    import jax
    from flax import nnx

    from jaxpar.convert import save_adapter
    from jaxpar.inference.adapters import read_peft
    from jaxpar.layers.lora import LoraConfig, LoraParam
    from jaxpar.models import build_model

    out = []
    for i in range(ADAPTERS):
        model = build_model(
            dataclasses.replace(base.cfg, lora=LoraConfig(rank=RANK, targets=TARGETS)), rngs=nnx.Rngs(i)
        )
        nnx.update(model, nnx.state(base))
        rng = np.random.default_rng(i)
        for _, var in nnx.to_flat_state(nnx.state(model, LoraParam)):
            value = var.get_value()
            var.set_value(jax.numpy.asarray(rng.normal(0, 0.02, value.shape), value.dtype))
        save_adapter(model, folder / f"a{i}")
        out.append(read_peft(f"a{i}", folder / f"a{i}", base))
    return out


def run(base, adapters, slots_of) -> dict:
    """One engine over the requests, request i on adapter slot ``slots_of(i)``."""
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.scheduler import Request

    engine = Engine(base, max_slots=SLOTS, page_size=16, max_length=PROMPT + NEW, chunk=PROMPT, adapters=adapters)
    engine.warm_up()
    rng = np.random.default_rng(0)
    requests = [
        Request(i, rng.integers(0, base.cfg.vocab_size, PROMPT).tolist(), NEW, adapter=slots_of(i))
        for i in range(REQUESTS)
    ]
    engine.run(requests)
    full = [s.seconds for s in engine.log if s.decoded == SLOTS and not s.prefilled]
    step = statistics.median(full)
    return dict(steps=len(full), step_ms=round(1000 * step, 2), decode_tokens_per_s=round(SLOTS / step, 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from flax import nnx

    from jaxpar.models import build_model, get_model_preset

    base = build_model(get_model_preset(MODEL), rngs=nnx.Rngs(0))
    with tempfile.TemporaryDirectory() as tmp:
        adapters = _adapters(base, Path(tmp))
    runs = {
        "bank, adapter rows": run(base, adapters, lambda i: 1 + i % ADAPTERS),
        "bank, base rows": run(base, adapters, lambda i: 0),
        "no bank": run(base, (), lambda i: 0),
    }
    plain = runs["no bank"]["decode_tokens_per_s"]
    result = dict(
        benchmark="serve_adapters",
        model=MODEL,
        adapters=ADAPTERS,
        rank=RANK,
        targets=TARGETS,
        requests=REQUESTS,
        prompt=PROMPT,
        new_tokens=NEW,
        slots=SLOTS,
        **machine(),
        runs=runs,
        over_no_bank={k: round(v["decode_tokens_per_s"] / plain, 3) for k, v in runs.items()},
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
