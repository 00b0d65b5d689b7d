"""``jaxpar train`` (also ``python -m jaxpar.train``): train a model preset under a mesh layout.

    jaxpar train --model tiny --mesh 3d --steps 300 --batch 16 --seq 128 --out runs/tiny --cpu-devices 8
    jaxpar train ... --set optimizer.learning_rate=1e-3 --set data.source=files --set data.path=tok.bin

Re-running the same command resumes from the newest checkpoint in ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import jax

from jaxpar.errors import ConfigError, LaunchError
from jaxpar.mesh import simulate_cpu_devices
from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.models import PRESETS as MODEL_PRESETS
from jaxpar.settings import add_set_argument, positive_int
from jaxpar.train.config import TrainConfig, apply_overrides, default_config
from jaxpar.train.prepared import cached_path, ensure_prepared, field_of, tokenizer_of

HELP = "train a model preset on a mesh layout (resumes from --out)"


def _from_env(value, name: str, cast=str):
    """``value`` if the flag was given, else environment variable ``name`` (None when unset)."""
    text = os.environ.get(name)
    if value is not None or text is None:
        return value
    try:
        return cast(text)
    except ValueError:
        raise LaunchError(f"environment variable {name}={text!r}: expected an integer") from None


def start_distributed(args: argparse.Namespace, /) -> bool:
    """``jax.distributed.initialize`` when asked (flags, env, ``--distributed``); True if it ran.
    Bad values are refused here, naming the flag, before jax waits for a coordinator."""
    coordinator = _from_env(args.coordinator, "JAX_COORDINATOR_ADDRESS")
    n = _from_env(args.num_processes, "JAXPAR_NUM_PROCESSES", int)
    i = _from_env(args.process_id, "JAXPAR_PROCESS_ID", int)
    if not (args.distributed or any(v is not None for v in (coordinator, n, i))):
        return False
    if (n is None) != (i is None):
        missing = "--process-id" if i is None else "--num-processes"
        raise LaunchError(
            f"{missing} is needed too: give --num-processes and --process-id together "
            "(or neither, to detect them from the cluster)"
        )
    if n is not None and not 0 <= i < n:
        raise LaunchError(f"--process-id={i}: must be in 0..{n - 1} for --num-processes={n}")
    if coordinator is not None and not _host_port(coordinator):
        raise LaunchError(f"--coordinator={coordinator!r}: expected HOST:PORT, e.g. 10.0.0.1:1234")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=n, process_id=i)
    return True


def _host_port(text: str) -> bool:
    host, sep, port = text.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    parser.add_argument("--model", default="tiny", help=f"model preset: {', '.join(MODEL_PRESETS)} (default: tiny)")
    parser.add_argument(
        "--init-from",
        default=None,
        metavar="CKPT",
        help="fine-tune: the model (config and "
        "weights) of a model checkpoint from `jaxpar convert`, a run folder or a Hugging Face folder; replaces --model",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help=f"mesh preset ({', '.join(MESH_PRESETS)}) or axis spec like data=2,fsdp=-1 (default: 3d)",
    )
    parser.add_argument("--steps", type=positive_int, default=None, help="optimizer steps in all (default: 300)")
    parser.add_argument("--batch", type=positive_int, default=None, help="global batch in sequences (default: 16)")
    parser.add_argument("--seq", type=positive_int, default=None, help="sequence length in tokens (default: 128)")
    parser.add_argument("--out", required=True, help="run directory: config, checkpoints, metrics")
    parser.add_argument(
        "--cpu-devices",
        type=positive_int,
        default=None,
        help="simulate this many CPU devices (per process when there are several)",
    )
    data = parser.add_argument_group("records tokenized on the fly (docs/fine-tuning.md)")
    data.add_argument(
        "--data",
        nargs="+",
        default=None,
        metavar="INPUT",
        help="text, jsonl, parquet or datasets inputs, prepared once into a cache (jaxpar prepare); "
        "sets data.source=files data.pack=documents",
    )
    data.add_argument("--tokenizer", default=None, metavar="FILE", help="--data's tokenizer (default: --init-from's)")
    data.add_argument(
        "--data-field",
        default=None,
        choices=["text", "messages"],
        help="--data's record field (default: messages when the records have them, else text)",
    )
    data.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip --data's bad records, counted by reason (printed, and data_skipped in the first metrics record), "
        "instead of stopping at the first",
    )
    _add_processes(parser)
    add_set_argument(parser, default_config(), note=" (with their defaults for --model tiny)")
    parser.add_argument("--profile-steps", default=None, metavar="A:B", help="jax.profiler trace of steps A..B")
    parser.add_argument("--compile-cache", default=None, metavar="DIR", help="persistent compilation cache")


def _add_processes(parser: argparse.ArgumentParser) -> None:
    """The flags of a run over several processes (``jax.distributed``)."""
    group = parser.add_argument_group("several processes (docs/scale-out.md)")
    group.add_argument(
        "--distributed",
        action="store_true",
        help="start jax.distributed; what is not given "
        "below is detected from the cluster (SLURM, Cloud TPU, Kubernetes, Open MPI)",
    )
    group.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        help="process 0's address (env JAX_COORDINATOR_ADDRESS); implies --distributed",
    )
    group.add_argument(
        "--num-processes",
        type=positive_int,
        default=None,
        metavar="N",
        help="processes in the job (env JAXPAR_NUM_PROCESSES); implies --distributed",
    )
    group.add_argument(
        "--process-id",
        type=int,
        default=None,
        metavar="I",
        help="this process, 0..N-1 (env JAXPAR_PROCESS_ID); implies --distributed",
    )


def build_config(args: argparse.Namespace, /):
    """The resolved ``TrainConfig``: preset, then flags, then ``--set`` in order."""
    if getattr(args, "init_from", None):
        model, execution = init_from_config(args.init_from)
        cfg = TrainConfig(
            model=model,
            execution=execution,
            model_preset=f"init-from:{args.init_from}",
            init_from=str(args.init_from),
        )
    else:
        cfg = default_config(args.model)
    flags = {k: getattr(args, k) for k in ("mesh", "steps", "batch", "seq") if getattr(args, k) is not None}
    log = {k: v for k, v in (("profile_steps", args.profile_steps), ("compile_cache", args.compile_cache)) if v}
    cfg = dataclasses.replace(cfg, **flags, log=dataclasses.replace(cfg.log, **log))
    return apply_overrides(cfg, [*data_settings(args), *args.overrides])


def data_settings(args: argparse.Namespace, /) -> list[str]:
    """The ``--set`` items ``--data`` stands for: the cache's prepared files, as packed documents (as
    pairs with objective=dpo, for preference records)."""
    if not getattr(args, "data", None):
        if getattr(args, "tokenizer", None) or getattr(args, "data_field", None) or getattr(args, "skip_bad", False):
            raise ConfigError("--tokenizer, --data-field and --skip-bad go with --data")
        return []
    tokenizer = tokenizer_of(args.tokenizer, args.init_from)
    field = field_of(args.data, args.data_field)
    args.prepared = (tokenizer, field, cached_path(args.data, tokenizer, field, args.skip_bad))
    if field == "preference":  # pairs, for DPO
        return ["data.source=files", f"data.path={args.prepared[2]}", "data.pack=pairs", "objective=dpo"]
    return ["data.source=files", f"data.path={args.prepared[2]}", "data.pack=documents"]


def init_from_config(path: str, /):
    """(model config, execution) of ``--init-from``: a model checkpoint or run folder as saved, or a Hugging
    Face folder as ``jaxpar convert --from-hf`` reads it (the family's execution)."""
    # deferred: imports orbax and the converters
    from jaxpar.convert import hf_config
    from jaxpar.convert.files import is_hf_folder
    from jaxpar.convert.store import model_config, saved_execution

    if is_hf_folder(path):
        model, family, hf = hf_config(path)
        return model, family.execution(hf.config)
    return model_config(path)[0], saved_execution(path)


def run(args: argparse.Namespace, /) -> int:
    if args.cpu_devices:
        simulate_cpu_devices(args.cpu_devices)
    start_distributed(args)
    from jaxpar.train.loop import train  # deferred: imports optax, orbax and the converters

    cfg = build_config(args).validate()
    if getattr(args, "prepared", None):
        tokenizer, field, path = args.prepared
        if ensure_prepared(args.data, tokenizer, field, path, processes=jax.process_count(), skip_bad=args.skip_bad):
            print(f"--data: prepared into {path.parent} (the cache)")
    result = train(cfg, args.out)
    if jax.process_index() != 0:
        return 0
    if result.losses:
        last = result.losses[result.last_step]
        line = f"step {result.last_step}: loss {last:.4f}"
        if result.eval_losses:
            step = max(result.eval_losses)
            line += f", eval loss {result.eval_losses[step]:.4f} (step {step})"
        if result.entropy_rate is not None:
            line += f"; the source's entropy rate is {result.entropy_rate:.4f} nats (the floor)"
        print(line + (" (preempted: checkpoint saved)" if result.preempted else ""))
    else:
        print(f"nothing to do: {args.out} already holds step {result.last_step} of {cfg.steps}")
    print(f"run directory: {args.out} (config.json, metrics.jsonl, tensorboard/, checkpoints/)")
    return 0
