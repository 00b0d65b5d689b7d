"""Rows of whole documents (``data.pack=documents``, jaxpar.data.packing): every token of every document
lands in exactly one row, once, with positions restarting and a segment per document; the loss mask is
the prepared one, cut at document boundaries; the loader resumes bit for bit and splits over processes
as the stream does; data it cannot pack is refused by name."""

import dataclasses
import json

import numpy as np
import pytest

from jaxpar.data import DataConfig, DataError, make_loader, plan_rows

SEQ = 16


def _prepared(folder, lengths, *, masks: bool = True, seed: int = 0):
    """A token file as `jaxpar prepare` writes it: ids, document offsets, and a loss mask (or none);
    document d's tokens are d·1000 + their place + 1, so rows can be traced back (0 is only padding)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(exist_ok=True)
    ids = np.concatenate([d * 1000 + np.arange(n) + 1 for d, n in enumerate(lengths)]).astype(np.uint32)
    np.save(folder / "t.npy", ids)
    np.save(folder / "t.docs.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    mask = (rng.random(len(ids)) < 0.6).astype(np.uint8)
    if masks:
        np.save(folder / "t.mask.npy", mask)
    return DataConfig(source="files", path=str(folder / "t.npy"), pack="documents", shuffle=False), ids, mask


LENGTHS = [5, 17, 3, 40, 9, 9, 1, 12, 30, 2, 16, 8, 20, 6, 11, 4] * 3  # some longer than a row (17 tokens)


def test_plan_places_every_token_once_in_rows_that_fit():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 60, 400)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    plan = plan_rows(starts, lengths, SEQ + 1)
    covered = np.concatenate([np.arange(s, s + n) for s, n in zip(plan.start, plan.length)])
    np.testing.assert_array_equal(np.sort(covered), np.arange(lengths.sum()))  # each token once
    per_row = np.add.reduceat(plan.length, plan.row_ptr[:-1])
    assert per_row.max() <= SEQ + 1 and (plan.length <= SEQ + 1).all()
    # a document's pieces keep their order: within a document, piece k starts k rows' worth in
    by_doc = np.searchsorted(starts, plan.start, side="right") - 1
    for d in np.unique(by_doc)[:50]:
        np.testing.assert_array_equal(
            np.sort(plan.start[by_doc == d]), starts[d] + (SEQ + 1) * np.arange((by_doc == d).sum())
        )
    assert plan.filled(SEQ + 1) > 0.95  # best fit among open rows leaves little padding
    one_open = plan_rows(starts, lengths, SEQ + 1, window=1)  # a single open row: greedy in order
    assert one_open.filled(SEQ + 1) < plan.filled(SEQ + 1)


def test_rows_hold_whole_documents_with_their_mask(tmp_path):
    cfg, ids, mask = _prepared(tmp_path / "d", LENGTHS)
    offsets = np.concatenate([[0], np.cumsum(LENGTHS)])
    loader = make_loader(
        dataclasses.replace(cfg, eval_fraction=0.02), vocab_size=1_000_000, seq=SEQ, global_batch=4, seed=0
    )
    assert "rows of 17 tokens" in loader.describe() and "with loss masks" in loader.describe()
    placed = []
    for _ in range(6):
        b = next(loader)
        assert set(b) == {"inputs", "targets", "positions", "segments", "mask"}
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        for r in range(4):
            row, seg, pos = np.append(b["inputs"][r], b["targets"][r, -1]), b["segments"][r], b["positions"][r]
            pad = row == 0
            same = (row[1:] == row[:-1] + 1) | (pad[1:] & pad[:-1])  # the next token of the same document
            assert ((seg[1:] == seg[:-1]) == same[:-1]).all()  # a segment is exactly one document's run
            assert (pos[1:][same[:-1]] == pos[:-1][same[:-1]] + 1).all() and (pos[1:][~same[:-1]] == 0).all()
            where = offsets[(row[1:] - 1) // 1000] + (row[1:] - 1) % 1000  # each target's place in the stream
            want = same & ~pad[1:] & (mask[np.clip(where, 0, len(mask) - 1)] > 0)
            np.testing.assert_array_equal(b["mask"][r], want)
            placed += [int(t) for t, p in zip(row[:-1], pos) if p == 0 and t % 1000 == 1]
    assert len(set(placed)) > 10  # many documents' first tokens, each from the start


def resumes_and_splits_as_one_process(cfg: DataConfig, processes: int, **kw) -> dict:
    """Asserts ``processes`` loaders of ``cfg`` give, together, the batches of one, and that a loader
    resumed from process 0's state goes on where it stopped; returns that state."""
    kw = dict(seq=SEQ, global_batch=4) | kw
    single = [next(it) for it in [make_loader(cfg, **kw)] for _ in range(6)]
    parts = [make_loader(cfg, **kw, process_index=p, process_count=processes) for p in range(processes)]
    for k in range(3):
        got = [next(p) for p in parts]
        for key in single[k]:
            np.testing.assert_array_equal(np.concatenate([g[key] for g in got]), single[k][key])
    state = json.loads(json.dumps(parts[0].get_state()))
    resumed = make_loader(cfg, **kw, process_index=0, process_count=processes)
    resumed.set_state(state)
    nxt = next(resumed)
    for key in nxt:
        np.testing.assert_array_equal(nxt[key], single[3][key][: 4 // processes])
    return state


@pytest.mark.parametrize("processes", [1, 2])
def test_packed_loader_resumes_and_splits_as_one_process(tmp_path, processes):
    cfg, _, _ = _prepared(tmp_path / "d", LENGTHS * 4)
    resumes_and_splits_as_one_process(dataclasses.replace(cfg, shuffle=True), processes, vocab_size=10**6, seed=5)


def test_what_cannot_be_packed_is_refused(tmp_path):
    cfg, _, _ = _prepared(tmp_path / "d", LENGTHS)
    with pytest.raises(DataError, match="carry loss masks .* set data.pack=documents"):
        make_loader(dataclasses.replace(cfg, pack="stream"), vocab_size=1_000_000, seq=SEQ, global_batch=2, seed=0)
    (tmp_path / "d" / "t.docs.npy").unlink()
    with pytest.raises(DataError, match=r"t\.npy has no t\.docs\.npy"):
        make_loader(cfg, vocab_size=1_000_000, seq=SEQ, global_batch=2, seed=0)
    np.save(tmp_path / "d" / "t.docs.npy", np.array([0, 5, 3], np.int64))
    with pytest.raises(DataError, match="not the offsets"):
        make_loader(cfg, vocab_size=1_000_000, seq=SEQ, global_batch=2, seed=0)
    np.save(tmp_path / "d" / "t.mask.npy", np.ones(3, np.uint8))
    np.save(tmp_path / "d" / "t.docs.npy", np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int64))
    with pytest.raises(DataError, match="one mask entry each"):
        make_loader(cfg, vocab_size=1_000_000, seq=SEQ, global_batch=2, seed=0)
