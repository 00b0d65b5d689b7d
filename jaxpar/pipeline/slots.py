"""Buffer slots of a schedule table: which slot of a stage's activation and cotangent buffers each
(microbatch, chunk) uses, so the executor holds only as many stage inputs as the schedule keeps alive.
Interval colouring per stage: an entry lives from the tick it is written (its message arrives) to the
tick of its last reader; slots are reused as soon as their last reader has run.
"""

from __future__ import annotations

import numpy as np

from jaxpar.pipeline.ops import Op, op_ticks


def _buffer_entries(op, mb, chunk, p: int, v: int, split: bool) -> tuple[list[list], list[list]]:
    """Per stage, the entries of the act and grad buffers as (w, u, microbatch, local chunk): written at
    the end of tick w, last read in tick u. act: the input of chunk g arrives with the F of chunk g-1
    (chunk 0's is written by the executor, counted as the end of the tick before its F); grad: the
    cotangent arrives with the B of chunk g+1 (none for the last chunk). Both live until the last
    backward op of (microbatch, chunk): W when the backward is split (it reads both again), else B."""
    ticks, last, chunks = op_ticks(op, mb, chunk), (Op.W if split else Op.B), p * v
    act: list[list] = [[] for _ in range(p)]
    grad: list[list] = [[] for _ in range(p)]
    for (o, i, g), t in ticks.items():
        if o != Op.F:
            continue
        s, j, u = g % p, g // p, ticks[(last, i, g)]
        act[s].append((t - 1 if g == 0 else ticks[(Op.F, i, g - 1)], u, i, j))
        if g < chunks - 1:
            grad[s].append((ticks[(Op.B, i, g + 1)], u, i, j))
    return act, grad


def _colour(entries: list) -> tuple[dict[tuple[int, int], int], int]:
    """Interval colouring: each entry, by write tick, takes the first slot whose last reader has run
    (a slot read for the last time in tick u may be written at the end of tick u). Uses as many slots as
    the most entries live at once. Returns {(microbatch, chunk): slot} and the number of slots."""
    busy_until: list[int] = []
    slot = {}
    for w, u, i, j in sorted(entries):
        k = next((k for k, until in enumerate(busy_until) if until <= w), len(busy_until))
        busy_until[k : k + 1] = [u]
        slot[(i, j)] = k
    return slot, len(busy_until)


def assign_slots(op, mb, chunk, p: int, v: int, split: bool) -> dict:
    """The four slot arrays of a table and the two buffer sizes (``Table`` fields)."""
    ticks = op_ticks(op, mb, chunk)
    arrays = {
        name: np.full(op.shape, -1, np.int32) for name in ("act_slot", "grad_slot", "fwd_recv_slot", "bwd_recv_slot")
    }
    readers = (Op.F, Op.B, Op.W) if split else (Op.F, Op.B)
    sizes = {"act_slots": 1, "grad_slots": 1}
    act, grad = _buffer_entries(op, mb, chunk, p, v, split)
    for s in range(p):
        for entries, slot_name, recv_name, size_name, ops in (
            (act[s], "act_slot", "fwd_recv_slot", "act_slots", readers),
            (grad[s], "grad_slot", "bwd_recv_slot", "grad_slots", readers[1:]),
        ):
            slot_of, used = _colour(entries)
            sizes[size_name] = max(sizes[size_name], used)
            for w, _, i, j in entries:
                for o in ops:
                    arrays[slot_name][ticks[(o, i, j * p + s)], s] = slot_of[(i, j)]
                if slot_name == "grad_slot" or j * p + s > 0:  # chunk 0's input: the executor's
                    arrays[recv_name][w, s] = slot_of[(i, j)]
    return {**arrays, **sizes}
