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

import bisect
import dataclasses
import functools
import glob
import json
from pathlib import Path

import numpy as np

from jaxpar.config import Choice, check_choices
from jaxpar.errors import DataError  # noqa: F401  (re-exported)


class DataSource(Choice):
    MARKOV = "markov"  # the embedded synthetic source
    FILES = "files"  # token files (jaxpar prepare)


class TokenDtype(Choice):
    """Element type of raw .bin token files (.npy files carry their own)."""

    UINT16 = "uint16"
    UINT32 = "uint32"


NPY_DTYPES = ("uint16", "uint32", "int32")
COMPANIONS = (".docs.npy", ".mask.bin", ".mask.npy")  # written beside a token file by `jaxpar prepare`
SPLITS = ("train", "eval")
DIRICHLET_ALPHA = 0.5  # transition probabilities per state ~ Dirichlet(0.5, ..., 0.5): skewed, not peaked
MARKOV_MAX_VOCAB = 2**20  # states of the synthetic chain: 1.7 s for 151,936 (Qwen's vocabulary), 24 s at the cap
MARKOV_LENGTH = 2**40  # records in a markov stream: endless in practice, still a finite grain source
SCAN_CHUNK = 1 << 22  # tokens per chunk when scanning files for bad ids
ENDLESS = 2**62  # records a loader can yield: grain's repeat() makes len sys.maxsize, whose
# batch(1) length ceil(maxsize / 1.0) = 2**63 overflows len(); repeat finitely


@dataclasses.dataclass(frozen=True)
class DataConfig:
    source: DataSource = DataSource.MARKOV
    path: str = ""  # files: a file, a directory (all *.npy / *.bin inside, sorted) or a glob
    eval_path: str = ""  # held-out token files; "" -> hold out the last `eval_fraction` of windows of `path`
    eval_fraction: float = 0.01
    dtype: TokenDtype = TokenDtype.UINT16  # element type of raw .bin files (.npy carries its own)
    markov_branching: int = 8  # successors per state of the synthetic chain
    markov_seed: int = 0  # the chain itself (transition table); sample streams are derived from the loader seed
    shuffle: bool = True
    num_threads: int = 2  # grain read threads
    prefetch: int = 4  # grain prefetch buffer

    def __post_init__(self):
        check_choices(self, "data")
        if not 0 < self.eval_fraction < 1:
            raise DataError(f"data.eval_fraction={self.eval_fraction}: must be between 0 and 1 (exclusive)")
        if self.markov_branching < 1:
            raise DataError(f"data.markov_branching={self.markov_branching}: must be ≥ 1")
        for name in ("num_threads", "prefetch", "markov_seed"):
            if getattr(self, name) < 0:
                raise DataError(f"data.{name}={getattr(self, name)}: must be ≥ 0")


# ---------------------------------------------------------------------------------- markov source
@dataclasses.dataclass(frozen=True, eq=False)
class MarkovChain:
    """A first-order chain: state s moves to ``successors[s, j]`` with probability ``probs[s, j]``."""

    successors: np.ndarray  # [V, k] int64, distinct within a row
    probs: np.ndarray  # [V, k] float64, rows sum to 1
    stationary: np.ndarray  # [V] float64, π with π P = π
    entropy_rate: float  # Σ_s π(s) H(P(s, ·)) in nats: the loss of a perfect model

    def matrix(self) -> np.ndarray:
        """The dense [V, V] transition matrix (for small vocabularies and tests)."""
        vocab = len(self.successors)
        out = np.zeros((vocab, vocab))
        np.add.at(out, (np.arange(vocab)[:, None], self.successors), self.probs)
        return out


@functools.lru_cache(maxsize=8)
def markov_chain(vocab_size: int, *, branching: int, seed: int) -> MarkovChain:
    """A random sparse chain with ``branching`` distinct successors per state (the same for the same args).

    Irreducible by construction: a random cyclic order of all tokens gives every state its next token
    in the cycle as successor 0, so π is unique and positive. Aperiodicity is not needed: records start
    from π, so every position of a record is distributed by π. The other successors are drawn uniformly
    without replacement; the probabilities come from a symmetric Dirichlet(``DIRICHLET_ALPHA``).
    """
    if not 1 <= branching <= vocab_size:
        raise DataError(f"data.markov_branching={branching}: must be between 1 and model.vocab_size={vocab_size}")
    if vocab_size > MARKOV_MAX_VOCAB:
        raise DataError(
            f"data.source=markov: model.vocab_size={vocab_size:,} is more states than the synthetic chain "
            f"is built for (at most {MARKOV_MAX_VOCAB:,}: its tables live in memory and its stationary "
            "distribution is iterated); use data.source=files"
        )
    rng = np.random.default_rng([seed, 0x6D61726B])
    cycle = rng.permutation(vocab_size)
    succ = np.empty((vocab_size, branching), np.int64)
    succ[cycle, 0] = np.roll(cycle, -1)
    for col in range(1, branching):  # redraw clashes: uniform over distinct successor sets
        succ[:, col] = rng.integers(0, vocab_size, vocab_size)
        while (clash := (succ[:, :col] == succ[:, col : col + 1]).any(axis=1)).any():
            succ[clash, col] = rng.integers(0, vocab_size, int(clash.sum()))
    probs = rng.dirichlet(np.full(branching, DIRICHLET_ALPHA), size=vocab_size)
    pi = _stationary(succ, probs)
    row_entropy = -(probs * np.log(np.where(probs > 0, probs, 1.0))).sum(axis=1)
    for array in (succ, probs, pi):
        array.setflags(write=False)
    return MarkovChain(succ, probs, pi, float(pi @ row_entropy))


