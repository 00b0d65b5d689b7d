"""``jaxpar convert``: Hugging Face folders to jaxpar model checkpoints and back.

    jaxpar convert --from-hf ./Llama-3.2-1B --out ckpt/llama1b [--mesh fsdp=8] [--cpu-devices 8]
    jaxpar train --init-from ckpt/llama1b --out runs/ft --set data.path=tokens.bin ...     # fine-tune
    jaxpar convert --to-hf runs/ft --out ./llama1b-ft          # a run's newest checkpoint, or a model checkpoint
    jaxpar convert --to-peft runs/lora --out ./adapter         # a LoRA run's adapters, as PEFT saves them
    jaxpar convert --from-hf ./Llama-3.2-1B --adapter ./adapter --out ckpt/llama1b-lora   # with a PEFT adapter
    jaxpar convert --from-hf ./Llama-3.2-1B --quantize int8 --out ckpt/llama1b-int8   # for jaxpar generate / serve

Nothing existing is overwritten: ``--out`` must be a new path, and outputs are written under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxpar.execution import moved_field
from jaxpar.mesh import simulate_cpu_devices
from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.settings import add_quantize_argument, add_set_argument, apply_overrides, changed
from jaxpar.shardings import preset_settings

HELP = "convert Hugging Face checkpoints to jaxpar model checkpoints and back"


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1]
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--from-hf", metavar="DIR", help="a Hugging Face folder (config.json + *.safetensors)")
    way.add_argument("--to-hf", metavar="CKPT", help="a model checkpoint or a training run's folder")
    way.add_argument(
        "--to-peft", metavar="CKPT", help="a LoRA model checkpoint or run: its adapters alone, as a PEFT folder"
    )
    parser.add_argument("--adapter", metavar="DIR", default=None, help="--from-hf: a PEFT LoRA folder to load too")
    parser.add_argument("--out", required=True, help="the new folder to write")
    parser.add_argument(
        "--mesh",
        default=None,
        help=f"mesh preset ({', '.join(MESH_PRESETS)}) or axis spec to place the model on (default: one device)",
    )
    parser.add_argument("--cpu-devices", type=int, default=None, help="simulate this many CPU devices")
    parser.add_argument(
        "--dtype",
        default=None,
        help="--from-hf: parameter dtype (default float32); --to-hf: tensor dtype (default: the parameters')",
    )
    parser.add_argument(
        "--family", default=None, help="--to-hf: the HF model_type to write (default: inferred from the config)"
    )
    parser.add_argument("--max-shard-mb", type=int, default=2048, help="--to-hf: safetensors file size limit")
    add_quantize_argument(parser, when="--from-hf, for serving")
    add_set_argument(
        parser,
        preset_settings("tiny"),
        TAKES,
        note=" with --from-hf (defaults: the folder's config.json and its family's; these are --model tiny's)",
    )


TAKES = ("model.", "execution.")


def hf_overrides(args: argparse.Namespace, /) -> tuple[dict, dict]:
    """--from-hf's ``--set`` items (``jaxpar.settings``) checked against the folder's config.json (no
    weight read): the model fields and execution settings they change."""
    from jaxpar.convert import hf_config  # deferred: imports jax, flax and the model zoo

    cfg, fam, hf = hf_config(args.from_hf, param_dtype=args.dtype or "float32")
    base = {"model": cfg, "execution": fam.execution(hf.config)}
    hf.close()
    new = apply_overrides(base, args.overrides, command="convert", takes=TAKES, refuse=moved_field)
    return changed(new["model"], base["model"]), changed(new["execution"], base["execution"])


def run(args: argparse.Namespace, /) -> int:
    if args.cpu_devices:
        simulate_cpu_devices(args.cpu_devices)
    # deferred: jax, flax and the model zoo, imported once the simulated devices are set
    import jax

    from jaxpar.convert import FAMILIES, ConvertError, from_hf, save_adapter, to_hf
    from jaxpar.convert.store import load_model, model_config, save_model
    from jaxpar.shardings import default_layout

    for flag in ("from_hf", "to_hf", "to_peft", "out", "adapter"):
        if getattr(args, flag) == "":
            raise ConvertError(f"--{flag.replace('_', '-')}: an empty path")
    if args.family and args.family not in FAMILIES:
        raise ConvertError(f"--family={args.family!r}: not one of {', '.join(sorted(FAMILIES))}")
    if args.adapter is not None and args.from_hf is None:
        raise ConvertError("--adapter: goes with --from-hf (a PEFT folder is loaded onto its base model)")
    if Path(args.out).exists():  # before any tensor is read
        raise ConvertError(f"{Path(args.out).resolve()}: exists; conversion writes a new folder and never overwrites")
    if args.quantize is not None and args.from_hf is None:
        raise ConvertError("--quantize: goes with --from-hf (the weights are quantized as they are read)")
    if args.quantize is not None:
        args.overrides = [*args.overrides, f"model.quantize={args.quantize}"]
    if args.from_hf is not None:
        fields, execution = hf_overrides(args)
        dtype = fields.pop("param_dtype", args.dtype or "float32")
        model = from_hf(
            args.from_hf, mesh=args.mesh, param_dtype=dtype, execution=execution, adapter=args.adapter, **fields
        )
        source = {"hf": str(args.from_hf)} | ({"peft": str(args.adapter)} if args.adapter else {})
        out = save_model(model, args.out, source=source)
        print(
            f"{args.from_hf} -> {out}: {type(model.cfg).__name__}, {model.cfg.num_params():,} parameters, "
            f"mesh {dict((a, n) for a, n in model.layout.mesh.shape.items() if n > 1) or 'one device'}"
        )
        return 0
    if args.overrides:
        raise ConvertError("--set: --to-hf writes the checkpoint's weights as they are; --set applies to --from-hf")
    ckpt = args.to_hf or args.to_peft
    cfg, step, is_run = model_config(ckpt)
    if args.to_peft and not cfg.lora.rank:
        raise ConvertError(f"--to-peft {ckpt}: its model has no LoRA adapters (model.lora.rank=0)")
    layout = default_layout(cfg, args.mesh or "dp", devices=None if args.mesh else jax.devices()[:1])
    model, step = load_model(ckpt, layout)
    if args.to_peft:
        out = save_adapter(model, args.out, family=args.family)
    else:
        out = to_hf(model, args.out, family=args.family, dtype=args.dtype, max_shard_bytes=args.max_shard_mb << 20)
    print(f"{ckpt} ({'training run, step ' + str(step) if is_run else 'model checkpoint'}) -> {out}")
    return 0
