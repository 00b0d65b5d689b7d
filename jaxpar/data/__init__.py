"""Training data: an embedded synthetic source and token files, read through grain.

Everything is a *record*: a window of ``seq + 1`` token ids, from which a batch row takes
``inputs = w[:-1]`` and ``targets = w[1:]``. Both sources give random access to records by index, so
grain shuffles, shards and checkpoints the pipeline by index alone (the iterator state is one integer).

* ``markov``: a random sparse first-order Markov chain over the model's vocabulary (``markov_chain``).
  Record ``i`` is generated on demand from ``(stream, i)``: there is nothing to download, and the best
  loss any model can reach is known exactly (``Loader.entropy_rate``, nats per token).
* ``files``: token files (``.npy`` or raw ``.bin``, written by ``jaxpar prepare``) read as one stream
  and cut into windows at stride ``seq``. Window j is ``tokens[j*seq : j*seq + seq + 1]``, so neighbours
  share one token and every token after the first is a target exactly once. This packs documents (the
  files separate them with EOS) with no padding. Files are memory-mapped; ``check`` scans them once, in
  chunks, for ids outside the model's vocabulary before any step runs.
* ``files`` with ``data.pack=documents``: rows of whole documents (``jaxpar.data.packing``), each with
  its ``positions``, ``segments`` and loss ``mask`` (the chat mask ``jaxpar prepare --field messages``
  writes); held out, and shuffled into rows, at document boundaries.

The pipeline (``make_loader``):

    source -> shuffle (train, files) -> repeat -> batch(global_batch / P) -> [p::P] -> inputs/targets
           -> to_iter_dataset(threads, prefetch)

Batching *before* taking every P-th batch gives process p of P the rows ``[p*b, (p+1)*b)`` of global
batch k, which is exactly the global batch k that a single process reads. ``to_global`` with the batch
axes laid out in process order (as ``jax.make_mesh`` does) therefore builds the same global array
whatever the number of processes. The saved position is the global batch index, so a run can resume on
another process count with the same ``--batch``.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import numpy as np

from jaxpar.config import Choice, check_choices
from jaxpar.data.files import COMPANIONS, TokenFiles, WindowSource, resolve_files, skipped_records
from jaxpar.data.markov import MarkovChain, MarkovSource, markov_chain
from jaxpar.data.packing import PackedRows, RowPlan, batch_of_rows, plan_pairs, plan_rows
from jaxpar.errors import DataError

__all__ = [  # what callers import from jaxpar.data
    "COMPANIONS",
    "DataConfig",
    "DataError",
    "DataSource",
    "Loader",
    "MarkovChain",
    "MarkovSource",
    "PackMode",
    "PackedRows",
    "RowPlan",
    "TokenDtype",
    "TokenFiles",
    "WindowSource",
    "batch_of_rows",
    "make_loader",
    "markov_chain",
    "plan_pairs",
    "plan_rows",
    "resolve_files",
    "to_global",
]


class DataSource(Choice):
    MARKOV = "markov"  # the embedded synthetic source
    FILES = "files"  # token files (jaxpar prepare)


class PackMode(Choice):
    """How token files become rows (``data.pack``)."""

    STREAM = "stream"  # windows of the token stream at stride seq, across documents (no masks)
    DOCUMENTS = "documents"  # whole documents per row, segments and loss masks (jaxpar.data.packing)
    PAIRS = "pairs"  # preference pairs (jaxpar prepare --field preference): chosen and rejected in one row


class TokenDtype(Choice):
    """Element type of raw .bin token files (.npy files carry their own)."""

    UINT16 = "uint16"
    UINT32 = "uint32"


SPLITS = ("train", "eval")
DOCUMENT_ORDER = 0x7061636B  # mixed into the loader seed for the order packed documents are placed in
MIXTURE_SEED = 1_000_003  # source i of a mixture shuffles with seed + i × this
ENDLESS = 2**62  # records a loader can yield: grain's repeat() makes len sys.maxsize, whose
# batch(1) length ceil(maxsize / 1.0) = 2**63 overflows len(); repeat finitely


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: DataSource = DataSource.MARKOV
    path: str = ""  # files: a file, a directory (all *.npy / *.bin inside, sorted) or a glob
    eval_path: str = ""  # held-out token files; "" -> hold out the last `eval_fraction` of windows of `path`
    eval_fraction: float = 0.01
    dtype: TokenDtype = TokenDtype.UINT16  # element type of raw .bin files (.npy carries its own)
    pack: PackMode = PackMode.STREAM  # files: windows of the stream, or rows of whole documents
    markov_branching: int = 8  # successors per state of the synthetic chain
    markov_seed: int = 0  # the chain itself (transition table); sample streams are derived from the loader seed
    shuffle: bool = True
    num_threads: int = 2  # grain read threads
    prefetch: int = 4  # grain prefetch buffer
    # a mixture: data.path names several sources, "A,B,...", each held out and shuffled on its own
    weights: str = ""  # each source's share of the rows, e.g. "3,1" ("": by size, as one stream would)
    epochs: str = ""  # or: passes over each source per pass over the mixture, e.g. "1,4" (shares ∝ epochs × size)

    def __post_init__(self):
        check_choices(self, "data")
        _mixture_numbers(self)  # (defined below)
        if not 0 < self.eval_fraction < 1:
            raise DataError(f"data.eval_fraction={self.eval_fraction}: must be between 0 and 1 (exclusive)")
        if self.markov_branching < 1:
            raise DataError(f"data.markov_branching={self.markov_branching}: must be ≥ 1")
        for name in ("num_threads", "prefetch", "markov_seed"):
            if getattr(self, name) < 0:
                raise DataError(f"data.{name}={getattr(self, name)}: must be ≥ 0")


def _split_files(cfg: DataConfig, *, vocab_size: int, split: str) -> tuple[TokenFiles, bool, str]:
    """(the files of ``split``, whether it is held out of ``data.path``, the field that names them):
    ``data.eval_path``'s own files, or ``data.path``'s to be split into a train head and an eval tail."""
    held_out = not cfg.eval_path
    field = "data.path" if split == "train" or held_out else "data.eval_path"
    files = TokenFiles(resolve_files(cfg.path if field == "data.path" else cfg.eval_path, field), cfg.dtype)
    if not held_out:  # held-out files must not be trained on
        train = {p.resolve() for p in resolve_files(cfg.path, "data.path")}
        shared = sorted(train & {p.resolve() for p in resolve_files(cfg.eval_path, "data.eval_path")})
        if shared:
            raise DataError(f"data.eval_path and data.path share {', '.join(map(str, shared))}")
    files.check(vocab_size)
    return files, held_out, field


def _file_windows(cfg: DataConfig, *, vocab_size: int, seq: int, split: str) -> WindowSource:
    """The windows of ``split``: all of its own files, or ``data.path`` split into a train head and an eval tail."""
    files, held_out, field = _split_files(cfg, vocab_size=vocab_size, split=split)
    if files.masks() is not None:
        raise DataError(
            f"{field}: the files carry loss masks (chat data from `jaxpar prepare --field messages`); windows of "
            "the stream would train every token: set data.pack=documents"
        )
    parts = 2 if held_out else 1  # a held-out split needs a train and an eval window
    if files.total < 1 + parts * seq:
        names = ", ".join(str(p) for p in files.paths)
        most = (files.total - 1) // parts
        raise DataError(
            f"{field}: {names} hold {files.total} tokens, too few for {parts} window(s) of --seq {seq} "
            f"(needs {1 + parts * seq} tokens)" + (f"; use --seq {most} or less" if most > 0 else "")
        )
    windows = (files.total - 1) // seq
    if not held_out:
        return WindowSource(files, seq, 0, windows)
    n_eval = max(1, int(windows * cfg.eval_fraction))
    if split == "train":
        return WindowSource(files, seq, 0, windows - n_eval)
    return WindowSource(files, seq, windows - n_eval, n_eval)


def _packed_rows(cfg: DataConfig, *, vocab_size: int, seq: int, seed: int, split: str, reference=None):
    """(rows of whole documents of ``split``, description, identity): held out at document boundaries
    (pair boundaries for ``data.pack=pairs``), the training documents placed in a seeded order
    (``data.shuffle``). ``reference(start, stop)``: the pairs' reference log-probs per token."""
    files, held_out, field = _split_files(cfg, vocab_size=vocab_size, split=split)
    starts, lengths = files.documents()
    pairs = cfg.pack == PackMode.PAIRS
    unit = _check_pairs(files, field, len(starts)) if pairs else 1  # documents per unit (a pair: 2)
    units = len(starts) // unit
    keep = np.arange(units)
    if held_out:
        if units < 2:
            raise DataError(
                f"{field}: {units} {'pair' if pairs else 'document'}(s); holding out data.eval_fraction of them "
                "needs at least two (or name held-out files in data.eval_path)"
            )
        n_eval = min(units - 1, max(1, int(units * cfg.eval_fraction)))
        keep = keep[: units - n_eval] if split == "train" else keep[units - n_eval :]
    if split == "train" and cfg.shuffle:
        keep = keep[np.random.default_rng([seed, DOCUMENT_ORDER]).permutation(len(keep))]
    docs = (unit * keep[:, None] + np.arange(unit)).reshape(-1)
    starts, lengths = starts[docs], lengths[docs]
    plan, dropped = plan_pairs(starts, lengths, seq + 1) if pairs else (plan_rows(starts, lengths, seq + 1), 0)
    masks = files.masks()
    trained = None if masks is None else functools.partial(files.trained, masks)
    what = f"{len(keep):,} pairs" + (f" ({dropped:,} longer than a row, dropped)" if dropped else "")
    text = (
        f"files: {len(files.paths)} file(s), {files.total:,} tokens, {split}: "
        f"{what if pairs else f'{len(starts):,} documents'} in "
        f"{plan.rows:,} rows of {seq + 1} tokens ({plan.filled(seq + 1):.1%} documents, the rest padding)"
        + (", with loss masks" if masks is not None else "")
    )
    identity = f"{'pairs' if pairs else 'packed'}:{len(files.paths)}:{files.total}:{len(starts)}:{plan.rows}"
    rows = PackedRows(files.read, trained, plan, seq + 1, 0, plan.rows, pairs=pairs, reference=reference)
    return rows, text, identity


