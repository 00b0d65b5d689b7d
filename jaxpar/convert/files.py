"""A Hugging Face checkpoint folder on disk: config.json and safetensors files (one, or several with a
``model.safetensors.index.json``), read a box at a time; and the writer for exports.

Safetensors only: nothing here unpickles, so a folder holding only ``*.bin``/``*.pt`` is refused. A
quantized checkpoint (``quantization_config``) is read dequantized (``jaxpar.convert.quantized``). Every
file's header is checked against its size before anything is read (a truncated download names its
file), and every tensor a conversion needs is checked for presence and shape before the first read.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxpar.convert.quantized import SCALE, check_tensors, quantization
from jaxpar.errors import ConvertError  # noqa: F401  (re-exported)

INDEX = "model.safetensors.index.json"
RAW = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}  # read from the bytes


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.is_dir():
        raise ConvertError(f"{folder}: not a directory")
    if not path.is_file():
        raise ConvertError(f"{path}: missing (a Hugging Face model folder has config.json)")
    config = _json(path)
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: holds a JSON {type(config).__name__}, not an object of config fields")
    return config


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConvertError(f"{path}: not valid JSON ({e})") from None


def _header(path: Path) -> dict:
    """The safetensors header, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ConvertError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        n = struct.unpack("<Q", raw)[0]
        if 8 + n > size:
            raise ConvertError(f"{path}: truncated safetensors file (header of {n} bytes, file of {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConvertError(f"{path}: not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    if not all(
        isinstance(info, dict) and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
        for info in header.values()
    ):
        raise ConvertError(f"{path}: not a safetensors file (a header entry has no data_offsets pair)")
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + n + end > size:
        raise ConvertError(
            f"{path}: truncated safetensors file: its tensors need {8 + n + end} bytes, the file has {size}"
        )
    return header


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A Hugging Face model folder (config.json beside safetensors files), not a jaxpar checkpoint."""
    path = Path(path)
    return (
        (path / "config.json").is_file()
        and not (path / "checkpoints").is_dir()
        and any(p.suffix == ".safetensors" for p in path.iterdir())
    )


class HFFolder:
    """The tensors of a Hugging Face folder: ``shape(name)``, ``read(name, box)`` (a tuple of slices)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.config = read_config(self.folder)
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            others = sorted(p.name for p in self.folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
            raise ConvertError(
                f"{self.folder}: no *.safetensors files"
                + (
                    f" (found {', '.join(others)}: pickle formats are never loaded; convert them to safetensors)"
                    if others
                    else ""
                )
            )
        index = self.folder / INDEX
        self.where: dict[str, Path] = {}
        self.info: dict[str, dict] = {}
        if index.is_file():
            mapping = _json(index)
            mapping = mapping.get("weight_map", {}) if isinstance(mapping, dict) else None
            if not isinstance(mapping, dict):
                raise ConvertError(f"{index}: its weight_map is not an object (tensor name -> file)")
            for name, file in mapping.items():
                self.where[name] = self.folder / file
            for file in sorted(set(self.where.values())):
                if not file.is_file():
                    raise ConvertError(f"{index}: lists {file.name}, which is missing")
        for file in files:
            for name, info in _header(file).items():
                if self.where.setdefault(name, file) == file:
                    self.info[name] = info
        missing = sorted(n for n in self.where if n not in self.info)
        if missing:
            raise ConvertError(f"{index}: {missing[0]} is listed in {self.where[missing[0]].name} but not there")
        self._open: dict[Path, object] = {}
        self._data_start: dict[Path, int] = {}
        self.quant = quantization(self.config, str(self.folder / "config.json"))
        dtypes = {n: info["dtype"] for n, info in self.info.items()}
        if self.quant is not None:
            check_tensors(self.quant, dtypes, {n: self.shape(n) for n in self.info}, str(self.folder))
        elif any(d in RAW for d in dtypes.values()):
            name = next(n for n, d in dtypes.items() if d in RAW)
            raise ConvertError(f"{self.folder}: {name} is {dtypes[name]}, and config.json has no quantization_config")

    def names(self) -> set[str]:
        """The model's tensors (a quantized checkpoint's scales are part of their weights)."""
        return {n for n in self.info if self.quant is None or not n.endswith(SCALE)}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.info[name]["shape"])

    def dtype(self, name: str) -> str:
        """As stored; a block-FP8 weight reads as float32 (its dequantized values)."""
        scaled = self.quant is not None and name + SCALE in self.info
        return "F32" if scaled else self.info[name]["dtype"]

    def read(self, name: str, box: tuple[slice, ...]) -> np.ndarray:
        """A box of tensor ``name`` (a block-FP8 weight: dequantized, ``jaxpar.convert.quantized``)."""
        if self.quant is not None and name + SCALE in self.info:
            shape = self.shape(name)
            scale = self._stored(name + SCALE, self.quant.scale_box(box, shape))
            return self.quant.dequantize(self._stored(name, box), scale, box, shape)
        return self._stored(name, box)

    def _stored(self, name: str, box: tuple[slice, ...]) -> np.ndarray:
        dtype = self.info[name]["dtype"]
        if dtype in RAW:  # float8: safetensors' numpy reader has no such dtype; read its bytes in place
            return self._raw(name, RAW[dtype])[box]
        file = self.where[name]
        if file not in self._open:
            self._open[file] = safe_open(str(file), framework="numpy")
        return self._open[file].get_slice(name)[box]

    def _raw(self, name: str, dtype) -> np.ndarray:
        """Tensor ``name`` mapped from its file (read lazily, a box at a time), as ``dtype``."""
        file, info = self.where[name], self.info[name]
        if file not in self._data_start:  # where the file's tensor bytes begin, after its header
            with open(file, "rb") as f:
                self._data_start[file] = 8 + struct.unpack("<Q", f.read(8))[0]
        start = self._data_start[file] + info["data_offsets"][0]
        count = info["data_offsets"][1] - info["data_offsets"][0]
        return np.memmap(file, np.uint8, "r", offset=start, shape=(count,)).view(dtype).reshape(info["shape"])

    def close(self) -> None:
        self._open.clear()


class ShardWriter:
    """Writes tensors into ``model-0000i-of-0000n.safetensors`` files of at most ``max_shard_bytes``
    (one tensor past the limit starts the next file) and the index, inside a temporary folder that
    ``commit`` renames to ``out``; ``out`` must not exist, so nothing is overwritten."""

    def __init__(self, out: str | os.PathLike, *, max_shard_bytes: int = 2 << 30):
        self.out = Path(out)
        if self.out.exists():
            raise ConvertError(f"{self.out}: exists; the export writes a new folder and never overwrites")
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", dir=self.out.parent))
        self.max = max_shard_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self.pending and sum(a.nbytes for a in self.pending.values()) + array.nbytes > self.max:
            self._flush()
        self.pending[name] = np.ascontiguousarray(array)
        self.total += array.nbytes

    def _flush(self) -> None:
        save_file(self.pending, str(self.tmp / f"part-{len(self.files)}.safetensors"), metadata={"format": "pt"})
        self.files.append(sorted(self.pending))
        self.pending = {}

    def commit(self, config: dict, extra_files: dict[str, str] | None = None) -> Path:
        if self.pending:
            self._flush()
        n = len(self.files)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for i, (tensors, final) in enumerate(zip(self.files, names)):
            os.rename(self.tmp / f"part-{i}.safetensors", self.tmp / final)
            weight_map |= {t: final for t in tensors}
        if n > 1:
            (self.tmp / INDEX).write_text(
                json.dumps(
                    {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2
                )
            )
        (self.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (self.tmp / name).write_text(text)
        os.rename(self.tmp, self.out)
        return self.out

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
