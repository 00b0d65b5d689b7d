"""Rows of whole documents (``data.pack=documents``): each row holds ``seq + 1`` tokens of documents laid
back to back, with per-document positions, segment ids and the loss mask, so that no token attends to
or is trained on another document (the model honours ``segments`` on every attention path).

The plan (``plan_rows``), made once from the documents' lengths:

* documents are taken in the given order (a seeded shuffle, or the files' order); a document longer than
  a row is cut into pieces of ``seq + 1`` tokens, each piece a document of its own (its positions restart:
  the model never sees across the cut);
* each piece goes to the open row with the least room that still fits it (best fit), or opens a new
  row; at most ``OPEN_ROWS`` rows are open, and beyond that the fullest is closed;
* the room a row has left is padding: token 0, a segment of its own, nothing trained.

A row (``PackedRows[i]``) is read from the token files by the plan alone, so rows are random access (grain
shuffles and checkpoints them by index). The batch a row gives (``batch_of_rows``): ``inputs``/``targets``
(the row shifted by one), ``positions`` and ``segments`` of the inputs, and ``mask``: 1 where the target
is the next token of the same document and that token trains (the chat mask of ``jaxpar prepare``, or
every token of a text document).
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

OPEN_ROWS = 64  # rows the plan keeps open for documents to fill (best fit among them)


@dataclasses.dataclass(frozen=True)
class RowPlan:
    """Pieces of documents, row by row: row r holds pieces ``row_ptr[r]`` to ``row_ptr[r + 1]``, piece p
    the ``length[p]`` tokens from ``start[p]`` of the token stream."""

    start: np.ndarray  # int64 [P]
    length: np.ndarray  # int64 [P]
    row_ptr: np.ndarray  # int64 [R + 1]

    @property
    def rows(self) -> int:
        return len(self.row_ptr) - 1

    def filled(self, row_tokens: int) -> float:
        """The share of the rows' tokens that are documents (1 - the share of padding)."""
        return float(self.length.sum()) / max(1, self.rows * row_tokens)


def plan_rows(starts: np.ndarray, lengths: np.ndarray, row_tokens: int, window: int = OPEN_ROWS) -> RowPlan:
    """The plan (module docstring) of documents ``starts``/``lengths``, taken in that order, into rows of
    ``row_tokens`` tokens, with at most ``window`` rows open at a time."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    starts, lengths = starts[lengths > 0], lengths[lengths > 0]
    cuts = -(-lengths // row_tokens)  # pieces per document
    piece_doc = np.repeat(np.arange(len(lengths)), cuts)
    within = np.arange(len(piece_doc)) - np.repeat(np.cumsum(cuts) - cuts, cuts)  # piece index in its document
    start = starts[piece_doc] + within * row_tokens
    length = np.minimum(lengths[piece_doc] - within * row_tokens, row_tokens)
    rows: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # the open rows as (room, row), sorted
    for p, n in enumerate(length.tolist()):
        at = bisect.bisect_left(rooms, (n, -1))  # the open row with the least room that fits (best fit)
        if at < len(rooms):
            room, r = rooms.pop(at)
        else:
            room, r = row_tokens, len(rows)
            rows.append([])
        rows[r].append(p)
        if room > n:
            bisect.insort(rooms, (room - n, r))
        if len(rooms) > window:  # close the fullest
            rooms.pop(0)
    order = np.asarray([p for row in rows for p in row], np.int64)
    row_ptr = np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(np.int64)
    return RowPlan(start[order], length[order], row_ptr)


def plan_pairs(starts: np.ndarray, lengths: np.ndarray, row_tokens: int) -> tuple[RowPlan, int]:
    """(the plan, pairs dropped) of preference pairs: documents 2i (prompt + chosen) and 2i + 1 (prompt +
    rejected) of ``starts``/``lengths``, placed as ``plan_rows`` places documents but as one unit, chosen
    then rejected, never cut: a pair longer than a row is dropped. A row's pair k is then its pieces 2k
    (chosen) and 2k + 1 (rejected)."""
    starts, lengths = np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
    both = lengths[0::2] + lengths[1::2]
    fits = np.flatnonzero(both <= row_tokens)
    units = plan_rows(fits, both[fits], row_tokens)  # a unit's "start" is its pair's index
    docs = np.stack([2 * units.start, 2 * units.start + 1], axis=1).reshape(-1)
    return RowPlan(starts[docs], lengths[docs], 2 * units.row_ptr), len(both) - len(fits)


class PackedRows:
    """grain random-access source: row ``first + i`` of ``plan`` as ``tokens``, ``positions``, ``segments``
    and ``trained`` (int32 [seq + 1] each); ``read(start, stop)`` gives ids, ``trained(start, stop)`` the
    loss mask of the token stream (None: every token trains). With ``pairs`` (``plan_pairs``' plan),
    ``pairs`` is 1 at the first token of each chosen document; with ``reference(start, stop)`` (float32
    per token of the stream), the row's ``reference``."""

    def __init__(
        self, read, trained, plan: RowPlan, row_tokens: int, first: int, count: int, *, pairs=False, reference=None
    ):
        self.read, self.trained, self.plan = read, trained, plan
        self.row_tokens, self.first, self.count = row_tokens, first, count
        self.pairs, self.reference = pairs, reference

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        r = self.first + int(index)
        n = self.row_tokens
        out = {k: np.zeros(n, np.int32) for k in ("tokens", "positions", "segments", "trained")}
        out |= {"pairs": np.zeros(n, np.int32)} if self.pairs else {}
        out |= {"reference": np.zeros(n, np.float32)} if self.reference is not None else {}
        at = 0
        lo, hi = int(self.plan.row_ptr[r]), int(self.plan.row_ptr[r + 1])
        for s, p in enumerate(range(lo, hi)):
            start, length = int(self.plan.start[p]), int(self.plan.length[p])
            out["tokens"][at : at + length] = self.read(start, start + length)
            out["positions"][at : at + length] = np.arange(length)
            out["segments"][at : at + length] = s
            out["trained"][at : at + length] = 1 if self.trained is None else self.trained(start, start + length)
            if self.pairs and s % 2 == 0:
                out["pairs"][at] = 1
            if self.reference is not None:
                out["reference"][at : at + length] = self.reference(start, start + length)
            at += length
        out["positions"][at:] = np.arange(n - at)
        out["segments"][at:] = hi - lo
        return out


def batch_of_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stacked rows [b, seq + 1] -> the train step's batch [b, seq] (module docstring); a pair row's
    ``pairs`` marks inputs, its ``reference`` (a log-prob per token) the targets."""
    tokens, segments = rows["tokens"], rows["segments"]
    same = segments[:, 1:] == segments[:, :-1]
    return (
        {
            "inputs": np.ascontiguousarray(tokens[:, :-1]),
            "targets": np.ascontiguousarray(tokens[:, 1:]),
            "positions": np.ascontiguousarray(rows["positions"][:, :-1]),
            "segments": np.ascontiguousarray(segments[:, :-1]),
            "mask": (same & (rows["trained"][:, 1:] > 0)).astype(np.int32),
        }
        | {k: np.ascontiguousarray(rows[k][:, :-1]) for k in ("pairs",) if k in rows}
        | ({"reference": np.ascontiguousarray(rows["reference"][:, 1:])} if "reference" in rows else {})
    )
