"""Token files (``data.source=files``, written by ``jaxpar prepare``): ``.npy`` or raw ``.bin`` ids read
as one memory-mapped stream, with the companions ``prepare`` writes beside each file: the documents'
offsets (``X.docs.npy``), and for chat data the loss mask (``X.mask.bin|npy``, one uint8 per token)."""

from __future__ import annotations

import functools
import glob
import json
from pathlib import Path

import numpy as np

from jaxpar.errors import DataError

NPY_DTYPES = ("uint16", "uint32", "int32")
COMPANIONS = (".docs.npy", ".mask.bin", ".mask.npy")  # written beside a token file by `jaxpar prepare`
SCAN_CHUNK = 1 << 22  # tokens per chunk when scanning files for bad ids


def resolve_files(spec: str, field: str = "data.path") -> list[Path]:
    """The token files named by ``spec``: a file, a directory (its *.npy and *.bin, sorted) or a glob."""
    if not spec:
        raise DataError(f"{field} is empty: name token files (see `jaxpar prepare`) or use data.source=markov")
    path = Path(spec).expanduser()
    if any(c in spec for c in "*?["):
        found = [Path(p) for p in sorted(glob.glob(str(path)))]
    elif path.is_dir():
        found = sorted(p for p in path.iterdir() if p.is_file())
    elif path.exists():
        found = [path]
    else:
        raise DataError(f"{field}: {spec} does not exist")
    files = [p for p in found if p.suffix in (".npy", ".bin") and not p.name.endswith(COMPANIONS)]
    if not files:
        raise DataError(f"{field}: no .npy or .bin token files in {spec}")
    return files


def _open(path: Path, dtype: str) -> np.ndarray:
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as err:
            raise DataError(f"{path}: not a readable .npy file ({err})") from None
        if arr.ndim != 1 or arr.dtype.name not in NPY_DTYPES:
            raise DataError(
                f"{path}: holds a {arr.dtype.name} array of shape {arr.shape}; token files are 1-D "
                f"{', '.join(NPY_DTYPES)}"
            )
        return arr
    sidecar = path.with_suffix(".json")  # written by `jaxpar prepare`
    written = _sidecar(sidecar).get("dtype", dtype) if sidecar.exists() else dtype
    if written != dtype:
        raise DataError(f"data.dtype={dtype}, but {sidecar} says {path} holds {written}: --set data.dtype={written}")
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataError(
            f"{path}: {size} bytes is not a multiple of {itemsize} (data.dtype={dtype}): "
            f"wrong data.dtype or a truncated file"
        )
    return np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def _sidecar(path: Path) -> dict:
    """The JSON object `jaxpar prepare` writes beside a .bin file (vocabulary, EOS id, dtype)."""
    try:
        info = json.loads(path.read_text())
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise DataError(f"{path}: not valid JSON ({err}); it should be the sidecar `jaxpar prepare` wrote") from None
    if not isinstance(info, dict):
        raise DataError(f"{path}: holds a JSON {type(info).__name__}, not the object `jaxpar prepare` writes")
    return info


@functools.lru_cache(maxsize=256)
def _first_outside(path: str, size: int, mtime_ns: int, dtype: str, vocab_size: int) -> tuple[int, int] | None:
    """(position, id) of the first token outside [0, vocab_size), or None; cached per version of the file."""
    arr = _open(Path(path), dtype)
    for start in range(0, len(arr), SCAN_CHUNK):
        chunk = arr[start : start + SCAN_CHUNK]
        if chunk.min() < 0 or chunk.max() >= vocab_size:
            pos = start + int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
            return pos, int(arr[pos])
    return None


def skipped_records(paths: list[Path]) -> dict[str, int]:
    """The records ``jaxpar prepare --skip-bad`` skipped making these token files, by reason (from
    their sidecars; a file without one counts none)."""
    out: dict[str, int] = {}
    for path in paths:
        sidecar = path.with_suffix(".json")
        for why, n in (_sidecar(sidecar).get("skipped") or {}).items() if sidecar.exists() else ():
            out[why] = out.get(why, 0) + int(n)
    return out


