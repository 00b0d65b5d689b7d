"""``jaxpar generate``: a model's continuation of prompts, streamed to the terminal as it is decoded.

    jaxpar generate --from runs/ft --prompt "Once upon a time" --max-new-tokens 64 --temperature 0.8 --top-p 0.9
    jaxpar generate --from ./Llama-3.2-1B --prompt-ids 128000,791,6460 --max-new-tokens 32 --json
    jaxpar generate --from ckpt/llama1b --prompt "Hi" --prompt "Bye" --max-new-tokens 16 --mesh data=2 --cpu-devices 2

--from is a training run's folder (its newest checkpoint), a model checkpoint (``jaxpar convert``) or a
Hugging Face folder (config.json + *.safetensors, whose eos_token_id ends a row). Prompts are text
(--prompt, encoded with --tokenizer or the tokenizer.json in --from, special tokens such as BOS added as
the tokenizer's template says) or token ids (--prompt-ids), one prompt per flag, all in one batch.

Everything a user can get wrong is refused before a weight is read: the tokenizer file, the prompts
(non-empty, inside the model's vocabulary, prompt + --max-new-tokens within model.max_seq_len), the
sampler flags, and whether --mesh divides the model and the batch. Then the weights are restored straight
onto the decode layout (one device without --mesh). Nothing is written.

Output: one prompt streams its text (or its ids) as tokens arrive; several print ``[i] completion`` as
each row finishes; a one-line summary (time to first token, decode tokens/s) goes to stderr. --json
prints one object instead: tokens, text, times, inter-token latency percentiles and the mesh.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from jaxpar.errors import CheckpointError, ConfigError, ConvertError, DataError, LayoutError
from jaxpar.execution import ExecutionConfig
from jaxpar.inference.layouts import PRESETS as DECODE_PRESETS
from jaxpar.mesh import simulate_cpu_devices
from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.settings import add_set_argument, apply_overrides, positive_int

HELP = "generate text from a run, a model checkpoint or a Hugging Face folder (streamed, or --json)"
TOKENIZER = "tokenizer.json"
PICKLES = (".bin", ".pt", ".pth")
SETTINGS, TAKES = {"execution": ExecutionConfig()}, ("execution.",)  # what --set changes, and where
WHY = " (the model is --from's)"  # why --set takes nothing else


def add_arguments(parser: argparse.ArgumentParser, /) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n")[1]
    parser.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="DIR",
        help="a training run folder, a model checkpoint or a Hugging Face folder",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="FILE",
        help="a tokenizers JSON file (default: tokenizer.json in --from, when there)",
    )
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeatable: one batch)")
    prompts.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help="a prompt as comma-separated token ids, e.g. 1,2,3 (repeatable)",
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, required=True, metavar="N", help="tokens to generate per prompt"
    )
    sampler = parser.add_argument_group("sampling (default: greedy)")
    sampler.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    sampler.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the k most likely tokens (0 = off)")
    sampler.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus: in (0, 1], 1 = off")
    sampler.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        metavar="M",
        help="keep tokens with probability >= M x the largest (0 = off)",
    )
    sampler.add_argument("--seed", type=int, default=0, metavar="S", help="the requests' seed (default 0)")
    parser.add_argument(
        "--stop-ids",
        default=None,
        metavar="IDS",
        help="comma-separated ids that end a row (besides the EOS ids of a Hugging Face folder), e.g. 5,7",
    )
    parser.add_argument(
        "--mesh",
        default=None,
        help=f"a decode layout ({', '.join(DECODE_PRESETS)}), a training preset ({', '.join(MESH_PRESETS)}) "
        "or an axis spec like data=2,tensor=4 (default: one device)",
    )
    parser.add_argument(
        "--cpu-devices", type=positive_int, default=None, metavar="N", help="simulate this many CPU devices"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_set_argument(parser, SETTINGS, TAKES, note=" (defaults: as --from was saved to run; these are the fallbacks)")


def parse_ids(text: str, flag: str) -> list[int]:
    """``"1,2,3"`` -> [1, 2, 3]; spaces allowed, anything else named with its flag."""
    parts = [p.strip() for p in text.split(",")] if text.strip() else []
    for p in parts:
        if not p.lstrip("-").isdigit():
            raise ConfigError(f"{flag} {text!r}: {p!r} is not an integer token id (give ids like 1,2,3)")
    return [int(p) for p in parts]


def source_kind(folder: str) -> str:
    """``"jaxpar"`` (a run folder or model checkpoint: checkpoints/) or ``"hf"`` (config.json + weights)."""
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError(f"--from {path}: " + ("not a directory" if path.exists() else "no such directory"))
    if (path / "checkpoints").is_dir():
        return "jaxpar"
    if (path / "config.json").is_file() and any(p.suffix in (".safetensors", *PICKLES) for p in path.iterdir()):
        return "hf"  # HFFolder explains a folder of pickles
    raise CheckpointError(
        f"--from {path.resolve()}: neither a training run folder (config.json + checkpoints/), a "
        f"model checkpoint (model.json + checkpoints/) nor a Hugging Face folder (config.json + "
        f"*.safetensors)"
    )


def load_tokenizer(flag_value: str | None, folder: str):
    """The ``tokenizers.Tokenizer`` of --tokenizer, else of --from's tokenizer.json, else None."""
    if flag_value is None:
        found = Path(folder) / TOKENIZER
        if not found.is_file():
            return None
        path, flag = found, f"--tokenizer (default: {TOKENIZER} in --from)"
    else:
        path, flag = Path(flag_value), "--tokenizer"
    if not path.is_file():
        raise DataError(f"{flag} {path}: no such file")
    from tokenizers import Tokenizer  # deferred: only when a tokenizer is read

    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise DataError(f"{flag} {path}: not a tokenizers file ({err})") from None


