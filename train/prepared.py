"""``jaxpar train --data INPUT...``: records tokenized on the fly by ``jaxpar prepare``, once, into a cache.

The inputs (text, jsonl, parquet or ``datasets`` folders: ``jaxpar.corpus``) are prepared with the run's
tokenizer (``--tokenizer``, or ``tokenizer.json`` of the ``--init-from`` folder) into
``$JAXPAR_CACHE/prepared/<digest>/tokens.bin`` (default ``~/.cache/jaxpar``), where the digest covers
every input's path, size and modification time, the tokenizer and its chat template, the field, and
``--skip-bad`` (bad records skipped and counted: in the cache's sidecar and the run's first metrics
record, ``data_skipped``).
The same command run again (a resume, or another run on the same data) reads the cache; an input that
changed is prepared anew. The run then trains on the files as ``data.source=files`` with
``data.pack=documents`` (``--set`` may change either). Nothing is written before the config is checked,
and nothing in the run directory: a refused run leaves the disk as it was but for a complete cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from jaxpar.corpus import JSONL_SUFFIXES, PAIR, Field
from jaxpar.errors import ConfigError, LaunchError
from jaxpar.prepare import outputs, prepare

CACHE_ENV = "JAXPAR_CACHE"
TEMPLATE_FILES = ("chat_template.jinja", "tokenizer_config.json")  # beside the tokenizer: part of the digest


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "jaxpar") / "prepared"


def tokenizer_of(tokenizer: str | None, init_from: str | None) -> str:
    """``--tokenizer``, or ``tokenizer.json`` in the ``--init-from`` folder."""
    if tokenizer:
        if not Path(tokenizer).is_file():
            raise ConfigError(f"--tokenizer {tokenizer}: no such file")
        return tokenizer
    beside = Path(init_from) / "tokenizer.json" if init_from else None
    if beside is None or not beside.is_file():
        raise ConfigError("--data: name the tokenizer (--tokenizer FILE), or --init-from a folder with tokenizer.json")
    return str(beside)


def _field_in(names) -> str:
    """The field of records with these keys (or columns): preference pairs, chats, or text."""
    if all(k in names for k in PAIR):
        return Field.PREFERENCE.value
    return Field.MESSAGES.value if "messages" in names else Field.TEXT.value


def field_of(inputs: list[str], field: str | None) -> str:
    """``--data-field``, or what the first jsonl record or parquet schema holds: ``preference`` (prompt,
    chosen, rejected), ``messages``, else ``text``."""
    if field:
        return Field.parse(field, field="--data-field").value
    for name in inputs:
        path = Path(name)
        if name.endswith(JSONL_SUFFIXES) and path.suffix == ".jsonl" and path.is_file():
            with open(path, "rb") as f:
                first = f.readline()
            try:
                record = json.loads(first)
            except ValueError:
                continue
            return _field_in(record if isinstance(record, dict) else {})
        if path.suffix == ".parquet" and path.is_file():
            import pyarrow.parquet as pq  # deferred: only for parquet inputs

            return _field_in(pq.read_schema(path).names)
    return Field.TEXT.value


def cached_path(inputs: list[str], tokenizer: str, field: str, skip_bad: bool = False) -> Path:
    """Where the prepared ids of these inputs live in the cache (prepared or not yet); ``skip_bad``: bad
    records skipped (and counted) rather than refused, a preparation of its own."""
    h = hashlib.sha256()
    for name in inputs:
        path = Path(name)
        if not path.exists():
            raise ConfigError(f"--data {name}: no such input")
        stat = path.stat()
        h.update(json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns]).encode())
    folder = Path(tokenizer).parent
    for name in (Path(tokenizer).name, *TEMPLATE_FILES):
        if (folder / name).is_file():
            h.update(hashlib.sha256((folder / name).read_bytes()).digest())
    h.update(field.encode() + (b":skip-bad" if skip_bad else b""))
    return cache_root() / h.hexdigest()[:24] / "tokens.bin"


def ensure_prepared(
    inputs: list[str], tokenizer: str, field: str, out: Path, *, processes: int = 1, skip_bad: bool = False
) -> bool:
    """Prepares ``inputs`` into ``out`` unless the cache holds all its files; returns whether it did."""
    files = outputs(out, field)
    if all(p.is_file() for p in files):
        return False
    if processes > 1:
        raise LaunchError(
            f"--data with {processes} processes: fill the cache first, on one process (or prepare the data with "
            "`jaxpar prepare` and train with --set data.path=...)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    for path in files:  # an interrupted earlier preparation: its files are ours to replace
        path.unlink(missing_ok=True)
    prepare(inputs, out, tokenizer=tokenizer, field=field, skip_bad=skip_bad)
    return True
