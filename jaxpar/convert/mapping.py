"""Where each jaxpar parameter comes from in a Hugging Face checkpoint, and how to cut any shard of it
out of the HF tensors without reading the rest.

A parameter's dimensions carry labels. Three kinds are *stacking* labels, enumerated over HF tensors:
``L`` (layers: ``{l}`` in the HF name, plus an offset), ``E`` (experts: ``{e}``), and ``P`` (one HF tensor
per part, e.g. gate and up into one ``[D, 2, F]`` weight). Every other label names a dimension of the HF
tensor itself. HF's ``nn.Linear`` weights are [out, in] with heads merged into ``out``: a group such as
``("n", "h")`` says the HF dimension is the row-major merge of our ``n`` and ``h`` dimensions.

Cutting our shard (one slice per our dimension) out of an HF tensor: a merged HF dimension is read as
the contiguous range its first label's slice spans (times the product of the other labels' sizes),
reshaped, and sliced on the rest; a dimension where ours is longer than HF's (the padded vocabulary)
reads what exists and is zero-filled. So a shard reads at most its own bytes plus whole rows of the
merged dimension it cuts through.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

STACKING = ("L", "E", "P")


@dataclasses.dataclass(frozen=True)
class Source:
    """Our parameter = HF tensors ``names`` (a template per part, formatted with ``l`` and ``e``),
    with our dimensions labelled ``ours`` and the HF tensor's dimensions ``hf`` (a str, or a tuple of
    labels merged row-major). ``layer_offset`` shifts ``{l}`` (our stacks split the HF layer list)."""

    names: tuple[str, ...]
    ours: tuple[str, ...]
    hf: tuple[str | tuple[str, ...], ...]
    layer_offset: int = 0

    def hf_name(self, l: int = 0, e: int = 0, p: int = 0) -> str:
        return self.names[p].format(l=l + self.layer_offset, e=e)

    def all_hf_names(self, shape: Sequence[int]) -> list[str]:
        return [self.hf_name(**key) for key in self._keys(shape, [slice(None)] * len(shape))]

    def _keys(self, shape, index) -> list[dict]:
        """The (l, e, p) combinations an index of our array spans, in order."""
        ranges = {}
        for label, n, s in zip(self.ours, shape, index):
            if label in STACKING:
                ranges[label.lower()] = range(*s.indices(n))
        return [dict(zip(ranges, combo)) for combo in itertools.product(*ranges.values())]

    def hf_shape(self, shape: Sequence[int], hf_sizes: dict[str, int]) -> tuple[int, ...]:
        """The HF tensor's shape for our ``shape`` (``hf_sizes`` overrides a label's size: the vocab)."""
        size = {lab: hf_sizes.get(lab, n) for lab, n in zip(self.ours, shape)}
        return tuple(math.prod(size[x] for x in _group(g)) for g in self.hf)


def _group(g) -> tuple[str, ...]:
    return (g,) if isinstance(g, str) else tuple(g)


def read_shard(
    src: Source, shape: Sequence[int], index: Sequence[slice], read: Callable, hf_sizes: dict, dtype
) -> np.ndarray:
    """Our array's ``index`` (a tuple of slices over ``shape``), read from HF tensors.
    ``read(name, slices) -> np.ndarray`` reads a box of one HF tensor."""
    index = tuple(s if isinstance(s, slice) else slice(s, s + 1) for s in index)
    want = {lab: range(*s.indices(n)) for lab, n, s in zip(src.ours, shape, index)}
    size = {lab: n for lab, n in zip(src.ours, shape)}
    out = np.zeros([len(r) for r in want.values()], dtype)
    tensor_labels = [lab for lab in src.ours if lab not in STACKING]
    for key in src._keys(shape, index):
        piece = _read_piece(src, key, want, size, read, hf_sizes)  # labelled as flat HF groups
        at = tuple(key[lab.lower()] - want[lab].start if lab in STACKING else slice(None) for lab in src.ours)
        out[at] = piece.transpose([_flat_labels(src.hf).index(lab) for lab in tensor_labels])
    return out


def _flat_labels(hf) -> list[str]:
    return [lab for g in hf for lab in _group(g)]


def _read_piece(src: Source, key: dict, want: dict, size: dict, read: Callable, hf_sizes: dict) -> np.ndarray:
    """One HF tensor's part of the shard, with its dimensions split into our labels (HF order)."""
    boxes, split, after = [], [], []
    for g in src.hf:
        labels = _group(g)
        first, rest = labels[0], labels[1:]
        inner = math.prod(size[x] for x in rest)
        r = want[first]
        stop = min(r.stop, hf_sizes.get(first, size[first]))  # beyond HF's size: zeros
        boxes.append(slice(r.start * inner, max(r.start, stop) * inner))
        split += [max(stop - r.start, 0)] + [size[x] for x in rest]
        after += [slice(None)] + [slice(want[x].start, want[x].stop) for x in rest]
    piece = np.asarray(read(src.hf_name(**key), tuple(boxes))).reshape(split)[tuple(after)]
    pad = [(0, len(want[lab]) - n) for lab, n in zip(_flat_labels(src.hf), piece.shape)]
    return np.pad(piece, pad) if any(p for _, p in pad) else piece


def write_pieces(src: Source, array_at: Callable, shape: Sequence[int], hf_sizes: dict):
    """The HF tensors of one our parameter, one at a time: yields (name, np.ndarray in HF layout).
    ``array_at(index) -> np.ndarray`` fetches a slice of our array (e.g. one layer's, from the devices)."""
    tensor_labels = [lab for lab in src.ours if lab not in STACKING]
    flat = _flat_labels(src.hf)
    for key in src._keys(shape, [slice(None)] * len(shape)):
        at = tuple(key[lab.lower()] if lab in STACKING else slice(None) for lab in src.ours)
        x = np.asarray(array_at(at))  # [our tensor dims]
        x = x.transpose([tensor_labels.index(lab) for lab in flat])
        x = x[tuple(slice(0, hf_sizes.get(lab, n)) for lab, n in zip(flat, x.shape))]  # drop vocab padding
        yield src.hf_name(**key), x.reshape(src.hf_shape(shape, hf_sizes))
