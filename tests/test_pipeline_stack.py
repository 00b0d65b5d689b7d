"""The pipelined stack in the executor's storage order (``jaxpar.pipeline.stack``): interleaved chunks
side by side on their stage, and Megatron's uneven split (``pipeline.first_stage_layers`` /
``last_stage_layers``) with every chunk padded to the same rows. Checked: the split's arithmetic and
its refusals; padding rows pass x through (skipped or computed and dropped); the one-device losses and
per-parameter gradients for uneven splits on both executors, with interleaving and with a MoE stack
behind a dense prefix (``pipeline_cases``, bounds from the reference's own noise); a mutation (two
chunks' layers swapped in storage) is caught; no weight moves between stages in an interleaved step;
a run checkpoints in layer order and resumes bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from noise import check_mutation_caught
from pipeline_cases import check_case, reference, run_case

from jaxpar.analysis.hlo import analyze_compiled
from jaxpar.errors import ConfigError
from jaxpar.execution import Remat
from jaxpar.layout import make_layout
from jaxpar.meshes import resolve_mesh_arg
from jaxpar.models import build_model, get_model_preset
from jaxpar.models.stacks import scan_blocks
from jaxpar.pipeline import build
from jaxpar.pipeline.stack import StackSplit
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import batch_sharding, init_train_state, make_train_step


# ------------------------------------------------------------------------------------------- the split
def test_megatron_split_of_deepseek_v3_moe_layers():
    """58 MoE layers over 8 stages, first 4 and last 6: 8 on each stage between; chunks padded to 8 rows."""
    split = StackSplit(58, 8, 1, first=4, last=6)
    assert split.stage_layers == (4, 8, 8, 8, 8, 8, 8, 6)
    assert split.rows == 8 and split.order.size == 64 and split.active.sum() == 58
    assert sorted(split.order[split.active]) == list(range(58))  # every layer once, in chunk order
    assert list(split.order[:8]) == [0, 1, 2, 3, -1, -1, -1, -1]


def test_interleaved_storage_puts_each_stage_chunks_side_by_side():
    split = StackSplit(8, 2, 2)  # chunks of 2: stage 0 holds model chunks 0 and 2, stage 1 chunks 1 and 3
    assert list(split.order) == [0, 1, 4, 5, 2, 3, 6, 7] and not split.identity
    a = jnp.arange(8.0)
    np.testing.assert_array_equal(split.to_model(split.to_storage(a)), a)
    assert StackSplit(8, 4).identity


@pytest.mark.parametrize(
    "args,match",
    [
        (dict(layers=7, stages=4, first=2), r"num_layers=7 .* - 2 = 5 layers do not split evenly over the other 3"),
        (dict(layers=8, stages=2, first=2, last=2), r"need mesh stage ≥ 3"),
        (dict(layers=8, stages=4, first=0), r"first_stage_layers=0: a stage holds at least one layer"),
        (dict(layers=9, stages=4, virtual=2, first=3, last=2), r"stage 0 holds 3 layers, not divisible by pipeline"),
    ],
)
def test_splits_that_do_not_exist_are_refused(args, match):
    with pytest.raises(ConfigError, match=match):
        StackSplit(**args)


@pytest.mark.parametrize("skip", [True, False])
def test_padding_rows_pass_x_through(skip):
    """A 3-layer stack with row 1 off computes layers 0 and 2 only, skipped as a branch or computed and
    dropped; its outputs (MoE statistics) are zero there."""
    cfg = dataclasses.replace(get_model_preset("tiny-moe"), num_layers=3)
    model = build_model(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.embed_dim))
    pos = jnp.broadcast_to(jnp.arange(8), (2, 8))
    run = lambda blocks, active=None: scan_blocks(
        blocks, x, pos, pos, Remat.NONE, per_layer_outputs=True, active=active
    )
    got, stats = run(model.moe_blocks, (jnp.array([True, False, True]), skip))
    kept = nnx.merge(*nnx.split(model.moe_blocks))
    state = nnx.state(kept)
    nnx.update(kept, jax.tree.map(lambda a: a[np.array([0, 2])], state))
    want, want_stats = run(kept)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(stats.expert_load[1]).max()) == 0.0
    np.testing.assert_allclose(stats.expert_load[np.array([0, 2])], want_stats.expert_load, atol=1e-6)


# ----------------------------------------------------------------------------------------- exactness
CASES = [  # (model, schedule, p, m, v, mesh, grad_reduce, (first, last))
    ("tiny-6", "1f1b", 4, 8, 1, "stage=4,data=2", "step", (1, 1)),  # own actions: padding skipped
    ("tiny-6", "zero_bubble", 4, 4, 1, "stage=4,fsdp=2", "slice", (1, 1)),  # one section a tick: dropped
    ("tiny-6", "zero_bubble", 2, 4, 1, "stage=2,data=2", "step", (1, None)),  # W cut in each branch
    ("tiny-6", "interleaved", 2, 4, 2, "stage=2,data=2", "step", (2, None)),  # interleaved and uneven
    ("tiny-deepseek-uneven", "1f1b", 2, 4, 1, "stage=2,data=2,expert=2", "slice", (2, None)),  # prefix + MoE
]


@pytest.mark.parametrize("name,schedule,p,m,v,mesh,reduce,ends", CASES, ids=lambda x: str(x))
def test_uneven_splits_give_the_one_device_run(name, schedule, p, m, v, mesh, reduce, ends):
    check_case(name, schedule, p, m, v, mesh, grad_reduce=reduce, ends=ends)


def test_two_chunks_swapped_in_storage_are_caught(monkeypatch):
    """Mutation: the storage order with model chunks 0 and 1 swapped (stage 0 runs layers 2-3 first)
    misses the bound."""
    real = StackSplit.order.func

    def swapped(self):
        order = real(self).copy()
        k = self.rows
        order[:k], order[k : 2 * k] = order[k : 2 * k].copy(), order[:k].copy()
        return order

    monkeypatch.setattr(StackSplit, "order", property(swapped))
    got = run_case("tiny-6", "1f1b", 4, 8, 1, "stage=4,data=2", grad_reduce="step", ends=(1, 1))
    want, bound = reference("tiny-6", 8)
    check_mutation_caught(got, want, bound, "tiny-6 1f1b: chunks 0 and 1 swapped in storage")


# ----------------------------------------------------------------------------------- the program
def test_an_interleaved_step_moves_no_weight_between_stages():
    """Interleaved (v = 2) on stage=4,data=2, grad_reduce=step: the collectives over ``stage`` are the
    schedule's sends inside its loop (one activation each) and one all-reduce of the replicated
    parameters' gradients, as at v = 1: no gather or permutation of the stack's weights or gradients."""
    cfg = dataclasses.replace(get_model_preset("tiny"), num_layers=8)
    layout = make_layout(cfg, resolve_mesh_arg("stage=4,data=2"), batch=16, seq=16)
    tx = functools.partial(make_optimizer, OptimizerConfig())
    ts = init_train_state(lambda r: build_model(cfg, rngs=r), tx, layout, stack=StackSplit(8, 4, 2))
    batch = {k: jax.ShapeDtypeStruct((16, 16), np.int32, sharding=s) for k, s in batch_sharding(layout).items()}
    step = make_train_step(ts, layout, pipeline=build("interleaved", 4, 8, 2), grad_reduce="step")
    ops = analyze_compiled(step.lower(ts.state, batch).compile(), mesh=layout.mesh).ops
    ops = [o for o in ops if "stage" in o.axes]
    activation = 1 * 16 * cfg.embed_dim * 4  # a microbatch of 16 / 8 rows over data=2, T = 16, float32
    sends = [o for o in ops if o.kind == "collective-permute"]
    assert sends and all(o.executions > 1 and o.bytes == activation for o in sends), sends
    rest = [o for o in ops if o.kind != "collective-permute"]
    assert [(o.kind, o.executions) for o in rest] == [("all-reduce", 1)], rest


def test_a_run_checkpoints_in_layer_order_and_resumes_bit_for_bit(tmp_path):
    """``jaxpar train`` with an uneven interleaved split (``--set pipeline.first_stage_layers=2``): a run
    stopped after step 2 and resumed gives the uninterrupted run's losses bit for bit (the same program
    on the same mesh); its checkpoint holds the stack in layer order, so it restores under fsdp=8
    (no pipeline) to the same parameters; its evaluation reads the layers in order."""
    from jaxpar.checkpoint import Checkpointer, abstract_like
    from jaxpar.train.config import apply_overrides, default_config
    from jaxpar.train.loop import train
    from jaxpar.train.step import init_program

    sets = ["model.num_layers=6", "pipeline.schedule=interleaved", "pipeline.microbatches=2"]
    sets += ["pipeline.virtual_stages=2", "pipeline.first_stage_layers=2", "checkpoint.every=1"]
    sets += ["log.progress=false", "log.tensorboard=false", "log.eval_every=3", "optimizer.learning_rate=1e-2"]
    cfg = apply_overrides(default_config("tiny", mesh="stage=2,data=4", steps=3, batch=8, seq=16), sets)
    whole = train(cfg, tmp_path / "whole")
    train(cfg, tmp_path / "resumed", stop_after=2)
    resumed = train(cfg, tmp_path / "resumed")
    assert resumed.start_step == 2 and resumed.losses[3] == whole.losses[3], (resumed.losses, whole.losses)
    assert whole.eval_losses[3] < whole.losses[1]  # the eval ran the trained layers, in order
    flat_ = make_layout(cfg.model, resolve_mesh_arg("fsdp=8"), batch=8, seq=16)
    tx = lambda m: make_optimizer(cfg.optimizer, m, total_steps=cfg.steps)
    program = init_program(lambda r: build_model(cfg.model, rngs=r), tx, flat_)
    reader = Checkpointer(tmp_path / "whole" / "checkpoints", every=1, keep=1)
    state, _ = reader.restore(3, abstract_like(program.abstract, program.shardings))
    reader.close()
    assert state[0]["blocks"]["attn"]["q"][...].shape[0] == 6
