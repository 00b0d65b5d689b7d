"""The layout lab's step breakdown of a pipeline layout under both executors (prints one JSON object).

    python benchmarks/pipeline_plan.py > benchmarks/results/pipeline_plan_70b.json

Prices, with ``jaxpar plan`` (compiled abstractly on simulated CPU devices, predicted on ``--hardware``),
one layout under both executors: gradients reduced in every tick section (the executor then runs one
section a tick on every stage) and once a step (each stage runs its own action,
``jaxpar.pipeline.actions``); and the same with 1F1B instead of ``--schedule``. The default is
Llama 3.1 70B on 64 H100s with NeMo's pipeline shape (4 stages, interleaved with 5 virtual stages, 64
microbatches of one 8,192-token sequence); tensor 8 inside a node and data 2 stand in for NeMo's
tensor 4 × context 2, since jaxpar's own-action executor does not run a sequence split.
"""

from __future__ import annotations

import argparse
import json
import sys


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-70b")
    p.add_argument("--mesh", default="stage=4,tensor=8,data=2")
    p.add_argument("--devices", type=int, default=64)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--schedule", default="interleaved")
    p.add_argument("--virtual-stages", type=int, default=5)
    p.add_argument("--microbatches", type=int, default=64)
    return p.parse_args(argv)


PIPELINE_KEYS = ("durations", "executor", "bubble_fraction", "lockstep_bubble_fraction", "executor_bubble_fraction")


def _summary(p) -> dict:
    """The parts of a ``Plan`` the docs' breakdown shows."""
    parts = {k: round(v, 4) for k, v in p.times["parts"].items() if isinstance(v, (int, float))}
    return dict(
        step_s=round(p.predicted_step_s, 3),
        tokens_per_s=round(p.predicted_tokens_per_s),
        mfu=round(p.predicted_mfu, 4),
        flops_per_device=p.flops_per_device,
        model_flops_per_device=p.model_flops_per_device,
        parts_s=parts,
        bytes_by_axis_gb={k: round(v / 1e9, 3) for k, v in p.bytes_by_axis.items()},
        memory_gb={k: round(v / 1e9, 2) for k, v in p.memory_parts.items()},
        pipeline={k: p.pipeline[k] for k in PIPELINE_KEYS},
    )


def main(argv=None) -> int:
    args = _args(argv)
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    from jaxpar.analysis.plan import plan

    fields = ("batch", "seq", "hardware", "schedule", "virtual_stages", "microbatches")
    layout = {k: getattr(args, k) for k in fields}
    command = (
        f"jaxpar plan --model {args.model} --mesh {args.mesh} --devices {args.devices} --batch {args.batch} "
        f"--seq {args.seq} --hardware {args.hardware} --schedule {args.schedule} --virtual-stages "
        f"{args.virtual_stages} --microbatches {args.microbatches} --grad-reduce GRAD_REDUCE"
    )
    run = lambda **kw: _summary(plan(args.model, args.mesh, devices=args.devices, **(layout | kw)))
    runs = {
        f"{args.schedule} / slice": run(grad_reduce="slice"),
        f"{args.schedule} / step": run(grad_reduce="step"),
        "1f1b / step": run(grad_reduce="step", schedule="1f1b", virtual_stages=1),
    }
    print(json.dumps(dict(benchmark="pipeline_plan", command=command, layout=vars(args), runs=runs), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
