"""DPO's precomputed reference (``dpo.reference=precomputed``): the log-probability of every token of the
preference files under the run's initial weights, made in one pass before the first step.

A token's log-prob given its prefix depends only on its own document (pairs are whole documents with
their own positions and segments), not on the row a pair lands in, so the pass keeps one float32 per
token of the token stream (``DIR/reference/<stream>.p<process>.npy``; the first token of a document has
none, and stays 0). The loader then reads each row's values beside its tokens (``PackedRows``), whatever
order the rows are drawn in. Each process keeps its own copy, so nothing depends on a shared file
system; a resumed run reads the file its start wrote (the initial weights are gone by then).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar.data import PackedRows, TokenFiles, batch_of_rows, plan_pairs, resolve_files, to_global
from jaxpar.errors import DataError
from jaxpar.train.preference import natural_logps
from jaxpar.train.step import make_model_fn

STREAMS = ("data", "eval")  # data.path's files (its held-out tail included) and data.eval_path's


class FloatStream:
    """``reader(start, stop)``: float32 values of a stream's tokens, from a ``.npy`` opened on first use
    (the file is written after the loaders are made, before their first row is read)."""

    def __init__(self, path: Path):
        self.path, self.array = path, None

    def __call__(self, start: int, stop: int) -> np.ndarray:
        if self.array is None:
            self.array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        return self.array[start:stop]


def reference_path(out: Path, stream: str) -> Path:
    return out / "reference" / f"{stream}.p{jax.process_index()}.npy"


def readers(cfg, out: Path) -> dict:
    """{split: FloatStream} of a run whose reference is precomputed: the eval split reads data.eval_path's
    stream when it has one, else data.path's (it is that stream's held-out tail)."""
    data = FloatStream(reference_path(out, "data"))
    return {"train": data, "eval": FloatStream(reference_path(out, "eval")) if cfg.data.eval_path else data}


def ensure_reference(cfg, out: Path, ts, layout, *, resumed: bool, message) -> None:
    """Writes every stream's reference file from the state ``ts`` holds now (the initial weights), unless
    a resumed run finds them (refused if one is missing: the initial weights are gone)."""
    streams = {"data": cfg.data.path} | ({"eval": cfg.data.eval_path} if cfg.data.eval_path else {})
    if resumed:
        for stream in streams:
            if not reference_path(out, stream).exists():
                raise DataError(
                    f"{reference_path(out, stream)}: missing; a resumed DPO run reads the reference log-probs its "
                    "start computed from the initial weights (start the run again in a new directory)"
                )
        return
    logps = make_model_fn(ts, layout, natural_logps, layout.sharding(("batch", "length")))
    for stream, spec in streams.items():
        files = TokenFiles(resolve_files(spec, f"data.{'path' if stream == 'data' else 'eval_path'}"), cfg.data.dtype)
        values, rows = _one_pass(files, cfg, ts, layout, logps)
        _write(reference_path(out, stream), values)
        message(f"dpo.reference=precomputed: {stream} stream, {rows:,} rows of pairs, from the initial weights")


def _one_pass(files: TokenFiles, cfg, ts, layout, logps) -> tuple[np.ndarray, int]:
    """(reference per token of ``files``' stream, rows run): every pair that fits a row, in file order."""
    starts, lengths = files.documents()
    plan, _ = plan_pairs(starts, lengths, cfg.seq + 1)
    masks = files.masks()
    rows = PackedRows(files.read, lambda a, b: files.trained(masks, a, b), plan, cfg.seq + 1, 0, plan.rows, pairs=True)
    empty = {k: np.zeros_like(v) for k, v in rows[0].items()}  # padding rows of the last batch
    shardings = dict.fromkeys(
        ("inputs", "targets", "positions", "segments", "mask", "pairs"), layout.sharding(("batch", "length"))
    )
    per = cfg.batch // jax.process_count()
    mine = slice(jax.process_index() * per, (jax.process_index() + 1) * per)
    values = np.zeros(files.total, np.float32)
    for first in range(0, plan.rows, cfg.batch):
        ids = range(first, first + cfg.batch)
        local = [rows[i] if i < plan.rows else empty for i in ids][mine]
        stacked = {k: np.stack([row[k] for row in local]) for k in empty}
        lp = multihost_utils.process_allgather(
            logps(ts.state, to_global(batch_of_rows(stacked), shardings)), tiled=True
        )
        for r, i in enumerate(ids):
            if i < plan.rows:
                _scatter(values, plan, i, np.asarray(lp[r]))
    return values, plan.rows


def _scatter(values: np.ndarray, plan, row: int, lp: np.ndarray) -> None:
    """Row ``row``'s log-probs (of its targets) into ``values`` at the stream positions of its tokens."""
    at = 0
    for p in range(int(plan.row_ptr[row]), int(plan.row_ptr[row + 1])):
        start, length = int(plan.start[p]), int(plan.length[p])
        values[start + 1 : start + length] = lp[at : at + length - 1]
        at += length


def _write(path: Path, values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, values)
    os.replace(tmp, path)
