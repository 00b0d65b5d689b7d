"""Documents for ``jaxpar prepare``: plain text files, and records of text or chat read from jsonl,
parquet and Hugging Face ``datasets``.

Sources, by what the input is:

* ``*.txt`` (any other file): the whole file is one text document (read in pieces by ``prepare``);
* ``*.jsonl``, ``*.jsonl.gz``, ``*.jsonl.zst``: one JSON object per line;
* ``*.parquet``: one record per row (pyarrow, read in batches of the one column);
* a folder written by ``datasets.Dataset.save_to_disk`` (``load_from_disk``; a ``DatasetDict`` gives
  its ``train`` split);
* with ``reader="datasets"``, jsonl and parquet files are read through ``datasets.load_dataset`` instead,
  ``streaming=True`` or not (its cache goes to a temporary folder, removed afterwards).

The record's field is ``text`` (a non-empty string) or ``messages`` (a non-empty list of
``{"role", "content"}`` with a known role and string content). A bad record (not JSON, not an object,
invalid UTF-8, the field missing, empty, of the wrong type, an unknown role) is refused with its file and
line (row), or, with ``skip_bad``, skipped and counted by reason. Nothing is downloaded: ``datasets``
runs offline.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import itertools
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from jaxpar.config import Choice
from jaxpar.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_ROWS = 4096  # rows per batch read from a parquet file
ROLES = ("system", "developer", "user", "assistant", "tool")


class Field(Choice):
    TEXT = "text"
    MESSAGES = "messages"
    PREFERENCE = "preference"  # a record's prompt, chosen and rejected: texts, or chats


PAIR = ("prompt", "chosen", "rejected")  # the fields of a preference record


class Reader(Choice):
    NATIVE = "native"  # jaxpar's readers (file and line in every refusal)
    DATASETS = "datasets"  # datasets.load_dataset, in memory-mapped arrow tables
    STREAMING = "streaming"  # datasets.load_dataset(streaming=True)


@dataclasses.dataclass(frozen=True)
class Document:
    where: str  # "file:line", "file row n", or the text file itself
    text: str | None = None  # a text record
    messages: list | None = None  # a chat record
    pair: tuple | None = None  # a preference record: (prompt, chosen, rejected), three texts or three chats
    path: Path | None = None  # a whole text file, read in pieces by the caller


class BadRecord(DataError):
    def __init__(self, where: str, reason: str, detail: str = ""):
        super().__init__(f"{where}: {reason}{detail}")
        self.reason = reason


class Source:
    """One input: ``count()`` records; ``records()`` yields (where, record), the record a ``BadRecord``
    where it could not even be read (``document`` raises it)."""

    def __init__(self, path: Path):
        self.path = path

    def count(self) -> int:
        return sum(1 for _ in self.records())

    def records(self) -> Iterator[tuple[str, object]]:
        raise NotImplementedError


class TextFile(Source):
    def count(self) -> int:
        return 1

    def records(self):
        yield str(self.path), None


class JsonLines(Source):
    def _open(self):
        name = self.path.name
        if name.endswith(".gz"):
            return gzip.open(self.path, "rb")
        if name.endswith(".zst"):
            import zstandard  # deferred: only for .zst files

            return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(self.path, "rb"), closefd=True))
        return open(self.path, "rb")

    def records(self):
        try:
            with self._open() as f:
                for line_no, raw in enumerate(f, 1):
                    where = f"{self.path}:{line_no}"
                    try:
                        yield where, _json_record(raw, where)
                    except BadRecord as bad:
                        yield where, bad
        except (OSError, EOFError) as err:  # a corrupt .gz / .zst stream
            raise DataError(f"{self.path}: cannot be read as {self.path.suffix} ({err})") from None


class Parquet(Source):
    def __init__(self, path: Path, field: str):
        super().__init__(path)
        import pyarrow.parquet as pq  # deferred: only for parquet inputs

        try:
            self.file = pq.ParquetFile(path)
        except Exception as err:  # pyarrow raises ArrowInvalid / OSError subclasses
            raise DataError(f"{path}: not a parquet file ({err})") from None
        names = self.file.schema_arrow.names
        self.columns = _columns(field)
        for column in self.columns:
            if column not in names:
                raise DataError(f"{path}: has no column {column!r} (columns: {', '.join(names)}); choose --field")

    def count(self) -> int:
        return self.file.metadata.num_rows

    def records(self):
        row = 0
        for batch in self.file.iter_batches(batch_size=PARQUET_ROWS, columns=self.columns):
            for record in batch.to_pylist():
                row += 1
                yield f"{self.path} row {row}", record


def _columns(field: str) -> list[str]:
    """The columns a record's ``field`` is read from."""
    return list(PAIR) if field == Field.PREFERENCE else [field]