def _check_pairs(files: TokenFiles, field: str, documents: int) -> int:
    """2 (documents per pair), once ``files`` are checked to hold preference pairs."""
    for path in files.paths:
        sidecar = path.with_suffix(".json")
        kind = json.loads(sidecar.read_text()).get("field") if sidecar.exists() else None
        if kind != "preference":
            raise DataError(
                f"data.pack=pairs: {path} holds {kind or 'unknown'} documents, not preference pairs (prepare it "
                "with `jaxpar prepare --field preference`)"
            )
    if documents % 2:
        raise DataError(f"{field}: {documents} documents, not whole pairs (prompt + chosen, prompt + rejected)")
    return 2


# ---------------------------------------------------------------------------------- mixtures
def _numbers(cfg: DataConfig, name: str) -> list[float] | None:
    text = getattr(cfg, name)
    if not text:
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise DataError(f"data.{name}={text!r}: expected numbers separated by commas, e.g. 3,1") from None
    if not all(v > 0 and np.isfinite(v) for v in values):
        raise DataError(f"data.{name}={text!r}: every entry must be a positive number")
    return values


def _mixture_numbers(cfg: DataConfig) -> tuple[list[float] | None, list[float] | None]:
    """(weights, epochs) of a mixture, checked against ``data.path``'s sources."""
    weights, epochs = _numbers(cfg, "weights"), _numbers(cfg, "epochs")
    sources = len(cfg.path.split(",")) if cfg.path else 0
    if weights and epochs:
        raise DataError("data.weights and data.epochs both given: a mixture's shares come from one of them")
    for name, values in (("weights", weights), ("epochs", epochs)):
        if values is not None and len(values) != sources:
            raise DataError(
                f"data.{name} has {len(values)} entries, data.path names {sources} source(s) "
                f"({cfg.path!r}); give one entry per source (a mixture: data.path=A,B)"
            )
    if sources > 1 and cfg.eval_path and len(cfg.eval_path.split(",")) != sources:
        raise DataError(
            f"data.eval_path names {len(cfg.eval_path.split(','))} source(s), data.path {sources}: one held-out "
            "source per source, or none (each source then holds out data.eval_fraction of its own)"
        )
    return weights, epochs


