"""``jaxpar prepare``: text files -> one token file for ``data.source=files``.

    jaxpar prepare books/*.txt --out tokens.bin --tokenizer tokenizer.json [--eval-fraction 0.05]
    jaxpar prepare notes.txt --out tokens.npy --bytes

Each input file is one document; its tokens are followed by the EOS id, and the documents are written
back to back (``jaxpar.data`` packs windows across them). ``--tokenizer`` takes a local Hugging Face
``tokenizers`` file (no special tokens are added besides EOS); ``--bytes`` uses byte values 0..255 and
EOS = 256. Ids are stored as uint16 when the vocabulary fits, else uint32, next to a sidecar
``OUT.json`` (vocab_size, eos_id, dtype, tokenizer, documents, tokens) that the loader checks.

``--eval-fraction F`` writes the last F of the documents (at least one) to ``OUT.eval.bin`` (or
``.npy``) instead, for ``data.eval_path``: a held-out split at document boundaries.

Memory stays bounded: text is read in pieces of about ``PIECE_BYTES``, cut after a newline that starts
a line with a non-space character, and encoded ``BATCH_BYTES`` at a time with ``encode_batch``. Such cuts
change no token for tokenizers whose pre-tokenizer splits there (byte-level BPE such as GPT-2 or
Llama 3, whitespace splitters); a SentencePiece-style tokenizer that prepends "▁" to every input sees one
extra "▁" per piece of a longer document.

Nothing is overwritten: the command refuses an existing output, writes temporary files next to it and
moves them into place only when everything succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from jaxpar.data import DataError

HELP = "tokenize text files (one document each) into a token file for data.source=files"
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
PIECE_BYTES = 1 << 20  # text read (and encoded) per piece of a document
BATCH_BYTES = 8 << 20  # text per encode_batch call


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="TEXT_FILE", help="text files, one document each")
    parser.add_argument("--out", required=True, help="OUT.bin (raw ids) or OUT.npy; never overwritten")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--tokenizer", metavar="JSON", help="a local Hugging Face tokenizer.json")
    how.add_argument("--bytes", action="store_true", help="one token per byte (0..255), EOS = 256")
    parser.add_argument(
        "--eos-token",
        help=f"the EOS token of --tokenizer (default: the first of {' '.join(EOS_CANDIDATES)} in its vocabulary)",
    )
    parser.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="write the last F of the documents to OUT.eval.bin|.npy (for data.eval_path)",
    )


class _Encoder:
    """Turns documents into id chunks, each document ending with ``eos_id``."""

    def __init__(self, tokenizer: str | None, eos_token: str | None):
        self.tokenizer = None
        if tokenizer is None:
            self.name, self.vocab_size, self.eos_id = "bytes", 257, 256
            return
        from tokenizers import Tokenizer  # deferred: only when a tokenizer is named

        if not Path(tokenizer).is_file():
            raise DataError(f"--tokenizer {tokenizer}: no such file")
        try:
            self.tokenizer = Tokenizer.from_file(tokenizer)
        except Exception as err:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"--tokenizer {tokenizer}: not a tokenizers file ({err})") from None
        self.name, self.vocab_size = str(Path(tokenizer).resolve()), self.tokenizer.get_vocab_size()
        names = [eos_token] if eos_token else [t for t in EOS_CANDIDATES if self.tokenizer.token_to_id(t) is not None]
        if not names or self.tokenizer.token_to_id(names[0]) is None:
            raise DataError(
                f"--tokenizer {tokenizer}: "
                + (
                    f"--eos-token {eos_token!r} is not in its vocabulary"
                    if eos_token
                    else f"none of {' '.join(EOS_CANDIDATES)} is in its vocabulary; "
                    "name the end-of-document token with --eos-token"
                )
            )
        self.eos_id = self.tokenizer.token_to_id(names[0])

    def chunks(self, paths: list[Path]):
        """Yields id arrays: all documents of ``paths`` in order, each followed by EOS."""
        eos = np.array([self.eos_id], np.int64)
        if self.tokenizer is None:
            for path in paths:
                with open(path, "rb") as f:
                    while block := f.read(PIECE_BYTES):
                        yield np.frombuffer(block, np.uint8)
                yield eos
            return
        batch, size = [], 0
        for path in paths:
            for text, last in _text_pieces(path):
                batch.append((text, last))
                size += len(text)
                if size >= BATCH_BYTES:
                    yield from self._encode(batch, eos)
                    batch, size = [], 0
        yield from self._encode(batch, eos)

    def _encode(self, batch, eos):
        encodings = self.tokenizer.encode_batch([text for text, _ in batch], add_special_tokens=False)
        for (_, last), encoding in zip(batch, encodings):
            yield np.asarray(encoding.ids, np.int64)
            if last:
                yield eos


def _text_pieces(path: Path):
    """(text, is_last_piece) of one UTF-8 document, cut after newlines that start a non-space line."""

    def decode(raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {done + err.start}); try --bytes") from None

    carry, done = b"", 0
    with open(path, "rb") as f:
        while block := f.read(PIECE_BYTES):
            carry += block
            cut = len(carry) - 1
            while (cut := carry.rfind(b"\n", 0, cut)) >= 0 and carry[cut + 1 : cut + 2] in b" \t\r\n":
                pass
            if cut >= 0:
                yield decode(carry[: cut + 1]), False
                carry, done = carry[cut + 1 :], done + cut + 1
    yield decode(carry), True


def _write_ids(chunks, dtype: str, raw: Path) -> int:
    """Appends every chunk to ``raw`` as ``dtype``; returns the number of ids written."""
    count = 0
    with open(raw, "wb") as f:
        for chunk in chunks:
            f.write(chunk.astype(dtype).tobytes())
            count += len(chunk)
    return count


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


def _plan(args) -> list[tuple[Path, list[Path]]]:
    """[(output file, its documents)]: OUT, and OUT.eval.* when --eval-fraction is set."""
    out = Path(args.out)
    if out.suffix not in (".bin", ".npy"):
        raise DataError(f"--out {out}: name a .bin or .npy file")
    if not out.parent.is_dir():
        raise DataError(f"--out {out}: directory {out.parent} does not exist")
    inputs = [Path(p) for p in args.inputs]
    for path in inputs:
        if not path.is_file():
            raise DataError(f"{path}: no such input file")
    if args.eval_fraction == 0:
        return [(out, inputs)]
    if not 0 < args.eval_fraction < 1 or len(inputs) < 2:
        raise DataError(
            f"--eval-fraction {args.eval_fraction}: needs 0 < F < 1 and at least two input files "
            f"(got {len(inputs)}), to hold out whole documents"
        )
    n_eval = min(len(inputs) - 1, max(1, int(len(inputs) * args.eval_fraction)))
    return [(out, inputs[:-n_eval]), (out.with_suffix(".eval" + out.suffix), inputs[-n_eval:])]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write(out: Path, docs: list[Path], encoder: _Encoder, dtype: str, temps: dict[Path, Path]) -> dict:
    """Writes ``out`` and its sidecar to temporary files (registered in ``temps``); returns the sidecar."""
    for final in [out, out.with_suffix(".json")] + ([out.with_suffix(".raw")] if out.suffix == ".npy" else []):
        fd, name = tempfile.mkstemp(dir=out.parent, prefix=f".{final.name}.", suffix=".tmp")
        os.close(fd)
        os.chmod(name, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        temps[final] = Path(name)
    raw = temps[out] if out.suffix == ".bin" else temps[out.with_suffix(".raw")]
    count = _write_ids(encoder.chunks(docs), dtype, raw)
    if out.suffix == ".npy":
        _to_npy(raw, temps[out], dtype, count)
    meta = {
        "vocab_size": encoder.vocab_size,
        "eos_id": encoder.eos_id,
        "dtype": dtype,
        "tokenizer": encoder.name,
        "documents": len(docs),
        "tokens": count,
    }
    temps[out.with_suffix(".json")].write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def run(args) -> int:
    plan = _plan(args)
    if args.eos_token and not args.tokenizer:
        raise DataError("--eos-token goes with --tokenizer; --bytes always uses EOS = 256")
    finals = [p for out, _ in plan for p in (out, out.with_suffix(".json"))]
    for path in finals:
        if path.exists():
            raise DataError(f"--out: {path} already exists; not overwritten (remove it or choose another --out)")
    encoder = _Encoder(args.tokenizer, args.eos_token)
    dtype = "uint16" if encoder.vocab_size <= 65536 else "uint32"
    temps: dict[Path, Path] = {}
    published: list[Path] = []
    try:
        metas = [_write(out, docs, encoder, dtype, temps) for out, docs in plan]
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
    for (out, _), meta in zip(plan, metas):
        print(
            f"wrote {out}: {meta['documents']} documents, {meta['tokens']:,} tokens ({dtype}), "
            f"vocab {encoder.vocab_size}, EOS id {encoder.eos_id}"
        )
    hint = f"--set data.source=files --set data.path={plan[0][0]}"
    hint += f" --set data.eval_path={plan[1][0]}" if len(plan) > 1 else ""
    hint += " --set data.dtype=uint32" if dtype == "uint32" and plan[0][0].suffix == ".bin" else ""
    hint += f" --set model.vocab_size={encoder.vocab_size}" if encoder.vocab_size != 256 else ""
    print(f"train on it with: {hint}")
    return 0