class Datasets(Source):
    """A ``save_to_disk`` folder, or jsonl / parquet files through ``load_dataset``."""

    def __init__(self, path: Path, field: str, reader: str):
        super().__init__(path)
        self.field, self.reader = field, reader

    def _dataset(self, cache: str):
        import datasets  # deferred: only for these inputs

        datasets.disable_progress_bars()
        try:
            if self.path.is_dir():
                found = datasets.load_from_disk(str(self.path))
                if isinstance(found, datasets.DatasetDict):
                    if "train" not in found:
                        raise DataError(f"{self.path}: a DatasetDict without a 'train' split ({', '.join(found)})")
                    found = found["train"]
                return found
            builder = "parquet" if self.path.suffix == ".parquet" else "json"
            streaming = self.reader == Reader.STREAMING
            return datasets.load_dataset(
                builder, data_files=[str(self.path)], split="train", streaming=streaming, cache_dir=cache
            )
        except DataError:
            raise
        except Exception as err:  # datasets raises many types; the message says what it met
            raise DataError(f"{self.path}: datasets could not read it ({type(err).__name__}: {err})") from None

    def count(self) -> int:
        if self.reader == Reader.STREAMING:
            return super().count()
        with tempfile.TemporaryDirectory(prefix="jaxpar-datasets-") as cache:
            return len(self._dataset(cache))

    def records(self):
        with tempfile.TemporaryDirectory(prefix="jaxpar-datasets-") as cache:
            dataset = self._dataset(cache)
            names = dataset.column_names or []
            for column in _columns(self.field) if names else ():
                if column not in names:
                    raise DataError(f"{self.path}: has no column {column!r} (columns: {', '.join(names)})")
            for row, record in enumerate(dataset, 1):
                yield f"{self.path} row {row}", record


def open_sources(inputs: list[str], *, field: str, reader: str = Reader.NATIVE) -> list[Source]:
    """The sources of ``inputs`` (checked to exist and be readable), in order."""
    field = Field.parse(field, field="--field").value
    reader = Reader.parse(reader, field="--reader").value
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # nothing downloads
    out = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            if not any((path / f).is_file() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
                raise DataError(f"{path}: a folder, but not one that datasets' save_to_disk wrote")
            out.append(Datasets(path, field, reader))
        elif not path.is_file():
            raise DataError(f"{path}: no such input file")
        elif name.endswith(JSONL_SUFFIXES) or path.suffix == ".parquet":
            if reader != Reader.NATIVE:
                out.append(Datasets(path, field, reader))
            else:
                out.append(Parquet(path, field) if path.suffix == ".parquet" else JsonLines(path))
        elif field != Field.TEXT:
            raise DataError(f"{path}: a plain text file has no {field!r} records; they come as jsonl or parquet")
        else:
            out.append(TextFile(path))
    return out


def _json_record(raw: bytes, where: str):
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadRecord(where, "invalid UTF-8", f" ({err.reason} at byte {err.start})") from None
    if not line.strip():
        raise BadRecord(where, "empty record")
    try:
        return json.loads(line)
    except ValueError as err:
        raise BadRecord(where, "not JSON", f" ({err})") from None


def document(where: str, record, field: str, path: Path | None = None) -> Document:
    """The ``field`` of one record as a ``Document``; ``BadRecord`` says what is wrong with it."""
    if path is not None:
        return Document(where, path=path)
    if isinstance(record, BadRecord):
        raise record
    if not isinstance(record, dict):
        raise BadRecord(where, "not a JSON object", f" (a {type(record).__name__})")
    if field == Field.PREFERENCE:
        return _preference(where, record)
    if record.get(field) is None:
        raise BadRecord(where, f"missing field {field!r}", f" (it has {', '.join(map(repr, record)) or 'none'})")
    value = record[field]
    if field == Field.TEXT:
        if not isinstance(value, str):
            raise BadRecord(where, "'text' is not a string", f" (a {type(value).__name__})")
        if not value:
            raise BadRecord(where, "empty record")
        return Document(where, text=value)
    return Document(where, messages=_messages(where, value, field))


def _messages(where: str, value, field: str) -> list[dict]:
    if not isinstance(value, list):
        raise BadRecord(where, f"{field!r} is not a list", f" (a {type(value).__name__})")
    if not value:
        raise BadRecord(where, "empty record")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("content"), str)):
            raise BadRecord(where, "a message is not {role, content}", f" (message {i}: {str(message)[:60]})")
        if message.get("role") not in ROLES:
            known = ", ".join(ROLES)
            raise BadRecord(where, "unknown role", f" (message {i}: {message.get('role')!r}; known: {known})")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _preference(where: str, record: dict) -> Document:
    """A preference record: ``prompt``, ``chosen`` and ``rejected``, all three strings, or all three chats
    (the completions: the assistant's turns that follow the prompt's messages)."""
    missing = [k for k in PAIR if record.get(k) is None]
    if missing:
        raise BadRecord(where, f"missing field {missing[0]!r}", f" (it has {', '.join(map(repr, record)) or 'none'})")
    values = [record[k] for k in PAIR]
    if all(isinstance(v, str) for v in values):
        if not all(values[1:]):
            raise BadRecord(where, "empty record", " (an empty completion)")
        return Document(where, pair=tuple(values))
    if not all(isinstance(v, list) for v in values):
        kinds = ", ".join(f"{k}: {type(v).__name__}" for k, v in zip(PAIR, values))
        raise BadRecord(where, "prompt, chosen and rejected are not all strings or all chats", f" ({kinds})")
    return Document(where, pair=tuple(_messages(where, v, k) for k, v in zip(PAIR, values)))


def documents(
    sources: list[Source], field: str, *, skip_bad: bool, skipped: Counter, start: int = 0, stop: int | None = None
) -> Iterator[Document]:
    """The documents of records ``start`` to ``stop`` (counted over all sources in order, bad ones
    included); bad records raise, or are skipped and counted in ``skipped`` (by reason) when ``skip_bad``."""
    stream = ((source, where, record) for source in sources for where, record in source.records())
    for source, where, record in itertools.islice(stream, start, stop):
        try:
            yield document(where, record, field, source.path if isinstance(source, TextFile) else None)
        except BadRecord as bad:
            if not skip_bad:
                raise
            skipped[bad.reason] += 1