def _parts(cfg: DataConfig) -> list[DataConfig]:
    """One config per source of a mixture (``data.path`` with commas), else ``[cfg]``."""
    paths = cfg.path.split(",") if cfg.source == DataSource.FILES and cfg.path else [cfg.path]
    if len(paths) == 1:
        return [cfg]
    evals = cfg.eval_path.split(",") if cfg.eval_path else [""] * len(paths)
    return [dataclasses.replace(cfg, path=p, eval_path=e, weights="", epochs="") for p, e in zip(paths, evals)]


def _shares(cfg: DataConfig, sizes: list[int]) -> list[float]:
    """Each source's share of a mixture's rows: ``data.weights``, or epochs × size, or size."""
    weights, epochs = _mixture_numbers(cfg)
    raw = weights or [e * n for e, n in zip(epochs or [1.0] * len(sizes), sizes)]
    return [w / sum(raw) for w in raw]


# ---------------------------------------------------------------------------------- loader
class Loader:
    """Iterator of process-local batches ``{'inputs', 'targets'}`` (int32 [b, seq]) with a resumable state."""

    def __init__(
        self, dataset, *, identity: dict, description: str, entropy_rate: float | None, skipped: dict | None = None
    ):
        self._iter = iter(dataset)
        self._identity, self._description, self.entropy_rate = identity, description, entropy_rate
        self.skipped = skipped or {}  # records `jaxpar prepare --skip-bad` left out of the token files, by reason

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iter)

    def describe(self) -> str:
        return self._description

    def get_state(self) -> dict:
        """JSON-serialisable: the position (grain's state) and the settings it is only valid for."""
        return {"grain": self._iter.get_state(), **self._identity}

    def set_state(self, state: dict) -> None:
        """Continue exactly after the batch at which ``state`` was taken."""
        for key, value in self._identity.items():
            if state.get(key) != value:
                raise DataError(
                    f"data loader state was saved with {key}={state.get(key)!r}, this run has "
                    f"{key}={value!r}; resume with the same settings"
                )
        self._iter.set_state(state["grain"])

    def close(self) -> None:
        self._iter.close()


