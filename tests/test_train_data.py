"""``jaxpar train --data INPUT...``: records tokenized on the fly into a cache (train/prepared.py), read
back by the same command run again, prepared anew when an input changes; the flags that go with it are
refused without it, by name, before any work."""

import json

import pytest
from test_chat_mask import CHATS, PLAIN
from test_corpus import _bpe, _jsonl

from jaxpar.cli import main


def _train(tmp_path, out, *extra):
    return main(
        ["train", "--model", "tiny", "--mesh", "data=8", "--batch", "8", "--seq", "16", "--steps", "1"]
        + ["--out", str(tmp_path / out), "--set", "log.progress=false", "--set", "log.eval_every=0", *extra]
    )


def _chats(tmp_path, monkeypatch, tail: bytes = b""):
    """(chat.jsonl, the --data flags): 40 rounds of the chats (then ``tail``), a BPE tokenizer with a
    chat template beside it, the cache in ``tmp_path``."""
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok = _bpe(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": PLAIN}))
    data = tmp_path / "chat.jsonl"
    data.write_bytes(_jsonl([{"messages": c} for c in CHATS * 40]) + tail)
    return data, ["--data", str(data), "--tokenizer", str(tok), "--set", "model.vocab_size=400"]


def test_data_is_prepared_once_and_prepared_again_when_it_changes(tmp_path, capsys, monkeypatch):
    data, flags = _chats(tmp_path, monkeypatch)
    assert _train(tmp_path, "a", *flags) == 0
    out = capsys.readouterr().out
    assert "--data: prepared into" in out and "with loss masks" in out  # messages found in the records
    assert _train(tmp_path, "b", *flags) == 0
    assert "--data: prepared" not in capsys.readouterr().out  # the cache
    data.write_bytes(_jsonl([{"messages": c} for c in CHATS * 41]))
    assert _train(tmp_path, "c", *flags) == 0
    assert "--data: prepared into" in capsys.readouterr().out
    assert len(list((tmp_path / "cache" / "prepared").iterdir())) == 2


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--tokenizer", "t.json"], "--tokenizer, --data-field and --skip-bad go with --data"),
        (["--skip-bad"], "--tokenizer, --data-field and --skip-bad go with --data"),
        (["--data", "missing.jsonl", "--tokenizer", "__file__"], "--data missing.jsonl: no such input"),
        (["--data", "__file__"], "--data: name the tokenizer (--tokenizer FILE)"),
    ],
)
def test_data_flags_are_refused_by_name(tmp_path, capsys, flags, words):
    flags = [__file__ if f == "__file__" else f for f in flags]
    assert _train(tmp_path, "run", *flags) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_bad_records_stop_the_run_or_are_skipped_and_counted_in_its_metrics(tmp_path, capsys, monkeypatch):
    """A bad record refuses the run, naming its file and line; with --skip-bad the run trains on the
    rest, and its first metrics record counts the skipped ones by reason."""
    data, flags = _chats(tmp_path, monkeypatch, b"not json\n" + b'{"messages": []}\n')
    assert _train(tmp_path, "strict", *flags) == 2
    assert f"{data}:{len(CHATS) * 40 + 1}" in capsys.readouterr().err and not (tmp_path / "strict").exists()
    assert _train(tmp_path, "lenient", *flags, "--skip-bad") == 0
    assert "2 bad records skipped" in capsys.readouterr().out
    first = json.loads((tmp_path / "lenient" / "metrics.jsonl").read_text().splitlines()[0])
    assert sum(first["data_skipped"].values()) == 2 and len(first["data_skipped"]) == 2
