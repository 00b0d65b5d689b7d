"""``jaxpar prepare`` over records (jaxpar.corpus): every format gives the same token stream, bad records
are refused with file and line (or skipped and counted), the held-out split falls at record boundaries."""

import gzip
import json

import numpy as np
import pytest
import zstandard

from jaxpar.cli import main

DOCS = ["the cat sat\non the mat\n", "a dog ran", "héllo wörld ✓", "the end\n\n  indented"]


def _prepare(capsys, *argv):
    rc = main(["prepare", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _write_formats(folder):
    """The same documents as text files, jsonl (plain, gz, zst), parquet and a datasets folder."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    records = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    for i, doc in enumerate(DOCS):
        (folder / f"{i}.txt").write_text(doc)
    (folder / "d.jsonl").write_bytes(_jsonl(records))
    (folder / "d.jsonl.gz").write_bytes(gzip.compress(_jsonl(records)))
    (folder / "d.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(records)))
    table = pa.Table.from_pylist(records)
    pq.write_table(table.slice(0, 1), folder / "a.parquet")  # two files, read in order
    pq.write_table(table.slice(1), folder / "b.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(folder / "saved"))
    return folder


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_every_format_gives_the_same_tokens(tmp_path, capsys, tokenizer):
    src = _write_formats(tmp_path / "src")
    how = ["--bytes"] if tokenizer == "bytes" else ["--tokenizer", _bpe(tmp_path / "tok.json")]
    inputs = {
        "txt": [src / f"{i}.txt" for i in range(len(DOCS))],
        "jsonl": [src / "d.jsonl"],
        "jsonl.gz": [src / "d.jsonl.gz"],
        "jsonl.zst": [src / "d.jsonl.zst"],
        "parquet": [src / "a.parquet", src / "b.parquet"],
        "datasets folder": [src / "saved"],
        "load_dataset jsonl": [src / "d.jsonl", "--reader", "datasets"],
        "load_dataset jsonl streaming": [src / "d.jsonl", "--reader", "streaming"],
        "load_dataset parquet streaming": [src / "a.parquet", src / "b.parquet", "--reader", "streaming"],
    }
    streams = {}
    for name, args in inputs.items():
        out = tmp_path / f"{name.replace(' ', '_')}.bin"
        rc, printed, err = _prepare(capsys, *args, "--out", out, *how)
        assert rc == 0, (name, err)
        assert f"{len(DOCS)} documents" in printed
        streams[name] = (out.read_bytes(), np.load(out.with_suffix(".docs.npy")).tolist())
    want = streams.pop("txt")
    assert len(want[1]) == len(DOCS) + 1 and want[1][-1] * 2 == len(want[0])  # uint16 ids
    for name, got in streams.items():
        assert got == want, name


def _bpe(path):
    """A small byte-level BPE tokenizer with an EOS (and chat tokens), saved at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(DOCS * 20 + ["user assistant system hello reverse abc cba"] * 20, trainer)
    tok.save(str(path))
    return path


BAD = [  # (line, the reason as counted)
    (b"not json\n", "not JSON"),
    (b"[1, 2]\n", "not a JSON object"),
    (b'{"body": "x"}\n', "missing field 'text'"),
    (b'{"text": ""}\n', "empty record"),
    (b"\n", "empty record"),
    (b'{"text": 3}\n', "'text' is not a string"),
    (b'{"text": "caf\xe9"}\n', "invalid UTF-8"),
]


@pytest.mark.parametrize("line, reason", BAD, ids=[r for _, r in BAD])
def test_a_bad_record_is_refused_with_file_and_line(tmp_path, capsys, line, reason):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl([{"text": "ok"}]) + line + _jsonl([{"text": "fine"}]))
    rc, out, err = _prepare(capsys, path, "--out", tmp_path / "t.bin", "--bytes")
    assert rc == 2 and f"{path}:2: {reason}" in err and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl"]  # nothing written


def test_bad_records_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    lines = [_jsonl([{"text": "ok"}])] + [line for line, _ in BAD] + [_jsonl([{"text": "fine"}])]
    path.write_bytes(b"".join(lines))
    rc, out, err = _prepare(capsys, path, "--out", tmp_path / "t.bin", "--bytes", "--skip-bad")
    assert rc == 0, err
    meta = json.loads((tmp_path / "t.json").read_text())
    want = {}
    for _, reason in BAD:
        want[reason] = want.get(reason, 0) + 1
    assert meta["skipped"] == want and meta["documents"] == 2 and "skipped 2 (empty record)" in out
    assert np.fromfile(tmp_path / "t.bin", np.uint16).tolist() == [*b"ok", 256, *b"fine", 256]


def test_parquet_column_and_messages_records_are_checked(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"body": "x"}]), tmp_path / "p.parquet")
    rc, _, err = _prepare(capsys, tmp_path / "p.parquet", "--out", tmp_path / "t.bin", "--bytes")
    assert rc == 2 and "has no column 'text' (columns: body)" in err
    chat = tmp_path / "c.jsonl"
    chat.write_bytes(_jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}]}]))
    how = ["--tokenizer", _bpe(tmp_path / "k.json")]
    rc, _, err = _prepare(capsys, chat, "--field", "messages", "--out", tmp_path / "t.bin", *how)
    assert rc == 2 and "no chat template beside" in err and "--chat-template FILE" in err
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    how += ["--chat-template", tmp_path / "t.jinja"]
    rc, _, err = _prepare(capsys, chat, "--field", "messages", "--out", tmp_path / "t.bin", *how)
    assert rc == 2 and f"{chat}:1: unknown role (message 1: 'robot'" in err
    rc, _, err = _prepare(capsys, tmp_path / "x.txt", "--field", "messages", "--out", tmp_path / "t.bin", "--bytes")
    assert rc == 2 and "no such input file" in err
    (tmp_path / "x.txt").write_text("hi")
    rc, _, err = _prepare(capsys, tmp_path / "x.txt", "--field", "messages", "--out", tmp_path / "t.bin", "--bytes")
    assert rc == 2 and "a plain text file has no 'messages'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "k.json", "p.parquet", "t.jinja", "x.txt"]


def test_held_out_records_are_the_last_whole_documents(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    path.write_bytes(_jsonl([{"text": d} for d in DOCS]))
    rc, out, err = _prepare(capsys, path, "--out", tmp_path / "t.bin", "--bytes", "--eval-fraction", "0.5")
    assert rc == 0, err
    train, held = np.fromfile(tmp_path / "t.bin", np.uint16), np.fromfile(tmp_path / "t.eval.bin", np.uint16)
    encoded = [[*d.encode(), 256] for d in DOCS]
    assert train.tolist() == encoded[0] + encoded[1] and held.tolist() == encoded[2] + encoded[3]
    assert "data.eval_path=" in out
