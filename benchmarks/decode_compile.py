"""Compile time of the unrolled decode step against the layer count (issue 33).

    python benchmarks/decode_compile.py --out benchmarks/results/decode_compile_cpu.json

Generation runs each layer unrolled with its own weights and cache (``jaxpar.inference.unstack``), so
the decode program grows with depth. For the llama-100m shape (``--model``) with ``--layers`` layers
(8, 32, 80 by default; only the layer count changes), batch ``--batch`` and ``--slots`` cache slots,
this lowers and compiles ``Generator``'s decode step from shapes alone (``compile_decode``: no weights
allocated) and reports per layer count: ``lower_s`` (tracing and lowering; prefill is lowered too),
``compile_s`` (XLA compiling the decode step), the number of HLO instructions, the
large copies (``large_copies``: copy, slice and dynamic-slice of an operand at least as large as the
smallest weight; ``cache_copies``: copies of a whole cache array), and the bytes a step moves (XLA's
``bytes accessed``, and that less ``cost_overcount``) against the floor (weights + cache read + new
entries + the sampler's own bytes).
Each count is compiled ``--repeats`` times (the compilation cache off); the fastest compile is kept.
Prints one JSON object and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import sys


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama-100m")
    p.add_argument("--layers", default="8,32,80", help="comma-separated layer counts")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--slots", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def one(cfg, layers: int, args) -> dict:
    """The decode step of ``cfg`` with ``layers`` layers: compile time, size, copies and bytes."""
    from jaxpar.analysis.copies import cache_copies, compile_decode, large_copies

    cfg = dataclasses.replace(cfg, num_layers=layers)
    best = None
    for _ in range(args.repeats):
        step = compile_decode(cfg, batch=args.batch, slots=args.slots)
        best = step if best is None or step.compile_s < best.compile_s else best
    text = best.compiled.as_text()
    copies = large_copies(text, min_elements=best.smallest_weight)
    return {
        "layers": layers,
        "lower_s": round(best.lower_s, 3),
        "compile_s": round(best.compile_s, 3),
        "hlo_instructions": sum(1 for line in text.splitlines() if " = " in line),
        "large_copies": len(copies),
        "large_dynamic_slices": sum(c.kind == "dynamic-slice" for c in copies),
        "large_copies_of_weights": sum("state[" in c.op_name for c in copies),
        "cache_copies": len(cache_copies(large_copies(text, min_elements=2), best.cache_shapes)),
        "bytes_accessed": best.bytes_accessed,
        "bytes_moved": best.bytes_moved,
        "floor_bytes": best.floor_bytes,
        "sampler_bytes": best.sampler_bytes,
        "bytes_ratio": round(best.bytes_moved / (best.floor_bytes + best.sampler_bytes), 4),
    }


def main(argv=None) -> int:
    args = parse(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from jaxpar.models import get_model_preset

    cfg = get_model_preset(args.model)
    rows = []
    for n in (int(x) for x in args.layers.split(",")):
        rows.append(one(cfg, n, args))
        print(json.dumps(rows[-1]), file=sys.stderr)
    result = {
        "model": args.model,
        "batch": args.batch,
        "slots": args.slots,
        "device": jax.devices()[0].device_kind,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "rows": rows,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