def read_prompts(args: argparse.Namespace, tokenizer) -> list[list[int]]:
    """Every --prompt (encoded) or --prompt-ids (parsed), refused when one is empty."""
    if args.prompt_ids is not None:
        prompts, flag = [parse_ids(p, "--prompt-ids") for p in args.prompt_ids], "--prompt-ids"
    elif tokenizer is None:
        raise DataError(
            f"--prompt needs a tokenizer: give --tokenizer FILE (or put {TOKENIZER} in --from "
            f"{args.source}), or give token ids with --prompt-ids"
        )
    else:
        prompts, flag = [tokenizer.encode(text).ids for text in args.prompt], "--prompt"
    for i, p in enumerate(prompts):
        if not p:
            raise ConfigError(f"{flag} #{i + 1} (prompt {i}): empty; a prompt needs at least one token")
    return prompts


def hf_eos_ids(folder: Path) -> tuple[int, ...]:
    """``eos_token_id`` (one id or a list) of generation_config.json, else of config.json; () if neither."""
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except ValueError as err:
            raise ConvertError(f"{path}: not valid JSON ({err})") from None
        value = data.get("eos_token_id") if isinstance(data, dict) else None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConvertError(f"{path}: eos_token_id={value!r} is neither a token id nor a list of them")
        return tuple(ids)
    return ()


def model_config(kind: str, folder: str):
    """(model config, EOS ids, what --from is) without reading a weight."""
    if kind == "hf":
        from jaxpar.convert import hf_config  # deferred: imports jax, flax and the model zoo

        return hf_config(folder)[0], hf_eos_ids(Path(folder)), "Hugging Face folder"
    from jaxpar.convert.store import model_config as saved_config  # deferred: imports flax and orbax

    try:
        cfg, step, is_run = saved_config(folder)
    except (ConvertError, CheckpointError) as err:
        raise type(err)(f"--from: {err}") from None
    return cfg, (), f"training run, step {step}" if is_run else "model checkpoint"


