"""The training run: check everything, then init or resume, step, evaluate, log and checkpoint.

    train(cfg, out_dir) -> RunResult

Order of work, so that bad input costs nothing and loses nothing:
  1. checks that need no writes: config, mesh and layout (divisibility; ``layout.py``), data files
     (ids < vocab), and the run directory and ``init_from`` (``rundir.py``, with ``jaxpar.identity``: a
     checkpoint or config.json of another run, or a checkpoint whose arrays do not fit, is refused,
     listing every difference)
  2. only then: init (or restore + reshard) the state; once it exists, write DIR/config.json (under a
     temporary name, renamed into place), then compile and train

Step numbering: checkpoint ``s`` holds the state after ``s`` optimizer updates and the data position of
batch ``s + 1``; a run that finds one resumes at step ``s + 1`` and, with the same config, produces the
same losses bit for bit as a run that was never interrupted.

Metrics are read one step late: step ``s + 1`` is dispatched before step ``s``'s loss is fetched, so the
host never idles the devices to log. Except before a checkpoint or an eval: there the step's own metrics
are fetched first and pass the non-finite guard (``guard.py``), so a NaN state is never saved.

Stopping early (``guard.py``): a preemption notice (SIGTERM) ends the run after the step in flight, with
a checkpoint of it; a non-finite step stops the run (or is skipped, by policy). A run killed outright
resumes from its last complete checkpoint: orbax finishes a checkpoint by renaming its directory, and
an unfinished one is never listed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxpar.checkpoint import Checkpointer, SavedRun, abstract_like
from jaxpar.convert.base import BASE_JSON, adapters_only, base_record, check_base, without_base
from jaxpar.data import make_loader, to_global
from jaxpar.layout import Layout
from jaxpar.models import build_model
from jaxpar.train.config import ConfigError, Objective, TrainConfig, to_dict
from jaxpar.train.guard import NonFinite, NonFiniteError, NonFiniteGuard, Preemption
from jaxpar.train.layout import batch_slices, pipeline_table, plan_layout, stack_split
from jaxpar.train.layout import check_process_rows as check_process_rows  # imported from here by callers
from jaxpar.train.loss import BATCH_KEYS, next_token_loss
from jaxpar.train.metrics import MetricsLog, throughput
from jaxpar.train.optim import make_optimizer, make_schedule
from jaxpar.train.preference import Reference, preference_loss
from jaxpar.train.reference import ensure_reference, readers
from jaxpar.train.rundir import check_init_from, check_out_dir, with_weights_of, write_json
from jaxpar.train.step import InitProgram, TrainState, batch_sharding, init_program, make_eval_step, make_train_step

BARRIER_TIMEOUT_S = 3600  # how long processes wait for each other at a barrier (compiles can be slow)


@dataclasses.dataclass(frozen=True)
class RunResult:
    out_dir: Path
    start_step: int  # the step the run began after (0, or the checkpoint it resumed)
    last_step: int
    losses: dict[int, float]  # step -> training cross-entropy
    eval_losses: dict[int, float]
    entropy_rate: float | None  # of the synthetic source, when that is the data
    preempted: bool = False  # stopped after last_step by a preemption notice (checkpoint saved)


def moe_record(stats, /, *, slices: int) -> dict:
    """What the logs show of MoE layers (stats stacked [L, ...], averaged over ``slices`` batch slices): the
    weighted balancing and router z-losses, the share of assignments capacity dropped (mean over layers;
    overflow is silent otherwise) and each expert's assignments per step, summed over layers."""
    load = np.asarray(stats.expert_load, np.float64).reshape(-1, np.shape(stats.expert_load)[-1])
    return {
        "moe_aux_loss": float(np.sum(stats.aux_loss)),
        "router_z_loss": float(np.sum(stats.router_z_loss)),
        "dropped_fraction": float(np.mean(stats.dropped_fraction)),
        "expert_tokens": [round(x) for x in load.sum(0) * slices],
    }


def all_processes_reach(name: str, /) -> None:
    """Several processes: wait here for all of them (a coordination-service barrier, through orbax).
    Gloo, XLA:CPU's collectives between processes, gives a process 30 s to meet its peers at a group's
    first collective; compile times on a loaded host differ by more than that."""
    if jax.process_count() > 1:
        ocp.multihost.get_barrier_sync_fn()(key=f"jaxpar-{name}", timeout_ms=BARRIER_TIMEOUT_S * 1000)