def _inputs_targets(windows: np.ndarray) -> dict[str, np.ndarray]:
    return {"inputs": np.ascontiguousarray(windows[:, :-1]), "targets": np.ascontiguousarray(windows[:, 1:])}


def _source(cfg: DataConfig, *, vocab_size: int, seq: int, seed: int, split: str, reference=None):
    """(grain source, shuffle?, description, identity, entropy rate, records -> batch) of one split."""
    if cfg.source == "markov":
        chain = markov_chain(vocab_size, branching=cfg.markov_branching, seed=cfg.markov_seed)
        stream = (0, seed) if split == "train" else (1, 0)  # eval: the same records whatever the run's seed
        text = (
            f"markov: vocab {vocab_size}, branching {cfg.markov_branching}, seed {cfg.markov_seed}, "
            f"entropy rate {chain.entropy_rate:.4f} nats/token, {split} stream of endless windows"
        )
        identity = f"markov:{vocab_size}:{cfg.markov_branching}:{cfg.markov_seed}"
        # records are independent draws already: nothing to shuffle (and grain's index_shuffle over 2**40
        # indices leaves them clustered near one value)
        return MarkovSource(chain, seq, stream), False, text, identity, chain.entropy_rate, _inputs_targets
    if cfg.pack in (PackMode.DOCUMENTS, PackMode.PAIRS):
        rows, text, identity = _packed_rows(
            cfg, vocab_size=vocab_size, seq=seq, seed=seed, split=split, reference=reference
        )
        return rows, cfg.shuffle, text, identity, None, batch_of_rows
    src = _file_windows(cfg, vocab_size=vocab_size, seq=seq, split=split)
    text = (
        f"files: {len(src.files.paths)} file(s), {src.files.total:,} tokens, {split} windows "
        f"{src.first:,}..{src.first + src.count - 1:,} of {seq + 1} tokens"
    )
    identity = f"files:{len(src.files.paths)}:{src.files.total}:{src.first}:{src.count}"
    return src, cfg.shuffle, text, identity, None, _inputs_targets


