"""The bubble of the executor where each stage runs its own action (``jaxpar.pipeline.timing``): each stage
runs its ticks at its own pace and a send waits for its sender and receiver only. Numpy only."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpar.pipeline import build
from jaxpar.pipeline.ops import Op
from jaxpar.pipeline.timing import own_action_bubble_fraction, own_action_times, paired_makespan

GRID = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 8 * p)]
TIMES = [(1.0, 2.0, None), (1.0, 3.0, None), (1.0, 1.0, 1.0)]  # (F, B, W): W only where the backward splits


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero_bubble"])
@pytest.mark.parametrize("p,m", GRID)
def test_the_ideal_bubble_for_gpipe_1f1b_and_zero_bubble(schedule, p, m):
    """Run this way the line of stages reaches the table's ideal bubble (every op as soon as its inputs
    are there), for every time of F and B; the one-section executor does not (``lockstep``)."""
    table = build(schedule, p, m)
    for t_f, t_b, t_w in TIMES:
        if (t_w is None) == table.split_backward:
            continue
        ideal = table.bubble_fraction(t_f, t_b, t_w)
        assert own_action_bubble_fraction(table, t_f, t_b, t_w) == pytest.approx(ideal, abs=1e-12)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 64), (8, 64)])
def test_interleaved_sends_close_a_ring_and_stay_above_the_ideal(p, m):
    """Interleaved chunks pass from stage p-1 back to stage 0: the rendezvous pace the ring as one, so
    the bubble lies between the ideal and the lockstep one (at B = 2F)."""
    table = build("interleaved", p, m, 2)
    own = own_action_bubble_fraction(table, 1.0, 2.0)
    assert table.bubble_fraction(1.0, 2.0) < own <= table.lockstep_bubble_fraction(1.0, 2.0) + 1e-12


def test_the_head_runs_with_the_last_chunk_forward_only():
    table = build("interleaved", 2, 4, 2)
    cell = own_action_times(table, 1.0, 2.0, head=0.5)
    last = (table.op == Op.F) & (table.chunk * 2 + np.arange(2) == 3)
    assert last.sum() == 4 and np.all(cell[last] == 1.5)
    assert np.all(cell[~last] == np.array([0.0, 1.0, 2.0])[table.op[~last]])
    assert paired_makespan(table, cell) >= cell.sum(axis=0).max()


def test_uneven_stages_last_their_share():
    """Megatron's split (1, 2, 2, 1 layers on 4 stages, chunks of the largest padded and skipped): each
    stage's ops last its share of the largest chunk, so the lighter end stages idle more."""
    table, scale = build("1f1b", 4, 8), [0.5, 1.0, 1.0, 0.5]
    np.testing.assert_allclose(
        own_action_times(table, 1.0, 2.0, scale=scale), own_action_times(table, 1.0, 2.0) * scale
    )
    even = own_action_bubble_fraction(table, 1.0, 2.0)
    assert own_action_bubble_fraction(table, 1.0, 2.0, scale=scale) > even
    assert own_action_bubble_fraction(table, 1.0, 2.0, scale=[1.0] * 4) == pytest.approx(even)
