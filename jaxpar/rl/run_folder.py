"""The run folder of ``jaxpar grpo``: config.json, metrics.jsonl and orbax checkpoints of the train state,
and the resume from the newest of them (``jaxpar.rl.command`` has the layout of the folder)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from jaxpar.checkpoint import Checkpointer, abstract_like, latest
from jaxpar.execution import ExecutionConfig
from jaxpar.inference.command import model_config, parse_ids
from jaxpar.rl.loop import run_grpo

KEEP = 2  # checkpoints kept


class RunFolder:
    def __init__(self, out: Path, config: dict, *, save_every: int, iterations: int, stop_after: int | None):
        self.out, self.config, self.iterations, self.stop_after = out, config, iterations, stop_after
        self.saved = latest(out / "checkpoints")
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        self.checkpoints = Checkpointer(out / "checkpoints", every=save_every, keep=KEEP)
        self.done = 0 if self.saved is None else self.saved.step
        self._metrics(self.done)

    def _metrics(self, done: int) -> None:
        """metrics.jsonl cut back to the records of the iterations the newest checkpoint holds."""
        path = self.out / "metrics.jsonl"
        if not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["iteration"] <= done]
        path.write_text("".join(line + "\n" for line in kept))

    def resume(self, state):
        """(the saved state placed as ``state``, its iteration), or ``state`` at 0 for a fresh run."""
        if self.saved is None:
            return state, 0
        abstract = abstract_like(jax.eval_shape(lambda: state), jax.tree.map(lambda x: x.sharding, state))
        restored, position = self.checkpoints.restore(self.saved.step, abstract)
        return restored, int(position["iteration"])

    def save(self, iteration: int, state) -> None:
        last = iteration in (self.iterations, self.stop_after)
        self.checkpoints.save(iteration, state=state, data={"iteration": iteration}, config=self.config, force=last)

    def log(self, record: dict) -> None:
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def train(self, model_cfg, prompts, reward, *, grpo, optimizer, args, kind) -> int:
        """Runs (or resumes) the iterations; returns how many the folder now holds."""
        try:
            run = run_grpo(
                model_cfg,
                prompts,
                reward,
                cfg=grpo,
                iterations=args.iterations,
                optimizer=optimizer,
                mesh=args.mesh,
                execution=ExecutionConfig(capacity_factor=None),
                seed=args.seed,
                stop_ids=[] if args.stop_ids is None else parse_ids(args.stop_ids, "--stop-ids"),
                engine_mesh=args.engine_mesh,
                init=None if kind is None else _weights(kind, args.init_from),
                log=self.log,
                resume=self.resume,
                save=self.save,
                until=args.stop_after,
            )
        finally:
            self.checkpoints.close()
        return self.done + len(run.records)


def _weights(kind: str, folder: str):
    """The starting model of --init-from, on one device (the run places it on its layout)."""
    from jaxpar.convert import from_hf
    from jaxpar.convert.store import load_model
    from jaxpar.shardings import default_layout

    if kind == "hf":
        return from_hf(folder)
    cfg = model_config(kind, folder)[0]
    return load_model(folder, default_layout(cfg, "dp", devices=jax.devices()[:1]))[0]