def _stationary(succ: np.ndarray, probs: np.ndarray, tol: float = 1e-14) -> np.ndarray:
    """π by power iteration on the lazy chain (I + P) / 2: same π, aperiodic, so it converges."""
    vocab = len(succ)
    pi = np.full(vocab, 1.0 / vocab)
    for _ in range(200_000):
        step = np.bincount(succ.ravel(), weights=(pi[:, None] * probs).ravel(), minlength=vocab)
        new = 0.5 * (pi + step)
        new /= new.sum()
        if np.abs(new - pi).sum() < tol:
            return new
        pi = new
    raise RuntimeError("stationary distribution did not converge")  # not reached for irreducible chains


class MarkovSource:
    """grain random-access source: record i is ``seq + 1`` tokens of the chain, first one drawn from π."""

    def __init__(self, chain: MarkovChain, seq: int, stream: tuple[int, ...]):
        self.chain, self.seq, self.stream = chain, seq, tuple(stream)
        cum = np.cumsum(chain.probs, axis=1)
        cum[:, -1] = 1.0  # inverse-CDF tables as lists: bisect beats numpy per step
        self._cum, self._succ = cum.tolist(), chain.successors.tolist()
        first = np.cumsum(chain.stationary)
        first[-1] = 1.0
        self._first = first.tolist()

    def __len__(self) -> int:
        return MARKOV_LENGTH

    def __getitem__(self, index: int) -> np.ndarray:
        u = np.random.default_rng([*self.stream, int(index)]).random(self.seq + 1).tolist()
        cum, succ = self._cum, self._succ
        state = bisect.bisect_right(self._first, u[0])
        out = [state]
        for x in u[1:]:
            state = succ[state][bisect.bisect_right(cum[state], x)]
            out.append(state)
        return np.array(out, np.int32)


# ---------------------------------------------------------------------------------- token files
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
        out = np.empty(stop - start, np.int32)
        f = int(np.searchsorted(self.starts, start, side="right")) - 1
        pos = start
        while pos < stop:
            lo = pos - int(self.starts[f])
            hi = min(len(self.arrays[f]), stop - int(self.starts[f]))
            out[pos - start : pos - start + hi - lo] = self.arrays[f][lo:hi]
            pos, f = pos + hi - lo, f + 1
        return out


class WindowSource:
    """grain random-access source: windows ``first .. first+count-1`` of ``seq + 1`` tokens at stride ``seq``."""

    def __init__(self, files: TokenFiles, seq: int, first: int, count: int):
        self.files, self.seq, self.first, self.count = files, seq, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> np.ndarray:
        start = (self.first + int(index)) * self.seq
        return self.files.read(start, start + self.seq + 1)


def _file_windows(cfg: DataConfig, *, vocab_size: int, seq: int, split: str) -> WindowSource:
    """The windows of ``split``: all of its own files, or ``data.path`` split into a train head and an eval tail."""
    held_out = not cfg.eval_path
    field = "data.path" if split == "train" or held_out else "data.eval_path"
    files = TokenFiles(resolve_files(cfg.path if field == "data.path" else cfg.eval_path, field), cfg.dtype)
    if not held_out:  # held-out files must not be trained on
        train = {p.resolve() for p in resolve_files(cfg.path, "data.path")}
        shared = sorted(train & {p.resolve() for p in resolve_files(cfg.eval_path, "data.eval_path")})
        if shared:
            raise DataError(f"data.eval_path and data.path share {', '.join(map(str, shared))}")
    files.check(vocab_size)
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


# ---------------------------------------------------------------------------------- loader
class Loader:
    """Iterator of process-local batches ``{'inputs', 'targets'}`` (int32 [b, seq]) with a resumable state."""

    def __init__(self, dataset, *, identity: dict, description: str, entropy_rate: float | None):
        self._iter = iter(dataset)
        self._identity, self._description, self.entropy_rate = identity, description, entropy_rate

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


def _source(cfg: DataConfig, *, vocab_size: int, seq: int, seed: int, split: str):
    """(grain source, shuffle?, description, identity, entropy rate) of one split."""
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
        return MarkovSource(chain, seq, stream), False, text, identity, chain.entropy_rate
    src = _file_windows(cfg, vocab_size=vocab_size, seq=seq, split=split)
    text = (
        f"files: {len(src.files.paths)} file(s), {src.files.total:,} tokens, {split} windows "
        f"{src.first:,}..{src.first + src.count - 1:,} of {seq + 1} tokens"
    )
    identity = f"files:{len(src.files.paths)}:{src.files.total}:{src.first}:{src.count}"
    return src, cfg.shuffle, text, identity, None


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
) -> Loader:
    """This process's batches of ``split`` (see the module docstring for the pipeline and guarantees)."""
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
    source, shuffle, text, identity, entropy = _source(cfg, vocab_size=vocab_size, seq=seq, seed=seed, split=split)
    ds = grain.MapDataset.source(source)
    if split == "train" and shuffle:
        ds = ds.shuffle(seed=seed % 2**32)  # grain's lazy index shuffle, reseeded every epoch by repeat
    ds = ds.repeat(ENDLESS // len(source)).batch(global_batch // process_count)
    ds = ds[process_index::process_count].map(_inputs_targets)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.num_threads, prefetch_buffer_size=cfg.prefetch))
    keys = {"source": identity, "split": split, "seq": seq, "batch": global_batch, "seed": seed}
    return Loader(ds, identity=keys, description=text, entropy_rate=entropy)


def to_global(batch: dict[str, np.ndarray], sharding) -> dict:
    """Process-local batch -> global ``jax.Array``s; ``sharding`` is one sharding or a dict per key."""
    import jax  # deferred: this module is read to parse configs, with no jax

    return {
        key: jax.make_array_from_process_local_data(sharding[key] if isinstance(sharding, dict) else sharding, value)
        for key, value in batch.items()
    }