def make_loader(
    cfg: DataConfig,
    /,
    *,
    vocab_size: int,
    seq: int,
    global_batch: int,
    seed: int,
    split: str = "train",
    process_index: int | None = None,
    process_count: int | None = None,
    reference=None,
) -> Loader:
    """This process's batches of ``split`` (see the module docstring for the pipeline and guarantees).
    ``reference(start, stop)``: float32 per token of the split's stream, given with the rows of
    ``data.pack=pairs`` (a DPO run's precomputed reference log-probs)."""
    import grain  # deferred: grain (and the jax it imports) only when a loader is made

    if split not in SPLITS:
        raise DataError(f"split={split!r}: must be one of {', '.join(SPLITS)}")
    if seq < 1 or seed < 0:
        raise DataError(f"--seq {seq} --seed {seed}: the sequence length must be ≥ 1 and the seed ≥ 0")
    if process_index is None or process_count is None:
        import jax  # deferred: this module is read to parse configs, with no jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index={process_index} is not in [0, process_count={process_count})")
    if global_batch < 1 or global_batch % process_count:
        raise DataError(
            f"--batch {global_batch}: must be a positive multiple of the process count "
            f"({process_count}), each process loads an equal share"
        )
    parts = _parts(cfg)
    if reference is not None and len(parts) > 1:
        raise DataError("data.path: precomputed reference log-probs are kept for one source, not a mixture")
    found = [
        _source(part, vocab_size=vocab_size, seq=seq, seed=seed, split=split, reference=reference) for part in parts
    ]
    datasets = []
    for i, (source, shuffle, *_) in enumerate(found):
        ds = grain.MapDataset.source(source)
        if split == "train" and shuffle:  # grain's lazy index shuffle, reseeded every epoch by repeat
            ds = ds.shuffle(seed=(seed + MIXTURE_SEED * i) % 2**32)
        datasets.append(ds.repeat(ENDLESS // len(found) // len(source)))
    _, _, text, identity, entropy, to_batch = found[0]
    if len(found) > 1:  # each row from source i with its share, in grain's fixed interleaving
        shares = _shares(cfg, [len(f[0]) for f in found])
        text = "mixture: " + "; ".join(f"{w:.1%} {f[2]}" for w, f in zip(shares, found))
        identity = "mixture:" + "|".join(f"{w:.6f}:{f[3]}" for w, f in zip(shares, found))
        ds, entropy = grain.MapDataset.mix(datasets, shares), None
    ds = (ds if len(found) > 1 else datasets[0]).batch(global_batch // process_count)
    ds = ds[process_index::process_count].map(to_batch)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch))
    keys = {"source": identity, "split": split, "seq": seq, "batch": global_batch, "seed": seed}
    files = [p for part in parts if part.source == DataSource.FILES for p in resolve_files(part.path, "data.path")]
    skipped = skipped_records(files) if split == "train" else {}
    if skipped:
        text += (
            f" (prepared with {sum(skipped.values())} bad records skipped: "
            + ", ".join(f"{n} {why}" for why, n in skipped.items())
            + ")"
        )
    return Loader(ds, identity=keys, description=text, entropy_rate=entropy, skipped=skipped)


def to_global(batch: dict[str, np.ndarray], sharding) -> dict:
    """Process-local batch -> global ``jax.Array``s; ``sharding`` is one sharding or a dict per key."""
    import jax  # deferred: this module is read to parse configs, with no jax

    return {
        key: jax.make_array_from_process_local_data(sharding[key] if isinstance(sharding, dict) else sharding, value)
        for key, value in batch.items()
    }