def _make_loaders(cfg: TrainConfig, references: dict) -> dict:
    """The train loader, and the eval loader when the run evaluates: both check their token files now.
    ``references``: {split: reader} of DPO's precomputed reference log-probs (``reference.py``)."""
    loaders = {}
    try:
        for split in ("train", "eval") if cfg.log.eval_every else ("train",):
            loaders[split] = make_loader(
                cfg.data,
                vocab_size=cfg.model.vocab_size,
                seq=cfg.seq,
                global_batch=cfg.batch,
                seed=cfg.seed,
                split=split,
                reference=references.get(split),
            )
    except BaseException:
        for loader in loaders.values():
            loader.close()
        raise
    return loaders


def precomputed_reference(cfg: TrainConfig, layout: Layout) -> bool:
    """Whether the run is DPO with a reference computed before the first step (refused on a pipeline)."""
    if cfg.objective != Objective.DPO:
        return False
    if layout.mesh.shape["stage"] > 1:
        raise ConfigError("objective=dpo on a pipeline (mesh stage > 1): the executor computes next-token loss only")
    return cfg.dpo.resolved(cfg.model.lora.rank) == Reference.PRECOMPUTED


def loss_of(cfg: TrainConfig):
    """The run's loss function (``make_train_step``'s ``loss_fn``)."""
    return functools.partial(preference_loss, cfg=cfg.dpo) if cfg.objective == Objective.DPO else next_token_loss


def _profile_window(spec: str) -> tuple[int, int] | None:
    if not spec:
        return None
    try:
        a, b = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ConfigError(f"--profile-steps {spec!r}: expected FIRST:LAST, e.g. 10:12") from None
    if not 1 <= a <= b:
        raise ConfigError(f"--profile-steps {spec!r}: need 1 ≤ FIRST ≤ LAST")
    return a, b


