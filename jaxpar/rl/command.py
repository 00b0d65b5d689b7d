"""``jaxpar grpo``: GRPO (``jaxpar.rl.loop.run_grpo``) into a run folder, resumed by running it again.

    jaxpar grpo --prompts prompts.jsonl --reward rewards.py:correct --out runs/grpo --init-from runs/sft \\
        --iterations 200 --mesh fsdp=8 --set grpo.group_size=8 --set model.lora.rank=8

--prompts is a jsonl file, one record per line: {"prompt": "text"} (encoded with --tokenizer, or the
tokenizer.json of --init-from) or {"prompt_ids": [1, 2, 3]}. --reward names FUNCTION in MODULE (an
importable module, or a .py file), called as FUNCTION(prompt, completion) with their texts when the run
has a tokenizer, else with their token id lists, and returning a number. The model is --model's preset,
initialised with --seed, or the weights of --init-from (a training run, a model checkpoint or a Hugging
Face folder); ``--set model.…`` changes it (``model.lora.rank=8``: adapters over the loaded base).

Everything is checked before a weight is read: the prompts file, the reward function, the settings,
and a run folder of another run. The folder holds config.json (what the run is; running again with
anything else changed is refused, naming the setting), metrics.jsonl (one record per iteration: reward,
loss, the time split between rollouts and updates, rollout tokens/s) and checkpoints/ (orbax: the train
state every --save-every iterations and at the end). Running the same command again resumes after the
newest checkpoint, and the iterations that follow are those of an uninterrupted run (the prompts drawn
and the sampling seeds depend on the seed and the iteration only).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

from jaxpar.config import to_dict
from jaxpar.errors import CheckpointError, ConfigError, DataError, JaxparError
from jaxpar.inference.command import load_tokenizer, model_config, parse_ids, source_kind
from jaxpar.mesh import simulate_cpu_devices
from jaxpar.meshes import PRESETS as MESHES
from jaxpar.models import PRESETS as MODELS
from jaxpar.models import get_model_preset
from jaxpar.rl.grpo import GRPOConfig
from jaxpar.settings import add_set_argument, apply_overrides, positive_int
from jaxpar.train.optim import OptimizerConfig

HELP = "train by GRPO: rollouts from the serving engine in-process, rewards from a Python function"
TAKES = ("grpo.", "optimizer.", "model.lora.")
DEFAULTS = {"grpo": GRPOConfig(), "optimizer": OptimizerConfig(learning_rate=1e-5)}


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--prompts", required=True, metavar="FILE", help="a jsonl file of prompt records")
    parser.add_argument("--reward", required=True, metavar="MODULE:FUNCTION", help="the reward function")
    parser.add_argument("--out", required=True, metavar="DIR", help="the run folder (resumed when it holds this run)")
    source = parser.add_mutually_exclusive_group(required=True)
    models = ", ".join(MODELS)
    source.add_argument("--model", metavar="PRESET", help=f"a model preset (initialised with --seed): {models}")
    source.add_argument("--init-from", metavar="DIR", help="a training run, model checkpoint or Hugging Face folder")
    parser.add_argument("--tokenizer", metavar="FILE", help="a tokenizers JSON file (default: --init-from's)")
    parser.add_argument("--iterations", type=positive_int, required=True, metavar="N", help="rollout batches")
    parser.add_argument(
        "--mesh", default="dp", help=f"the training layout: {', '.join(MESHES)} or an axis spec (default dp)"
    )
    parser.add_argument("--engine-mesh", default=None, help="the rollouts' decode layout (default: one device)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="initialisation, prompt draws, sampling")
    parser.add_argument("--stop-ids", default=None, metavar="IDS", help="comma-separated ids that end a completion")
    parser.add_argument("--save-every", type=positive_int, default=10, metavar="N", help="iterations between saves")
    parser.add_argument(
        "--stop-after", type=positive_int, default=None, metavar="N", help="stop after N iterations (resumable)"
    )
    parser.add_argument("--cpu-devices", type=positive_int, default=None, metavar="N", help="simulate N CPU devices")
    add_set_argument(parser, DEFAULTS | {"model": MODELS["tiny"]}, TAKES, note=" (model.lora: adapters)")


def load_reward(spec: str, /):
    """The function ``MODULE:FUNCTION`` names (MODULE importable, or a .py file)."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name.isidentifier():
        raise ConfigError(f"--reward {spec!r}: give MODULE:FUNCTION (a module or a .py file, and a function in it)")
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"--reward {spec!r}: {path} is not a file")
        found = importlib.util.spec_from_file_location(f"jaxpar_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(found)
        try:
            found.loader.exec_module(module)
        except Exception as err:  # the user's file: any error it raises, named, without a traceback
            raise ConfigError(f"--reward {spec!r}: running {path} failed ({type(err).__name__}: {err})") from None
    else:
        try:
            module = importlib.import_module(module_name)
        except (ImportError, TypeError, ValueError) as err:  # TypeError: a relative name such as ".."
            raise ConfigError(f"--reward {spec!r}: cannot import {module_name} ({err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"--reward {spec!r}: {module_name} has no function {name}")
    return fn


def read_prompts(path: str, tokenizer) -> list[list[int]]:
    """The prompts of a jsonl file, each refused with its line when it is not a prompt record."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--prompts {file}: no such file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(f"--prompts {file}: not UTF-8 text ({err})") from None
    prompts = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--prompts {file}:{n}"
        try:
            record = json.loads(line)
        except ValueError as err:
            raise DataError(f"{where}: not a JSON record ({err})") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("prompt_ids" in record):
            raise DataError(f'{where}: a record holds "prompt" (text) or "prompt_ids" (token ids), one of them')
        if "prompt" in record:
            if tokenizer is None:
                raise DataError(f'{where}: "prompt" is text, and the run has no tokenizer (give --tokenizer)')
            ids = tokenizer.encode(str(record["prompt"])).ids
        else:
            ids = record["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise DataError(f'{where}: "prompt_ids" must be a list of token ids')
        if not ids:
            raise DataError(f"{where}: an empty prompt")
        prompts.append(ids)
    if not prompts:
        raise DataError(f"--prompts {file}: no prompt records")
    return prompts


def _model(args: argparse.Namespace, lora_sets: list[str]):
    """(model config, its starting weights' source kind or None) with ``--set model.lora.…`` applied."""
    if args.model is not None:
        cfg, kind = get_model_preset(args.model), None
    else:
        kind = source_kind(args.init_from)
        cfg = model_config(kind, args.init_from)[0]
    return apply_overrides({"model": cfg}, lora_sets, command="grpo", takes=("model.lora.",))["model"], kind


def _settings(args: argparse.Namespace):
    """(grpo, optimizer, model config, source kind, the run's config as JSON), checked before any work."""
    lora = [s for s in args.overrides if s.startswith("model.")]
    rest = apply_overrides(
        DEFAULTS, [s for s in args.overrides if not s.startswith("model.")], command="grpo", takes=TAKES
    )
    model_cfg, kind = _model(args, lora)
    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed}: must be ≥ 0")
    if model_cfg.vocab_size and args.stop_ids:
        bad = [i for i in parse_ids(args.stop_ids, "--stop-ids") if not 0 <= i < model_cfg.vocab_size]
        if bad:
            raise ConfigError(f"--stop-ids: {bad[0]} is outside the vocabulary [0, {model_cfg.vocab_size})")
    config = {
        "prompts": str(Path(args.prompts).resolve()),
        "reward": args.reward,
        "source": args.model if args.model is not None else str(Path(args.init_from).resolve()),
        "iterations": args.iterations,
        "mesh": args.mesh,
        "engine_mesh": args.engine_mesh,
        "seed": args.seed,
        "stop_ids": args.stop_ids,
        "model": to_dict(model_cfg),
        "grpo": to_dict(rest["grpo"]),
        "optimizer": to_dict(rest["optimizer"]),
    }
    return rest["grpo"], rest["optimizer"], model_cfg, kind, config


def check_out(out: Path, config: dict) -> None:
    """Refuses a file, or the folder of another run (naming the first setting that differs)."""
    if out.exists() and not out.is_dir() or any(p.is_file() for p in out.parents):
        raise CheckpointError(f"--out {out}: is a file (or inside one), not a run folder; nothing was written")
    saved = out / "config.json"
    if not saved.is_file():
        return
    try:
        previous = json.loads(saved.read_text())
    except ValueError:
        raise CheckpointError(f"{saved}: not valid JSON, so not a run this one resumes; use another --out") from None
    for key in sorted(set(previous) | set(config)):
        if previous.get(key) != config.get(key):
            raise CheckpointError(
                f"--out {out}: a run with {key}={previous.get(key)!r}, not {config.get(key)!r}; "
                "run it with its own settings to resume it, or use another --out"
            )


def run(args: argparse.Namespace, /) -> int:
    grpo, optimizer, model_cfg, kind, config = _settings(args)
    tokenizer = load_tokenizer(args.tokenizer, args.init_from) if args.tokenizer or args.init_from else None
    prompts = read_prompts(args.prompts, tokenizer)
    from jaxpar.inference.generate import check_request  # deferred: jax and flax

    try:
        check_request(model_cfg, prompts, [grpo.max_new_tokens] * len(prompts))
    except ConfigError as err:
        raise ConfigError(f"--prompts {args.prompts} with grpo.max_new_tokens={grpo.max_new_tokens}: {err}") from None
    config["prompts_sha256"] = hashlib.sha256(Path(args.prompts).read_bytes()).hexdigest()
    reward = load_reward(args.reward)
    out = Path(args.out)
    check_out(out, config)
    if args.cpu_devices:
        simulate_cpu_devices(args.cpu_devices)
    # deferred: jax, flax, orbax and the model zoo
    from jaxpar.execution import ExecutionConfig
    from jaxpar.inference.placement import engine_layout
    from jaxpar.rl.loop import grpo_layout
    from jaxpar.rl.run_folder import RunFolder

    rows = grpo.prompts * grpo.group_size
    try:
        seq = grpo_layout(model_cfg, prompts, grpo, args.mesh, ExecutionConfig(capacity_factor=None))[1]
    except JaxparError as err:
        raise type(err)(f"--mesh {args.mesh} with {rows} rollouts a batch: {err}") from None
    engine_layout(model_cfg, args.engine_mesh, slots=rows, length=seq + 1, flag="--engine-mesh")

    folder = RunFolder(out, config, save_every=args.save_every, iterations=args.iterations, stop_after=args.stop_after)
    score = reward if tokenizer is None else lambda p, c: reward(tokenizer.decode(p), tokenizer.decode(c))
    done = folder.train(model_cfg, prompts, score, grpo=grpo, optimizer=optimizer, args=args, kind=kind)
    print(f"jaxpar grpo: {done} of {args.iterations} iterations in {out}", file=sys.stderr)
    return 0
