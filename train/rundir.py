"""The run directory: the checkpoint a run resumes from, the run a directory or ``init_from`` belongs to
(``jaxpar.identity``: another run's checkpoint or config.json, or a checkpoint whose arrays do not fit,
is refused, listing every difference), and the files the run writes there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from flax import nnx

from jaxpar.checkpoint import CheckpointError, SavedRun, latest
from jaxpar.convert import hf_config
from jaxpar.convert.files import is_hf_folder
from jaxpar.convert.store import base_weights
from jaxpar.identity import Entry, check_fits
from jaxpar.layers.lora import LoraConfig
from jaxpar.layout import Layout
from jaxpar.models import DenseConfig, build_model
from jaxpar.train.config import TrainConfig, to_dict


def check_out_dir(out: Path, config: dict, abstract) -> SavedRun | None:
    """The checkpoint to resume from (None for a fresh run); refuses a run directory of another run, or
    a checkpoint whose arrays do not fit ``abstract`` (the state this run would create)."""
    if out.exists() and not out.is_dir() or any(p.is_file() for p in out.parents):
        raise CheckpointError(f"--out {out}: is a file (or inside one), not a run directory; nothing was written")
    saved = latest(out / "checkpoints")
    if saved is not None:
        check_fits(
            Entry.RESUME,
            saved_config=saved.config,
            current=config,
            step=saved.step,
            where=out,
            checkpoints=out / "checkpoints",
            abstract=abstract,
        )
    elif (out / "config.json").is_file():
        try:
            previous = json.loads((out / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(
                f"{out / 'config.json'}: not valid JSON, so not a run this one can resume; "
                "nothing was written. Use another --out."
            ) from None
        check_fits(Entry.RESUME, saved_config=previous, current=config, step=None, where=out / "config.json")
    return saved


def check_init_from(cfg: TrainConfig) -> None:
    """``cfg.init_from``'s model must be this run's (``jaxpar.identity``: the model config, whole, and
    every array's shape and dtype); checked abstractly, before any write."""
    ckpt = Path(cfg.init_from).resolve()
    if is_hf_folder(ckpt):
        _check_hf(cfg, ckpt)
        return
    saved = latest(ckpt / "checkpoints")
    if saved is None:
        raise CheckpointError(
            f"--init-from {ckpt}: holds no complete checkpoint (expected {ckpt / 'checkpoints'}/<step>)"
        )
    model = saved.config.get("model") if isinstance(saved.config, dict) else None
    is_run = isinstance(saved.config, dict) and saved.config.get("format") != "jaxpar-model"
    base = _base(cfg, model)
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(base, execution=cfg.execution, rngs=nnx.Rngs(0))))
    check_fits(
        Entry.INIT_FROM,
        saved_config=model,
        current=to_dict(base, DenseConfig),
        step=saved.step,
        where=ckpt,
        checkpoints=ckpt / "checkpoints",
        abstract=abstract,
        prefix="0/" if is_run else "",
    )


def _check_hf(cfg: TrainConfig, folder: Path) -> None:
    """A Hugging Face folder's model must be this run's: its config as ``jaxpar convert`` reads it, in the
    run's parameter dtype (the weights' shapes are checked as they are placed)."""
    theirs = to_dict(hf_config(folder, param_dtype=cfg.model.param_dtype)[0], DenseConfig)
    ours = to_dict(_base(cfg, theirs), DenseConfig)
    changed = sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k))
    if changed:
        raise CheckpointError(
            f"--init-from {folder}: this run's model differs from the folder's in "
            + ", ".join(f"model.{k} ({ours.get(k)!r}, the folder's {theirs.get(k)!r})" for k in changed)
        )


def _base(cfg: TrainConfig, saved: dict | None):
    """The model ``--init-from`` must hold: the run's, without the LoRA adapters the run adds to a base
    saved without any (they start fresh; a base with adapters of its own is compared whole)."""
    lora = (saved or {}).get("lora") if isinstance(saved, dict) else None
    if cfg.model.lora.rank and not (isinstance(lora, dict) and lora.get("rank")):
        return dataclasses.replace(cfg.model, lora=LoraConfig())
    return cfg.model


def with_weights_of(cfg: TrainConfig, state, layout: Layout):
    """``state`` (model, fresh optimizer) with the model replaced by ``cfg.init_from``'s, restored onto
    the layout (``check_init_from`` has passed); a Hugging Face folder's weights placed shard by shard.
    LoRA on a base without adapters: the base's weights, the run's fresh adapters."""
    loaded = base_weights(cfg.init_from, cfg.model, cfg.execution, layout, state[0])
    state[0] = nnx.merge_state(state[0], loaded)  # the loaded weights over the fresh ones
    return state


def write_json(path: Path, data: dict) -> None:
    """Writes ``data`` to ``path`` under a temporary name, renamed into place (a reader never sees half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
