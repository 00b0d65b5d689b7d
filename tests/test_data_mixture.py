"""Weighted mixtures of token-file sources (``data.path=A,B`` with ``data.weights`` or ``data.epochs``):
the rows come from each source in its share (within binomial bounds over many draws), ``epochs`` makes
each source's records recur that many times per pass over the mixture, every source holds out its own
documents, the mixture resumes bit for bit and splits over processes as one stream does, and settings
that cannot describe a mixture are refused by name."""

import dataclasses

import numpy as np
import pytest
from test_data_packing import _prepared, resumes_and_splits_as_one_process

from jaxpar.data import DataConfig, DataError, make_loader

SEQ = 16
Z = 4.5  # binomial bound: |count - n·p| ≤ Z·sqrt(n·p·(1-p)) (false alarm below 1e-5 for a random mix)


def _two_sources(tmp_path, pack: str):
    """Sources A (ids below 1,000,000) and B (ids from 1,000,000): a row tells its source by its tokens."""
    a, _, _ = _prepared(tmp_path / "a", [7, 12, 30, 9, 15, 21] * 20, masks=False)
    b, _, _ = _prepared(tmp_path / "b", [11, 18, 5, 25] * 10, masks=False)
    np.save(tmp_path / "b" / "t.npy", np.load(tmp_path / "b" / "t.npy") + 1_000_000)
    return DataConfig(source="files", path=f"{a.path},{b.path}", pack=pack)


def _from_b(batch) -> np.ndarray:
    return (batch["inputs"] >= 1_000_000).any(axis=1)


@pytest.mark.parametrize("pack", ["stream", "documents"])
def test_rows_come_from_each_source_in_its_share(tmp_path, pack):
    cfg = dataclasses.replace(_two_sources(tmp_path, pack), weights="3,1")
    loader = make_loader(cfg, vocab_size=3_000_000, seq=SEQ, global_batch=16, seed=0)
    assert loader.describe().startswith("mixture: 75.0% files") and "25.0% files" in loader.describe()
    rows = np.concatenate([_from_b(next(loader)) for _ in range(250)])
    assert (_from_b(next(loader)) | ~_from_b(next(loader))).all()  # every row is wholly one source's
    n, p = len(rows), 0.25
    assert abs(rows.sum() - n * p) <= Z * np.sqrt(n * p * (1 - p)), (rows.sum(), n * p)


def test_epochs_repeat_each_source_that_many_times_per_pass(tmp_path):
    cfg = dataclasses.replace(_two_sources(tmp_path, "documents"), epochs="1,3", shuffle=False)
    parts = [
        make_loader(dataclasses.replace(cfg, path=p, epochs=""), vocab_size=3_000_000, seq=SEQ, global_batch=1, seed=0)
        for p in cfg.path.split(",")
    ]
    sizes = [int(d.describe().split(" in ")[1].split(" rows")[0]) for d in parts]  # rows of each source
    loader = make_loader(cfg, vocab_size=3_000_000, seq=SEQ, global_batch=1, seed=0)
    seen = {}
    for _ in range(sizes[0] + 3 * sizes[1]):  # one pass over the mixture
        row = next(loader)["inputs"][0]
        seen[row.tobytes()] = seen.get(row.tobytes(), 0) + 1
    counts = {
        src: sorted(c for k, c in seen.items() if (np.frombuffer(k, np.int32)[0] >= 1_000_000) == src)
        for src in (False, True)
    }
    assert len(counts[False]) == sizes[0] and len(counts[True]) == sizes[1]  # every row of both sources
    assert max(counts[False]) - min(counts[False]) <= 1 and abs(np.mean(counts[False]) - 1) < 0.1
    assert max(counts[True]) - min(counts[True]) <= 1 and abs(np.mean(counts[True]) - 3) < 0.1


@pytest.mark.parametrize("processes", [1, 2])
def test_a_mixture_resumes_and_splits_as_one_process(tmp_path, processes):
    cfg = dataclasses.replace(_two_sources(tmp_path, "documents"), weights="2,1")
    kw = dict(vocab_size=3_000_000, seq=SEQ, global_batch=4, seed=7)
    state = resumes_and_splits_as_one_process(cfg, processes, **kw)
    with pytest.raises(DataError, match="saved with source="):  # other shares: another stream
        make_loader(dataclasses.replace(cfg, weights="1,1"), **kw).set_state(state)


@pytest.mark.parametrize(
    "fields, words",
    [
        (dict(weights="3"), "data.weights has 1 entries, data.path names 2 source(s)"),
        (dict(weights="3,1", epochs="1,2"), "data.weights and data.epochs both given"),
        (dict(epochs="1,-2"), "data.epochs='1,-2': every entry must be a positive number"),
        (dict(weights="a,b"), "data.weights='a,b': expected numbers separated by commas"),
        (dict(eval_path="x.bin"), "data.eval_path names 1 source(s), data.path 2"),
    ],
)
def test_a_mixture_that_cannot_be_is_refused(fields, words):
    with pytest.raises(DataError, match=words.replace("(", r"\(").replace(")", r"\)")):
        DataConfig(source="files", path="a.bin,b.bin", **fields)


def test_a_run_on_a_packed_masked_mixture_resumes_bit_for_bit(tmp_path):
    """``jaxpar train``'s loop on two chat-like sources (packed rows, loss masks, weights 2:1): stopped
    after step 4 and run again, it resumes from the step-3 checkpoint with the losses of a run never
    stopped, bit for bit (the loader's position is saved with every checkpoint)."""
    from test_train import _cfg

    from jaxpar.train.loop import train

    rng = np.random.default_rng(0)
    paths = []
    for name, n_docs in (("a", 150), ("b", 60)):
        folder = tmp_path / name
        folder.mkdir()
        lengths = rng.integers(3, 30, n_docs)
        np.save(folder / "t.npy", rng.integers(1, 256, lengths.sum()).astype(np.uint16))
        np.save(folder / "t.docs.npy", np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        np.save(folder / "t.mask.npy", (rng.random(lengths.sum()) < 0.5).astype(np.uint8))
        paths.append(str(folder / "t.npy"))
    data = ["data.source=files", f"data.path={','.join(paths)}", "data.pack=documents", "data.weights=2,1"]
    whole = train(_cfg(*data), tmp_path / "whole")
    first = train(_cfg(*data), tmp_path / "run", stop_after=4)
    second = train(_cfg(*data), tmp_path / "run")
    assert first.last_step == 4 and second.start_step == 3
    assert [second.losses[s] for s in (4, 5, 6)] == [whole.losses[s] for s in (4, 5, 6)]