def check_fit(
    cfg, mesh, name: str, prompts: list[list[int]], max_new: int, stop: list[int], *, flag: str, where: str
) -> None:
    """What ``Generator.generate`` would refuse, refused on the config alone (no weight read yet). The
    prompts' errors name ``flag`` (--prompt or --prompt-ids), the layout's ``where`` (--mesh data=8)."""
    # deferred: jaxpar.inference.generate imports jax, flax and the model zoo
    from jaxpar.inference.generate import check_fit as check_request_fit
    from jaxpar.inference.generate import check_request

    limits = [max_new] * len(prompts)
    try:
        check_request(cfg, prompts, limits)
    except ConfigError as err:
        raise ConfigError(f"{flag}: {err}") from None
    bad = [i for i in stop if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ConfigError(f"--stop-ids: {bad[0]} is outside the vocabulary [0, model.vocab_size={cfg.vocab_size})")
    try:
        check_request_fit(cfg, mesh, name, prompts, limits)
    except LayoutError as err:
        raise LayoutError(f"{where} with a batch of {len(prompts)} prompt(s): {err}") from None


def check_overrides(items: list[str], /, *, command: str) -> None:
    """``--set execution.…`` checked against ``ExecutionConfig()`` before any work (``jaxpar.settings``)."""
    apply_overrides(SETTINGS, items, command=command, takes=TAKES, why=WHY)


def load_weights(kind: str, folder: str, cfg, mesh, name: str, overrides: list[str] = ()):
    """The model, restored onto the decode layout (a jaxpar checkpoint) or onto one device (HF), run
    as it was saved to run (or as its family's HF implementation runs) with ``--set`` ``overrides``."""
    # deferred: these import jax, flax and the model zoo
    from jaxpar.convert import from_hf
    from jaxpar.convert.store import load_model
    from jaxpar.inference.generate import with_execution
    from jaxpar.inference.layouts import weight_layout

    # HF: on one device; the Generator reshards it onto the decode layout
    model = from_hf(folder) if kind == "hf" else load_model(folder, weight_layout(cfg, mesh, name))[0]
    if not overrides:
        return model
    settings = apply_overrides({"execution": model.execution}, overrides, command="generate", takes=TAKES, why=WHY)
    return with_execution(model, settings["execution"])


class Stream:
    """``on_tokens`` for ``Generator.generate``: prints each row's tokens as they reach the host. One
    prompt: its text grows in place (the whole completion decoded again, the new suffix printed; held
    back while it ends in an incomplete UTF-8 character). Several: ``[i] completion`` when row i ends."""

    def __init__(self, prompts, max_new: int, stops: list[set], tokenizer):
        self.rows = [[] for _ in prompts]
        self.max_new, self.stops, self.tokenizer = max_new, stops, tokenizer
        self.shown, self.printed = "", set()

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else " ".join(map(str, ids))

    def __call__(self, step: int, tokens, done) -> None:
        for i, token in enumerate(tokens.tolist()):
            if done[i]:  # finished before this step: its token is padding
                continue
            self.rows[i].append(token)
            if len(self.rows) == 1:
                self._grow(self.text(self.rows[0]), final=False)
            elif token in self.stops[i] or len(self.rows[i]) >= self.max_new:
                self._finish(i, self.rows[i])

    def _grow(self, text: str, *, final: bool) -> None:
        if text.startswith(self.shown) and (final or not text.endswith("\ufffd")):
            print(text[len(self.shown) :], end="", flush=True)
            self.shown = text
        elif final:  # the decoder rewrote text already shown: the final one whole
            print("\n" + text, end="", flush=True)
            self.shown = text

    def _finish(self, i: int, ids: list[int]) -> None:
        print(f"[{i}] {self.text(ids)}", flush=True)
        self.printed.add(i)

    def close(self, tokens: list[list[int]]) -> None:
        """Whatever the result holds that was not printed yet (``tokens`` is authoritative)."""
        if len(self.rows) > 1:
            for i in sorted(set(range(len(tokens))) - self.printed):
                self._finish(i, tokens[i])
            return
        if self.text(tokens[0]) != self.shown:
            self._grow(self.text(tokens[0]), final=True)
        print(flush=True)


def run(args: argparse.Namespace, /) -> int:
    check_overrides(args.overrides, command="generate")
    if args.cpu_devices:
        simulate_cpu_devices(args.cpu_devices)
    # deferred: jax, flax and the model zoo, imported once the simulated devices are set
    import jax

    from jaxpar.inference.generate import Generator
    from jaxpar.inference.layouts import build_inference_mesh
    from jaxpar.inference.sampling import SamplingParams

    kind = source_kind(args.source)
    tokenizer = load_tokenizer(args.tokenizer, args.source)
    prompts = read_prompts(args, tokenizer)
    stop = parse_ids(args.stop_ids, "--stop-ids") if args.stop_ids is not None else []
    sampling = SamplingParams.make(
        len(prompts), temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed
    )
    cfg, eos, what = model_config(kind, args.source)
    name, mesh = build_inference_mesh(args.mesh or "decode_dp", devices=None if args.mesh else jax.devices()[:1])
    check_fit(
        cfg,
        mesh,
        name,
        prompts,
        args.max_new_tokens,
        stop,
        flag="--prompt-ids" if args.prompt is None else "--prompt",
        where=f"--mesh {args.mesh}" if args.mesh else "one device",
    )
    gen = Generator(load_weights(kind, args.source, cfg, mesh, name, args.overrides), args.mesh, eos_ids=eos)
    stream = (
        None if args.json else Stream(prompts, args.max_new_tokens, [gen.eos_ids | set(stop)] * len(prompts), tokenizer)
    )
    result = gen.generate(
        prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, stop_ids=[stop] * len(prompts), on_tokens=stream
    )
    mesh_info = {
        "layout": gen.mesh_name,
        "axes": {a: n for a, n in gen.mesh.shape.items() if n > 1},
        "devices": int(gen.mesh.size),
    }
    if args.json:
        report = result.to_json()
        if tokenizer is not None:
            report["text"] = [tokenizer.decode(t) for t in result.tokens]
        print(json.dumps(report | {"mesh": mesh_info, "from": {"path": str(args.source), "kind": what}}))
        return 0
    stream.close(result.tokens)
    where = ",".join(f"{a}={n}" for a, n in mesh_info["axes"].items()) or "one device"
    print(
        f"{sum(map(len, result.tokens))} tokens for {len(prompts)} prompt(s) from {what}; time to first token "
        f"{result.time_to_first_token_s * 1e3:.1f} ms, decode {result.decode_tokens_per_s:.1f} tokens/s "
        f"(compile {result.compile_s:.1f} s; {gen.mesh_name}: {where})",
        file=sys.stderr,
    )
    return 0
