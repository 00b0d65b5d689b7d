"""jaxpar.data (markov chain, token files, grain loader) and ``jaxpar prepare``."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import encoder
from jaxpar.cli import main
from jaxpar.data import (
    DataConfig,
    DataError,
    MarkovSource,
    TokenFiles,
    WindowSource,
    make_loader,
    markov_chain,
    resolve_files,
    to_global,
)
from jaxpar.errors import ConfigError


def _save(path, tokens, dtype):
    """Token file at ``path`` (.npy or raw .bin) holding ``tokens`` as ``dtype``."""
    tokens = np.asarray(tokens, dtype)
    if path.suffix == ".npy":
        np.save(path, tokens)
    else:
        tokens.tofile(path)
    return path


def _files_cfg(tmp_path, tokens, **kw):
    _save(tmp_path / "a.npy", tokens[: len(tokens) // 3], np.uint16)
    _save(tmp_path / "b.npy", tokens[len(tokens) // 3 :], np.uint16)
    return DataConfig(source="files", path=str(tmp_path), **kw)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in ("inputs", "targets"))


# ---------------------------------------------------------------------------------- markov chain
def test_chain_is_a_stationary_sparse_chain():
    chain = markov_chain(256, branching=8, seed=0)
    assert chain.successors.shape == (256, 8) and chain.probs.shape == (256, 8)
    assert all(len(set(row)) == 8 for row in chain.successors.tolist())
    np.testing.assert_allclose(chain.probs.sum(axis=1), 1.0, atol=1e-12)
    pi, matrix = chain.stationary, chain.matrix()
    state, seen = 0, set()
    for _ in range(256):  # successor 0 walks one cycle through every token
        seen.add(state)
        state = chain.successors[state, 0]
    assert len(seen) == 256 and state == 0
    assert abs(pi.sum() - 1) < 1e-12 and pi.min() > 0
    assert np.abs(pi @ matrix - pi).max() < 1e-10
    assert 0 < chain.entropy_rate < np.log(8)
    assert markov_chain(256, branching=8, seed=0) is chain  # cached, same table
    assert not np.array_equal(markov_chain(256, branching=8, seed=1).successors, chain.successors)


def test_entropy_rate_matches_monte_carlo():
    """Mean -log P(x[t+1] | x[t]) over sampled records estimates the entropy rate; tolerance 4 std errors."""
    chain = markov_chain(64, branching=4, seed=3)
    source = MarkovSource(chain, seq=128, stream=(0, 7))
    records = np.stack([source[i] for i in range(1500)])
    with np.errstate(divide="ignore"):
        log_p = np.log(chain.matrix())[records[:, :-1], records[:, 1:]].ravel()
    assert np.isfinite(log_p).all()  # every step is an edge of the chain
    loss = -log_p
    # consecutive steps are correlated; treat each record's mean as one independent sample
    per_record = loss.reshape(len(records), -1).mean(axis=1)
    stderr = per_record.std() / np.sqrt(len(per_record))
    assert abs(loss.mean() - chain.entropy_rate) < 4 * stderr, (loss.mean(), chain.entropy_rate, stderr)
    firsts = np.bincount(records[:, 0], minlength=64) / len(records)  # first tokens come from π
    assert np.abs(firsts - chain.stationary).sum() < 0.25


def test_markov_records_are_deterministic_and_random_access():
    chain = markov_chain(256, branching=8, seed=0)
    a, b = MarkovSource(chain, 16, (0, 1)), MarkovSource(chain, 16, (0, 1))
    assert len(a) >= 2**31
    for i in (0, 5, 123_456_789, len(a) - 1):
        assert a[i].dtype == np.int32 and a[i].shape == (17,)
        np.testing.assert_array_equal(a[i], b[i])
    assert not np.array_equal(a[0], a[1])
    assert not np.array_equal(a[0], MarkovSource(chain, 16, (1, 1))[0])


# ---------------------------------------------------------------------------------- token files
@pytest.mark.parametrize(
    "suffix,dtype",
    [(".npy", np.uint16), (".npy", np.uint32), (".npy", np.int32), (".bin", np.uint16), (".bin", np.uint32)],
)
def test_windows_span_files(tmp_path, suffix, dtype):
    stream = (np.arange(40) * 7919) % 70_000 if dtype != np.uint16 else np.arange(40) * 3
    paths = [_save(tmp_path / f"{n}{suffix}", part, dtype) for n, part in enumerate((stream[:13], stream[13:]))]
    files = TokenFiles(paths, np.dtype(dtype).name if suffix == ".bin" else "uint16")
    assert files.total == 40
    windows = WindowSource(files, seq=5, first=0, count=(40 - 1) // 5)
    for j in range(len(windows)):  # window 2 crosses the file boundary
        np.testing.assert_array_equal(windows[j], stream[5 * j : 5 * j + 6])
        assert windows[j].dtype == np.int32


def test_eval_split_is_disjoint_and_packing_keeps_every_token(tmp_path):
    stream = np.arange(1000)  # token id == position
    cfg = _files_cfg(tmp_path, stream, shuffle=False, eval_fraction=0.1)
    seq, windows = 8, 999 // 8  # 124 windows: 112 train, 12 eval
    train = make_loader(cfg, vocab_size=1000, seq=seq, global_batch=4, seed=0)
    evals = make_loader(cfg, vocab_size=1000, seq=seq, global_batch=4, seed=0, split="eval")
    tr, ev = _take(train, 28), _take(evals, 3)
    inputs = np.concatenate([b["inputs"].ravel() for b in tr + ev])
    np.testing.assert_array_equal(inputs, stream[: windows * seq])  # nothing lost, nothing doubled
    np.testing.assert_array_equal(ev[-1]["targets"][-1, -1], windows * seq)
    train_targets = {int(t) for b in tr for t in b["targets"].ravel()}
    eval_targets = {int(t) for b in ev for t in b["targets"].ravel()}
    assert not train_targets & eval_targets
    assert np.array_equal(next(evals)["inputs"], ev[0]["inputs"])  # eval repeats from its start
    shuffled = make_loader(dataclasses.replace(cfg, shuffle=True), vocab_size=1000, seq=seq, global_batch=4, seed=0)
    firsts = sorted(int(x) for b in _take(shuffled, 28) for x in b["inputs"][:, 0])
    assert firsts == [8 * j for j in range(112)]  # one epoch = each train window once


def test_eval_path_files(tmp_path):
    (tmp_path / "train").mkdir()
    _save(tmp_path / "train" / "t.bin", np.arange(100), np.uint16)
    _save(tmp_path / "held.npy", np.arange(500, 550), np.uint16)
    cfg = DataConfig(
        source="files", path=str(tmp_path / "train" / "*.bin"), eval_path=str(tmp_path / "held.npy"), shuffle=False
    )
    train = make_loader(cfg, vocab_size=600, seq=9, global_batch=11, seed=0)
    assert next(train)["inputs"].ravel().tolist() == list(range(99))  # all 11 windows: nothing held out
    assert next(make_loader(cfg, vocab_size=600, seq=9, global_batch=1, seed=0, split="eval"))["inputs"][0, 0] == 500
    overlapping = dataclasses.replace(cfg, eval_path=str(tmp_path / "train"))
    with pytest.raises(DataError, match=r"data\.eval_path and data\.path share .*t\.bin"):
        make_loader(overlapping, vocab_size=600, seq=9, global_batch=1, seed=0, split="eval")


# ---------------------------------------------------------------------------------- loader
@pytest.mark.parametrize("source", ["markov", "files"])
def test_loader_is_deterministic_and_resumes_exactly(tmp_path, source):
    cfg = DataConfig() if source == "markov" else _files_cfg(tmp_path, np.arange(3000) % 256)
    make = lambda **kw: make_loader(dataclasses.replace(cfg, **kw), vocab_size=256, seq=16, global_batch=8, seed=3)
    first = make(num_threads=2)
    head = _take(first, 3)
    state = json.loads(json.dumps(first.get_state()))
    tail = _take(first, 3)
    assert head[0]["inputs"].shape == (8, 16) and head[0]["targets"].dtype == np.int32
    np.testing.assert_array_equal(head[0]["inputs"][:, 1:], head[0]["targets"][:, :-1])
    assert _same(head + tail, _take(make(num_threads=0, prefetch=0), 6))  # independent of threads
    resumed = make(num_threads=1)
    resumed.set_state(state)
    assert _same(tail, _take(resumed, 3))
    other = make_loader(cfg, vocab_size=256, seq=16, global_batch=8, seed=4)
    assert not np.array_equal(next(other)["inputs"], head[0]["inputs"])
    wrong = make_loader(cfg, vocab_size=256, seq=16, global_batch=16, seed=3)
    with pytest.raises(DataError, match="batch"):
        wrong.set_state(state)
    assert (first.entropy_rate is None) == (source == "files") and source in first.describe()


def test_processes_hold_consecutive_rows_of_the_global_batch(tmp_path):
    """Process p of P gets rows [p*b, (p+1)*b) of the batch one process would read; positions transfer."""
    cfg = _files_cfg(tmp_path, np.arange(5000) % 256)
    kw = dict(vocab_size=256, seq=16, global_batch=8, seed=1)
    single = _take(make_loader(cfg, **kw, process_index=0, process_count=1), 4)
    halves = [_take(make_loader(cfg, **kw, process_index=p, process_count=2), 4) for p in range(2)]
    for k in range(4):
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(np.concatenate([halves[0][k][key], halves[1][k][key]]), single[k][key])
    one = make_loader(cfg, **kw, process_index=0, process_count=1)
    _take(one, 2)
    second = make_loader(cfg, **kw, process_index=1, process_count=2)
    second.set_state(one.get_state())
    np.testing.assert_array_equal(next(second)["inputs"], single[2]["inputs"][4:])


def test_to_global_on_eight_devices():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    batch = next(make_loader(DataConfig(), vocab_size=256, seq=16, global_batch=16, seed=0))
    sharding = NamedSharding(mesh, P("data"))
    for spec in (sharding, {"inputs": sharding, "targets": NamedSharding(mesh, P("data", None))}):
        out = to_global(batch, spec)
        assert out["inputs"].shape == (16, 16) and out["inputs"].sharding == sharding
        assert len(out["targets"].addressable_shards) == 8
        for key in batch:
            np.testing.assert_array_equal(np.asarray(out[key]), batch[key])


# ---------------------------------------------------------------------------------- bad input
def test_missing_path_names_field_and_path(tmp_path):
    with pytest.raises(DataError, match=r"data\.path.*nope\.bin"):
        make_loader(
            DataConfig(source="files", path=str(tmp_path / "nope.bin")), vocab_size=256, seq=8, global_batch=2, seed=0
        )
    with pytest.raises(DataError, match=r"data\.path is empty"):
        resolve_files("")
    with pytest.raises(DataError, match=r"data\.eval_path"):
        make_loader(
            _files_cfg(tmp_path, np.arange(100), eval_path=str(tmp_path / "x" / "*.npy")),
            vocab_size=256,
            seq=8,
            global_batch=2,
            seed=0,
            split="eval",
        )


def test_token_id_outside_vocab(tmp_path):
    tokens = np.arange(300) % 200
    tokens[123] = 4000
    _save(tmp_path / "big.npy", tokens, np.uint16)
    cfg = DataConfig(source="files", path=str(tmp_path / "big.npy"))
    with pytest.raises(DataError) as err:
        make_loader(cfg, vocab_size=256, seq=8, global_batch=2, seed=0)
    for word in ("big.npy", "4000", "position 123", "model.vocab_size=256"):
        assert word in str(err.value)
    make_loader(cfg, vocab_size=4001, seq=8, global_batch=2, seed=0)


def test_bad_files(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(DataError, match=r"odd\.bin: 3 bytes is not a multiple of 2"):
        make_loader(
            DataConfig(source="files", path=str(tmp_path / "odd.bin")), vocab_size=256, seq=1, global_batch=1, seed=0
        )
    _save(tmp_path / "short.npy", np.arange(10), np.uint16)
    with pytest.raises(DataError, match=r"short\.npy hold 10 tokens.*--seq 8.*--seq 4 or less"):
        make_loader(
            DataConfig(source="files", path=str(tmp_path / "short.npy")), vocab_size=256, seq=8, global_batch=1, seed=0
        )
    np.save(tmp_path / "two_d.npy", np.zeros((3, 3), np.uint16))
    with pytest.raises(DataError, match="1-D"):
        TokenFiles([tmp_path / "two_d.npy"], "uint16")
    _save(tmp_path / "wide.bin", np.arange(10), np.uint32)
    (tmp_path / "wide.json").write_text(json.dumps({"dtype": "uint32"}))
    with pytest.raises(DataError, match="data.dtype=uint32"):
        TokenFiles([tmp_path / "wide.bin"], "uint16")


@pytest.mark.parametrize(
    "fields,error,words",
    [
        (dict(source="markv"), ConfigError, ["data.source='markv': choose one of", "did you mean 'markov'"]),
        (dict(dtype="int8"), ConfigError, ["data.dtype='int8': choose one of uint16, uint32"]),
        (dict(eval_fraction=1.0), DataError, ["data.eval_fraction=1.0"]),
        (dict(markov_branching=0), DataError, ["data.markov_branching=0"]),
    ],
)
def test_bad_config_fields(fields, error, words):
    with pytest.raises(error) as err:
        DataConfig(**fields)
    assert all(w in str(err.value) for w in words)


def test_bad_loader_arguments():
    with pytest.raises(DataError, match=r"--batch 6.*\(4\)"):
        make_loader(DataConfig(), vocab_size=256, seq=8, global_batch=6, seed=0, process_index=0, process_count=4)
    with pytest.raises(DataError, match=r"data\.markov_branching=300.*model\.vocab_size=256"):
        make_loader(DataConfig(markov_branching=300), vocab_size=256, seq=8, global_batch=2, seed=0)


# ---------------------------------------------------------------------------------- prepare
def _prepare(capsys, *argv):
    rc = main(["prepare", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_prepare_bytes(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes("héllo\n".encode())
    (tmp_path / "b.txt").write_bytes(b"ok")
    rc, out, _ = _prepare(capsys, tmp_path / "a.txt", tmp_path / "b.txt", "--out", tmp_path / "t.bin", "--bytes")
    assert rc == 0 and "2 documents" in out and "model.vocab_size=257" in out
    expected = [*"héllo\n".encode(), 256, *b"ok", 256]
    assert np.fromfile(tmp_path / "t.bin", np.uint16).tolist() == expected
    meta = json.loads((tmp_path / "t.json").read_text())
    assert meta == {
        "vocab_size": 257,
        "eos_id": 256,
        "dtype": "uint16",
        "tokenizer": "bytes",
        "field": "text",
        "documents": 2,
        "tokens": 11,
        "trained_tokens": 11,
        "skipped": {},
    }
    assert np.load(tmp_path / "t.docs.npy").tolist() == [0, 8, 11]  # the documents' offsets
    batch = next(
        make_loader(
            DataConfig(source="files", path=str(tmp_path / "t.bin"), shuffle=False, eval_fraction=0.5),
            vocab_size=257,
            seq=5,
            global_batch=1,
            seed=0,
        )
    )
    assert batch["inputs"][0].tolist() == expected[:5]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "t.bin", "t.docs.npy", "t.json"]  # no temps


def _tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["the cat sat on the mat", "a dog ran", "the end"], trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    )
    tok.save(str(path))
    return tok


def test_prepare_tokenizer_round_trips(tmp_path, capsys, monkeypatch):
    tok = _tokenizer(tmp_path / "tok.json")
    docs = ["the cat sat\non the mat\n" * 20, "a dog ran\nthe end", "the mat"]
    for n, doc in enumerate(docs):
        (tmp_path / f"{n}.txt").write_text(doc)
    monkeypatch.setattr(encoder, "PIECE_BYTES", 16)  # many pieces per document, tiny batches
    monkeypatch.setattr(encoder, "BATCH_BYTES", 40)
    assert len(list(encoder._text_pieces(tmp_path / "0.txt"))) > 10
    rc, out, _ = _prepare(
        capsys,
        *(tmp_path / f"{n}.txt" for n in range(3)),
        "--out",
        tmp_path / "t.npy",
        "--tokenizer",
        tmp_path / "tok.json",
        "--eval-fraction",
        "0.4",
    )
    assert rc == 0 and "data.eval_path=" in out
    eos = tok.token_to_id("</s>")
    train, held = np.load(tmp_path / "t.npy"), np.load(tmp_path / "t.eval.npy")
    assert train.dtype == np.uint16 and held.tolist() == tok.encode(docs[2]).ids + [eos]
    assert train.tolist() == tok.encode(docs[0]).ids + [eos] + tok.encode(docs[1]).ids + [eos]
    assert tok.decode(held.tolist()[:-1]) == docs[2]
    assert json.loads((tmp_path / "t.eval.json").read_text())["vocab_size"] == tok.get_vocab_size()


def test_prepare_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("hi")
    (tmp_path / "t.bin").write_bytes(b"keep")
    rc, out, err = _prepare(capsys, tmp_path / "a.txt", "--out", tmp_path / "t.bin", "--bytes")
    assert rc == 2 and err.startswith("jaxpar: error: ") and "t.bin already exists" in err and out == ""
    assert (tmp_path / "t.bin").read_bytes() == b"keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "t.bin"]


def test_prepare_input_errors(tmp_path, capsys):
    rc, _, err = _prepare(capsys, tmp_path / "missing.txt", "--out", tmp_path / "t.bin", "--bytes")
    assert rc == 2 and "missing.txt: no such input file" in err and not (tmp_path / "t.bin").exists()
    (tmp_path / "a.txt").write_text("the cat")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"the": 0, "cat": 1, "<unk>": 2}, unk_token="<unk>")).save(str(tmp_path / "k.json"))
    rc, _, err = _prepare(capsys, tmp_path / "a.txt", "--out", tmp_path / "t.bin", "--tokenizer", tmp_path / "k.json")
    assert rc == 2 and "--eos-token" in err and list(tmp_path.glob("t*")) == []


def test_prepare_large_vocab_writes_uint32(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"<unk>": 70_000, "[END]": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "a.txt").write_text("w69999 w1 w2 w3\nw4 w5 w6 w7 w8")
    rc, out, _ = _prepare(
        capsys,
        tmp_path / "a.txt",
        "--out",
        tmp_path / "t.bin",
        "--tokenizer",
        tmp_path / "big.json",
        "--eos-token",
        "[END]",
    )
    assert rc == 0 and "--set data.dtype=uint32" in out and "model.vocab_size=70002" in out
    assert np.fromfile(tmp_path / "t.bin", np.uint32).tolist() == [69999, 1, 2, 3, 4, 5, 6, 7, 8, 70_001]
    cfg = DataConfig(source="files", path=str(tmp_path / "t.bin"), eval_fraction=0.5, shuffle=False)
    with pytest.raises(DataError, match="--set data.dtype=uint32"):  # the sidecar says uint32
        make_loader(cfg, vocab_size=70_002, seq=4, global_batch=1, seed=0)
    wide = make_loader(dataclasses.replace(cfg, dtype="uint32"), vocab_size=70_002, seq=4, global_batch=1, seed=0)
    assert next(wide)["inputs"].tolist() == [[69999, 1, 2, 3]]