class TokenFiles:
    """Several token files read as one stream of ``total`` tokens."""

    def __init__(self, paths: list[Path], dtype: str):
        self.paths, self.dtype = paths, dtype
        self.arrays = [_open(p, dtype) for p in paths]
        self.starts = np.cumsum([0] + [len(a) for a in self.arrays])
        self.total = int(self.starts[-1])

    def check(self, vocab_size: int) -> None:
        """Raise ``DataError`` naming file, id and position if any token is outside [0, vocab_size)."""
        for path in self.paths:
            stat = path.stat()
            bad = _first_outside(str(path.resolve()), stat.st_size, stat.st_mtime_ns, self.dtype, vocab_size)
            if bad:
                raise DataError(
                    f"{path}: token id {bad[1]} at position {bad[0]} is outside the vocabulary of the "
                    f"model (model.vocab_size={vocab_size}); set it to the tokenizer's vocab_size "
                    f"(in {path.with_suffix('.json').name} when written by `jaxpar prepare`)"
                )

    def read(self, start: int, stop: int) -> np.ndarray:
        return _read(self.arrays, self.starts, start, stop)

    def documents(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of every document in the stream, from each file's ``X.docs.npy``."""
        starts, lengths = [], []
        for path, arr, first in zip(self.paths, self.arrays, self.starts):
            offsets = _offsets(path, len(arr))
            starts.append(first + offsets[:-1])
            lengths.append(np.diff(offsets))
        return np.concatenate(starts), np.concatenate(lengths)

    def masks(self) -> list | None:
        """Each file's loss mask (ones where a file has none), or None when no file has one."""
        found = [_mask(path, len(arr)) for path, arr in zip(self.paths, self.arrays)]
        if all(m is None for m in found):
            return None
        return [np.ones(len(a), np.uint8) if m is None else m for m, a in zip(found, self.arrays)]

    def trained(self, masks: list, start: int, stop: int) -> np.ndarray:
        """The loss mask of tokens ``start`` to ``stop`` of the stream."""
        return _read(masks, self.starts, start, stop)


def _read(arrays, starts, start: int, stop: int) -> np.ndarray:
    out = np.empty(stop - start, np.int32)
    f = int(np.searchsorted(starts, start, side="right")) - 1
    pos = start
    while pos < stop:
        lo = pos - int(starts[f])
        hi = min(len(arrays[f]), stop - int(starts[f]))
        out[pos - start : pos - start + hi - lo] = arrays[f][lo:hi]
        pos, f = pos + hi - lo, f + 1
    return out


def _offsets(path: Path, tokens: int) -> np.ndarray:
    """The document offsets `jaxpar prepare` wrote beside ``path`` (starts, then the total), checked."""
    name = path.with_suffix(".docs.npy")
    if not name.exists():
        raise DataError(
            f"data.pack=documents: {path} has no {name.name} (the document offsets `jaxpar prepare` writes); "
            "prepare the data again, or use data.pack=stream"
        )
    try:
        offsets = np.load(name, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise DataError(f"{name}: not a readable .npy file ({err})") from None
    if (
        offsets.ndim != 1
        or len(offsets) < 2
        or offsets[0] != 0
        or offsets[-1] != tokens
        or (np.diff(offsets) < 0).any()
    ):
        raise DataError(f"{name}: not the offsets of {path}'s {tokens} tokens (0, rising, to {tokens})")
    return offsets.astype(np.int64)


def _mask(path: Path, tokens: int) -> np.ndarray | None:
    """The loss mask beside ``path`` (``X.mask.bin`` or ``X.mask.npy``), checked, or None."""
    name = path.with_suffix(".mask" + path.suffix)
    if not name.exists():
        return None
    if name.suffix == ".npy":
        mask = np.load(name, mmap_mode="r", allow_pickle=False)
    else:
        mask = np.memmap(name, dtype=np.uint8, mode="r") if name.stat().st_size else np.zeros(0, np.uint8)
    if mask.shape != (tokens,):
        raise DataError(f"{name}: {mask.shape} entries, but {path} holds {tokens} tokens (one mask entry each)")
    return mask


class WindowSource:
    """grain random-access source: windows ``first .. first+count-1`` of ``seq + 1`` tokens at stride ``seq``."""

    def __init__(self, files: TokenFiles, seq: int, first: int, count: int):
        self.files, self.seq, self.first, self.count = files, seq, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        start = (self.first + int(index)) * self.seq
        return self.files.read(start, start + self.seq + 1)
