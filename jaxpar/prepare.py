"""``jaxpar prepare``: documents -> a token file for ``data.source=files``.

    jaxpar prepare books/*.txt --out tokens.bin --tokenizer tokenizer.json [--eval-fraction 0.05]
    jaxpar prepare notes.txt --out tokens.npy --bytes
    jaxpar prepare corpus.jsonl.zst shard-*.parquet --field text --out tokens.bin --tokenizer tokenizer.json
    jaxpar prepare chat.jsonl --field messages --out sft.bin --tokenizer model/tokenizer.json
    jaxpar prepare prefs.jsonl --field preference --out dpo.bin --tokenizer model/tokenizer.json

Inputs (``jaxpar.corpus``): a text file is one document; jsonl (``.gz``, ``.zst``), parquet and a
``datasets`` folder hold one record per line or row, whose ``--field`` is the document: ``text``, or
``messages`` (a chat, rendered with the tokenizer's chat template), or ``preference`` (``prompt``,
``chosen``, ``rejected``: texts or chats; two documents per record, ``jaxpar.pairs``, each with a
loss mask on its completion, for ``objective=dpo``). ``--reader datasets|streaming``
reads jsonl and parquet through ``datasets.load_dataset``; every reader gives the same documents.

A text document's tokens are followed by the EOS id. A chat is the template's rendering, its special
tokens included (no EOS is added: each turn ends with the template's own end-of-turn token), and comes
with a loss mask: 1 on each assistant reply through its end-of-turn token, 0 elsewhere
(``jaxpar.chat``: the spans are found by rendering prefixes and diffing). The documents are written back
to back. ``--tokenizer`` takes a local Hugging Face ``tokenizers`` file (no special tokens are added
besides EOS); ``--bytes`` uses byte values 0..255 and EOS = 256.

Written beside OUT (``.bin`` raw ids or ``.npy``): ids as uint16 when the vocabulary fits, else uint32;
``OUT.docs.npy``, the int64 offsets of the documents (their starts, then the total); for chat,
``OUT.mask.bin|.npy``, one uint8 per token; and the sidecar ``OUT.json`` (vocab_size, eos_id, dtype,
tokenizer, field, documents, tokens, trained tokens, skipped records) that the loader checks.

``--eval-fraction F`` writes the last F of the records (at least one) to ``OUT.eval.*`` instead, for
``data.eval_path``: a held-out split at document boundaries. A bad record stops the command with its
file and line, or with ``--skip-bad`` is skipped and counted (printed, and in the sidecar).

Memory stays bounded (``jaxpar.encoder``): text is read in pieces of about ``PIECE_BYTES``, cut after a
newline that starts a line with a non-space character, and encoded ``BATCH_BYTES`` at a time with
``encode_batch``. Such cuts change no token for tokenizers whose pre-tokenizer splits there (byte-level
BPE such as GPT-2 or Llama 3, whitespace splitters); a SentencePiece-style tokenizer that prepends "▁" to
every input sees one extra "▁" per piece of a longer document.

Nothing is overwritten: the command refuses an existing output, writes temporary files next to it and
moves them into place only when everything succeeded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from jaxpar.corpus import Field, Reader, documents, open_sources
from jaxpar.data import DataError
from jaxpar.encoder import EOS_CANDIDATES, Encoder

HELP = "tokenize documents (text files, jsonl, parquet, datasets; text or chat) into a token file for data.source=files"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="text files (one document each), .jsonl[.gz|.zst] or .parquet records, or a datasets folder",
    )
    parser.add_argument("--out", required=True, help="OUT.bin (raw ids) or OUT.npy; never overwritten")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", metavar="JSON", help="a local Hugging Face tokenizer.json")
    how.add_argument("--bytes", action="store_true", help="one token per byte (0..255), EOS = 256")
    parser.add_argument(
        "--eos-token",
        help=f"the EOS token of --tokenizer (default: the first of {' '.join(EOS_CANDIDATES)} in its vocabulary)",
    )
    parser.add_argument(
        "--field",
        default=Field.TEXT.value,
        choices=[f.value for f in Field],
        help="the records' field: text, messages (a chat, with a loss mask on the assistant's replies), or "
        "preference (prompt, chosen, rejected: two documents per record, for objective=dpo)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="JINJA",
        help="the chat template for --field messages (default: the one beside --tokenizer)",
    )
    parser.add_argument(
        "--reader",
        default=Reader.NATIVE.value,
        choices=[r.value for r in Reader],
        help="how jsonl/parquet are read: jaxpar's readers, or datasets.load_dataset (streaming or not)",
    )
    parser.add_argument("--skip-bad", action="store_true", help="skip bad records and count them, instead of stopping")
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="write the last F of the records to OUT.eval.bin|.npy (for data.eval_path)",
    )


def _write_ids(chunks, dtype: str, raw: Path, mask: Path | None) -> tuple[int, list[int], int]:
    """Appends every piece to ``raw`` as ``dtype`` (its mask to ``mask``); returns (ids written, document
    offsets, trained ids)."""
    count, offsets, trained = 0, [0], 0
    with open(raw, "wb") as f, open(mask, "wb") if mask else contextlib.nullcontext() as m:
        for ids, keep, end in chunks:
            f.write(ids.astype(dtype).tobytes())
            count += len(ids)
            if m is not None:
                m.write(keep.tobytes())
                trained += int(keep.sum())
            if end:
                offsets.append(count)
    return count, offsets, trained if mask else count


def _to_npy(raw: Path, npy: Path, dtype: str, count: int) -> None:
    ids = np.memmap(raw, dtype=dtype, mode="r") if count else np.zeros(0, dtype)
    out = np.lib.format.open_memmap(npy, mode="w+", dtype=dtype, shape=(count,))
    for start in range(0, count, 1 << 24):
        out[start : start + (1 << 24)] = ids[start : start + (1 << 24)]
    out.flush()
    del out, ids


def _publish(tmp: Path, final: Path) -> None:
    """Moves ``tmp`` to ``final`` without ever replacing a file that appeared meanwhile."""
    try:
        os.link(tmp, final)  # fails if final exists: no overwrite, even in a race
    except FileExistsError:
        raise DataError(f"--out: {final} appeared while writing; not overwritten") from None
    except OSError:  # filesystems without hard links
        if final.exists():
            raise DataError(f"--out: {final} appeared while writing; not overwritten") from None
        os.replace(tmp, final)
        return
    tmp.unlink()


def _outputs(out: Path, chat: bool) -> list[Path]:
    """The files of one output: ids, sidecar, document offsets, and the mask of a chat."""
    return [out, out.with_suffix(".json"), out.with_suffix(".docs.npy")] + (
        [out.with_suffix(".mask" + out.suffix)] if chat else []
    )


def _plan(args, sources) -> list[tuple[Path, int, int | None]]:
    """[(output file, first record, stop)]: OUT, and OUT.eval.* (the last records) with --eval-fraction."""
    out = Path(args.out)
    if out.suffix not in (".bin", ".npy"):
        raise DataError(f"--out {out}: name a .bin or .npy file")
    if not out.parent.is_dir():
        raise DataError(f"--out {out}: directory {out.parent} does not exist")
    if args.eval_fraction == 0:
        return [(out, 0, None)]
    if not 0 < args.eval_fraction < 1:
        raise DataError(f"--eval-fraction {args.eval_fraction}: needs 0 < F < 1")
    records = sum(source.count() for source in sources)
    if records < 2:
        raise DataError(
            f"--eval-fraction {args.eval_fraction}: needs at least two documents to hold out whole ones "
            f"(the inputs hold {records})"
        )
    n_eval = min(records - 1, max(1, int(records * args.eval_fraction)))
    return [(out, 0, records - n_eval), (out.with_suffix(".eval" + out.suffix), records - n_eval, None)]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write(out: Path, docs, encoder: Encoder, dtype: str, temps: dict[Path, Path]) -> dict:
    """Writes ``out``, its mask, offsets and sidecar to temporary files (registered in ``temps``); returns
    the sidecar."""
    chat = encoder.field != Field.TEXT  # a loss mask
    mask = out.with_suffix(".mask" + out.suffix) if chat else None
    raws = {out: out.with_suffix(".raw")} | ({mask: out.with_suffix(".mask.raw")} if chat else {})
    for final in _outputs(out, chat) + (list(raws.values()) if out.suffix == ".npy" else []):
        fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{final.name}.", suffix=".tmp")
        os.close(fd)
        os.chmod(name, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        temps[final] = Path(name)
    where = {final: temps[raws[final]] if out.suffix == ".npy" else temps[final] for final in raws}
    count, offsets, trained = _write_ids(encoder.chunks(docs), dtype, where[out], where.get(mask))
    if len(offsets) < 2:
        raise DataError(f"{out}: no documents to write (skipped: {dict(encoder.skipped) or 'none'})")
    if out.suffix == ".npy":
        for final, raw in raws.items():
            _to_npy(temps[raw], temps[final], dtype if final == out else "uint8", count)
    with open(temps[out.with_suffix(".docs.npy")], "wb") as f:
        np.save(f, np.asarray(offsets, np.int64))
    meta = {
        "vocab_size": encoder.vocab_size,
        "eos_id": encoder.eos_id,
        "dtype": dtype,
        "tokenizer": encoder.name,
        "field": encoder.field.value,
        "documents": len(offsets) - 1,
        "tokens": count,
        "trained_tokens": trained,
        "skipped": dict(encoder.skipped),
    }
    temps[out.with_suffix(".json")].write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def prepare(
    inputs: list[str],
    out: str | Path,
    *,
    tokenizer: str,
    field: str = Field.TEXT,
    chat_template: str | None = None,
    skip_bad: bool = False,
) -> int:
    """``jaxpar prepare INPUTS --out OUT --tokenizer TOKENIZER --field FIELD [--skip-bad]`` (``jaxpar
    train --data``)."""
    args = argparse.Namespace(
        inputs=[str(p) for p in inputs],
        out=str(out),
        tokenizer=str(tokenizer),
        bytes=False,
        eos_token=None,
        field=str(field),
        chat_template=chat_template,
        reader=Reader.NATIVE.value,
        skip_bad=skip_bad,
        eval_fraction=0.0,
    )
    return run(args)


def outputs(out: Path, field: str) -> list[Path]:
    """The files ``prepare`` writes for ``out`` (ids, sidecar, document offsets, and a chat's mask)."""
    return _outputs(Path(out), field != Field.TEXT)


def run(args) -> int:
    if args.eos_token and not args.tokenizer:
        raise DataError("--eos-token goes with --tokenizer; --bytes always uses EOS = 256")
    sources = open_sources(args.inputs, field=args.field, reader=args.reader)
    plan = _plan(args, sources)
    chat = args.field != Field.TEXT
    finals = [p for out, _, _ in plan for p in _outputs(out, chat)]
    for path in finals:
        if path.exists():
            raise DataError(f"--out: {path} already exists; not overwritten (remove it or choose another --out)")
    skipped = Counter()
    encoder = Encoder(args, skipped)
    dtype = "uint16" if encoder.vocab_size <= 65536 else "uint32"
    temps: dict[Path, Path] = {}
    published: list[Path] = []
    try:
        metas = []
        for out, start, stop in plan:
            skipped.clear()
            docs = documents(sources, args.field, skip_bad=args.skip_bad, skipped=skipped, start=start, stop=stop)
            metas.append(_write(out, docs, encoder, dtype, temps))
        for final in finals:
            _publish(temps[final], final)
            published.append(final)
    except BaseException:
        for path in published:  # all or nothing
            path.unlink()
        raise
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)
    _report(plan, metas, encoder, dtype)
    return 0


def _report(plan, metas, encoder: Encoder, dtype: str) -> None:
    for (out, _, _), meta in zip(plan, metas):
        trained = f", {meta['trained_tokens']:,} trained" if meta["field"] != "text" else ""
        skipped = "".join(f"; skipped {n} ({why})" for why, n in meta["skipped"].items())
        print(
            f"wrote {out}: {meta['documents']} documents, {meta['tokens']:,} tokens ({dtype}){trained}, "
            f"vocab {encoder.vocab_size}, EOS id {encoder.eos_id}{skipped}"
        )
    hint = f"--set data.source=files --set data.path={plan[0][0]}"
    hint += f" --set data.eval_path={plan[1][0]}" if len(plan) > 1 else ""
    hint += {"messages": " --set data.pack=documents", "preference": " --set data.pack=pairs --set objective=dpo"}.get(
        metas[0]["field"], ""
    )
    hint += " --set data.dtype=uint32" if dtype == "uint32" and plan[0][0].suffix == ".bin" else ""
    hint += f" --set model.vocab_size={encoder.vocab_size}" if encoder.vocab_size != 256 else ""
    print(f"train on it with: {hint}")