def train(cfg: TrainConfig, out_dir, /, *, stop_after: int | None = None, devices=None) -> RunResult:
    """Runs (or resumes) ``cfg`` in ``out_dir``. ``stop_after`` ends the run after that step without a
    final checkpoint, as an interruption would (for tests and experiments)."""
    cfg.validate()
    out = Path(out_dir).resolve()  # orbax wants absolute paths
    profile = _profile_window(cfg.log.profile_steps)
    layout = plan_layout(cfg, devices=devices)
    config = to_dict(cfg)
    program = init_program(
        lambda rngs: build_model(cfg.model, execution=cfg.execution, rngs=rngs),
        lambda model: make_optimizer(cfg.optimizer, model, total_steps=cfg.steps),
        layout,
        seed=cfg.seed,
        stack=stack_split(cfg, layout.mesh.shape["stage"]),
    )
    saved = check_out_dir(out, config, _saved_part(config, program.checkpoint_abstract))
    if cfg.init_from and saved is None:
        check_init_from(cfg)
    loaders = _make_loaders(cfg, readers(cfg, out) if precomputed_reference(cfg, layout) else {})
    all_processes_reach("run-directory-read")  # before any process writes to it, every process has read it
    # ---- nothing was written before this line
    if cfg.log.compile_cache:
        jax.config.update("jax_compilation_cache_dir", cfg.log.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        run = _Run(cfg, layout, out, config, loaders, saved, program)
    except BaseException:
        for loader in loaders.values():
            loader.close()
        raise
    try:
        return run.loop(stop_after=stop_after, profile=profile)
    finally:
        run.close()


def _saved_part(config: dict, state):
    """What a checkpoint of the run of ``config`` holds of ``state`` (arrays, abstract ones or their
    shardings): all of it, or without the frozen base (``jaxpar.convert.base.adapters_only``)."""
    return without_base(state) if adapters_only(config) else state


class _Run:
    """The state of one training run between ``train``'s checks and its end."""

    def __init__(
        self,
        cfg: TrainConfig,
        layout: Layout,
        out: Path,
        config: dict,
        loaders: dict,
        saved: SavedRun | None,
        program: InitProgram,
    ):
        self.cfg, self.layout, self.out, self.config = cfg, layout, out, config
        self.loader, self.eval_loader = loaders["train"], loaders.get("eval")
        self.checkpoints = Checkpointer(
            out / "checkpoints",
            every=cfg.checkpoint.every,
            keep=cfg.checkpoint.keep,
            async_save=cfg.checkpoint.async_save,
        )
        try:
            state = self._initial_state(program, saved)
        except BaseException:
            self.checkpoints.close()
            raise
        if jax.process_index() == 0:  # the run's config, once its state exists
            write_json(out / "config.json", config)
        self.ts = TrainState(program.graphdef, state, program.shardings, program.stack)
        self.saved_form = program.saved
        self.metrics = MetricsLog(
            out,
            enabled=jax.process_index() == 0,
            total_steps=cfg.steps,
            start_step=self.start,
            tensorboard=cfg.log.tensorboard,
            progress=cfg.log.progress,
        )
        if saved is not None:
            self.metrics.message(f"resumed from {out / 'checkpoints'} at step {saved.step}")
        if precomputed_reference(cfg, layout):  # before the loaders read their first row
            ensure_reference(cfg, out, self.ts, layout, resumed=saved is not None, message=self.metrics.message)
        self.metrics.message(
            f"{cfg.model_preset}: {cfg.model.num_params():,} params | mesh {dict(layout.mesh.shape)} "
            f"rules {layout.rules.name!r} | data: {self.loader.describe()}"
        )
        self.schedule = make_schedule(cfg.optimizer, cfg.steps)
        self.guard = NonFiniteGuard(cfg.nonfinite, cfg.max_skips, self.checkpoints)
        self.preemption = Preemption()
        self.shardings = batch_sharding(layout, BATCH_KEYS)

    def _initial_state(self, program: InitProgram, saved: SavedRun | None):
        """The state to start from: created (with ``init_from``'s weights), or restored and resharded. A
        run that saves its adapters alone reads its base from ``init_from`` again, and checks it against
        the ``base.json`` it wrote when it started (``jaxpar.convert.base``)."""
        alone = adapters_only(self.config)
        with self.layout.activate():
            form = program.saved  # the layer order of checkpoints, where the state is stored otherwise
            if saved is None:
                self.start = 0
                state = program.create()
                if not self.cfg.init_from:
                    return state
                state = with_weights_of(self.cfg, state if form is None else form.unstored(state), self.layout)
                if alone and jax.process_index() == 0:
                    write_json(self.out / BASE_JSON, base_record(self.cfg.init_from, state[0]))
                return state if form is None else form.stored(state)
            abstract = abstract_like(program.checkpoint_abstract, program.checkpoint_shardings)
            state, position = self.checkpoints.restore(saved.step, _saved_part(self.config, abstract))
            if alone:  # the base again, under the adapters and the optimizer's state
                base = with_weights_of(self.cfg, program.create(), self.layout)
                check_base(self.out, base[0])
                state = nnx.merge_state(base, state)
            self.loader.set_state(position)
            self.start = saved.step
            return state if form is None else form.stored(state)

    def _batch(self, loader=None):
        return to_global(next(loader or self.loader), self.shardings)

    def _compile(self, batch):
        """Ahead-of-time compile of the train and eval steps (timed and reported separately)."""
        t0 = time.perf_counter()
        step = make_train_step(
            self.ts,
            self.layout,
            loss_fn=loss_of(self.cfg),
            grad_accum=self.cfg.grad_accum,
            grad_reduce=self.cfg.grad_reduce,
            z_loss=self.cfg.z_loss,
            skip_nonfinite=self.cfg.nonfinite == NonFinite.SKIP,
            pipeline=pipeline_table(self.cfg, self.layout),
            fsdp_gather=self.cfg.pipeline.fsdp_gather,
        )
        step = step.lower(self.ts.state, batch).compile()
        evaluate = (
            make_eval_step(self.ts, self.layout, loss_fn=loss_of(self.cfg)).lower(self.ts.state, batch).compile()
            if self.cfg.log.eval_every
            else None
        )
        self.metrics.message(f"compiled the train step in {time.perf_counter() - t0:.1f} s")
        all_processes_reach("compiled")
        return step, evaluate

    def _eval_batches(self):
        """The eval batches (the same ones at every eval), read once."""
        if self.eval_loader is None:
            return []
        return [self._batch(self.eval_loader) for _ in range(self.cfg.log.eval_batches)]

    def loop(self, *, stop_after: int | None, profile: tuple[int, int] | None) -> RunResult:
        cfg, last = self.cfg, min(self.cfg.steps, stop_after or self.cfg.steps)
        losses, evals = {}, {}
        if self.start >= last:
            return RunResult(self.out, self.start, self.start, losses, evals, self.loader.entropy_rate)
        batch = self._batch()
        step_fn, eval_fn = self._compile(batch)
        eval_batches = self._eval_batches()
        state, pending, clock, preempted = self.ts.state, None, time.perf_counter(), False
        for s in range(self.start + 1, last + 1):
            if profile and s == profile[0]:
                jax.profiler.start_trace(str(self.out / "profile"))
            state, metrics = step_fn(state, batch)
            if pending is not None:  # the previous step's metrics, while this one runs
                clock = self._report(pending, clock, losses)
            pending = [s, metrics]
            if profile and s == profile[1]:
                jax.block_until_ready(state)
                jax.profiler.stop_trace()
            preempted = self.preemption.requested(s)
            final = s == cfg.steps or preempted
            save = s % cfg.checkpoint.every == 0 or final
            position = self.loader.get_state() if save else None  # before the next batch is read
            if s < last and not preempted:
                batch = self._batch()
            do_eval = bool(eval_batches) and (s % cfg.log.eval_every == 0 or s == cfg.steps)
            if do_eval or save:  # the step's metrics now: never save a non-finite state
                clock = paused = self._report(
                    pending,
                    clock,
                    losses,
                    eval_fn=eval_fn if do_eval else None,
                    eval_batches=eval_batches,
                    evals=evals,
                    state=state,
                )
                pending = None  # eval and save time is kept out of the next step's time
                if save:
                    kept = state if self.saved_form is None else self.saved_form.unstored(state)
                    kept = _saved_part(self.config, kept)
                    self.checkpoints.save(s, state=kept, data=position, config=self.config, force=final)
                clock += time.perf_counter() - paused
            if preempted:
                self.checkpoints.wait()
                self.metrics.message(
                    f"preempted: stopped after step {s}; checkpoint {s} is saved in "
                    f"{self.out / 'checkpoints'} and the same command resumes from it"
                )
                last = s
                break
        if pending is not None:
            self._report(pending, clock, losses)
        return RunResult(self.out, self.start, last, losses, evals, self.loader.entropy_rate, preempted)

    def _report(
        self, pending: list, since: float, losses: dict, *, eval_fn=None, eval_batches=(), evals=None, state=None
    ) -> float:
        """Fetches the metrics of step ``pending = [step, metrics]`` (waiting for them), applies the
        non-finite guard, evaluates when ``eval_fn`` is given, logs; returns the time the metrics arrived."""
        step, metrics = pending
        loss, grad_norm = float(metrics.loss), float(metrics.grad_norm)
        now = time.perf_counter()
        record = self._record(step, metrics, loss, grad_norm, now - since)
        try:
            finite = self.guard.check(step, loss, grad_norm)
        except NonFiniteError:
            self.metrics.write(record)
            raise
        losses[step] = loss
        if not finite:
            record["skipped"] = True
        elif eval_fn is not None:
            evals[step] = record["eval_loss"] = float(np.mean([float(eval_fn(state, b)) for b in eval_batches]))
        self.metrics.write(record)
        return now

    def _record(self, step: int, metrics, loss: float, grad_norm: float, seconds: float) -> dict:
        cfg = self.cfg
        record = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            **({"data_skipped": self.loader.skipped} if step == self.start + 1 and self.loader.skipped else {}),
            "lr": float(self.schedule(step - 1)),
            "step_time_s": seconds,
        }
        record.update(
            throughput(
                tokens=cfg.batch * cfg.seq,
                seconds=seconds,
                flops_per_token=cfg.model.flops_per_token(cfg.seq),
                num_devices=self.layout.mesh.size,
                device_kind=jax.devices()[0].device_kind,
            )
        )
        if cfg.z_loss:
            record["z_loss"] = float(metrics.z_loss)
        if metrics.moe is not None:
            record.update(moe_record(metrics.moe, slices=batch_slices(cfg, self.layout)))
        record.update({name: float(value) for name, value in (metrics.extra or {}).items()})
        return record

    def close(self) -> None:
        self.preemption.close()
        self.checkpoints.close()
        self.metrics.close()
        self.loader.close()
        if self.eval_loader is not None:
            self.eval_loader.close()
