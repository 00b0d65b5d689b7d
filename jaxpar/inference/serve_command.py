"""``jaxpar serve``: an OpenAI-compatible HTTP server over continuous-batching engine replicas.

    jaxpar serve --from runs/ft --tokenizer tokenizer.json --port 8000
    jaxpar serve --from ./Llama-3.2-1B --mesh decode_tp --replicas 2 --memory-budget 8GiB
    jaxpar serve --from ckpt/tiny --cpu-devices 4 --replicas 4 --port 0      # port 0: any free port
    jaxpar serve --from ./Llama-3.2-1B --adapter sql=adapters/sql --adapter chat=adapters/chat

--from is what ``jaxpar generate`` reads (a run folder, a model checkpoint or a Hugging Face folder); the
tokenizer is --tokenizer or tokenizer.json in --from, and its chat template (``chat_template.jinja`` or
``tokenizer_config.json`` beside it, or --chat-template) enables /v1/chat/completions. The devices are
split into --replicas equal groups; each group runs one engine on --mesh (default: one device each).
Every option is checked before a weight is read; the engines compile every shape before the port opens.
The server prints ``listening on http://HOST:PORT`` to stderr when it is ready. SIGTERM (or Ctrl-C)
stops new requests (503), completes those in flight (for at most --shutdown-timeout seconds, then
aborts them) and exits 0. The limits a client meets are flags with defaults (``jaxpar.inference.limits``).
Binding an address other than loopback needs --api-key (or JAXPAR_API_KEY), or --insecure.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import socket
import sys
from pathlib import Path

from jaxpar.errors import ConfigError, DataError
from jaxpar.inference.command import (
    SETTINGS,
    TAKES,
    TOKENIZER,
    check_overrides,
    load_tokenizer,
    load_weights,
    model_config,
    source_kind,
)
from jaxpar.inference.layouts import PRESETS as DECODE_PRESETS
from jaxpar.inference.limits import Limits
from jaxpar.mesh import simulate_cpu_devices
from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.settings import add_set_argument, positive_int

HELP = "serve a model over an OpenAI-compatible HTTP API (continuous batching, paged KV cache)"
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?(?:[iI]?[bB])?)\s*", text)
    if not m or m.group(2).lower() not in UNITS and m.group(2).lower()[:-1] not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 2GiB, 500MB or 1000000")
    unit = m.group(2).lower()
    scale = UNITS.get(unit) or UNITS[unit[:-1]]
    return int(float(m.group(1)) * scale)


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
        "--tokenizer", default=None, metavar="FILE", help="a tokenizers JSON file (default: tokenizer.json in --from)"
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template (default: the one beside the tokenizer, if any)",
    )
    parser.add_argument("--model-name", default=None, help="the model id clients send (default: --from's folder name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--mesh",
        default=None,
        help=f"each replica's decode layout ({', '.join(DECODE_PRESETS)}), a training preset "
        f"({', '.join(MESH_PRESETS)}) or axis sizes like tensor=2 (default: one device per replica)",
    )
    parser.add_argument("--replicas", type=positive_int, default=1, help="engine replicas (data parallel)")
    parser.add_argument("--cpu-devices", type=positive_int, default=None, metavar="N", help="simulate N CPU devices")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--max-slots", type=positive_int, default=8, help="sequences decoding at once per replica")
    engine.add_argument("--page-size", type=positive_int, default=16, help="positions per KV page")
    engine.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="positions per sequence (default: model.max_seq_len, at most 4096)",
    )
    engine.add_argument(
        "--memory-budget",
        type=_bytes,
        default=None,
        metavar="SIZE",
        help="bytes for each replica's KV pages, e.g. 4GiB (default: every slot at max length)",
    )
    engine.add_argument("--chunk", type=positive_int, default=64, help="prompt chunk (prefill) size")
    engine.add_argument("--speculate", type=int, default=0, metavar="K", help="speculative guesses per step (0 = off)")
    engine.add_argument("--draft", default=None, metavar="DIR", help="a draft model (same vocabulary) for --speculate")
    engine.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a LoRA adapter (a PEFT folder) served beside the base model; a request's model NAME picks it "
        "(repeatable; one batch mixes adapters)",
    )
    access = parser.add_argument_group("access")
    access.add_argument(
        "--api-key",
        default=os.environ.get("JAXPAR_API_KEY"),
        metavar="KEY",
        help="clients send 'Authorization: Bearer KEY' on /v1/* (default: $JAXPAR_API_KEY; none: open)",
    )
    access.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    limits = parser.add_argument_group("limits (each request alone; the status over the limit in docs/serving.md)")
    for name, field, kind, default, text in Limits.flags():
        limits.add_argument(name, dest=field, type=kind, default=default, help=f"{text} (default {default})")
    add_set_argument(parser, SETTINGS, TAKES, note=" (defaults: as --from was saved to run; these are the fallbacks)")


def check_args(args, cfg) -> tuple[int, int]:
    """(max_length, device group size): everything the engines would refuse, refused from the config."""
    # deferred: jax, and modules that import it and the model zoo
    import jax

    from jaxpar.inference.placement import engine_layout

    max_length = args.max_length or min(cfg.max_seq_len, 4096)
    max_length -= max_length % args.page_size
    if not 0 < max_length <= cfg.max_seq_len:
        raise ConfigError(
            f"--max-length {args.max_length}: must be in [--page-size={args.page_size}, "
            f"model.max_seq_len={cfg.max_seq_len}]"
        )
    if not 0 <= args.port < 65536:
        raise ConfigError(f"--port {args.port}: not a port number (0 … 65535)")
    check_access(args.host, args.api_key, args.insecure)
    limits(args)
    if args.speculate < 0 or (args.draft and not args.speculate):
        raise ConfigError(f"--speculate {args.speculate}: must be ≥ 0, and > 0 with --draft")
    devices = jax.devices()
    if len(devices) % args.replicas:
        raise ConfigError(
            f"--replicas {args.replicas} does not divide the {len(devices)} devices "
            f"(--cpu-devices simulates more on CPU)"
        )
    group = len(devices) // args.replicas if args.mesh else 1
    engine_layout(cfg, args.mesh, devices[:group], slots=args.max_slots, length=max_length, flag="--mesh")
    check_adapters(args, cfg)
    return max_length, group


def served_name(args) -> str:
    """The model id clients send for the base model."""
    return args.model_name or Path(args.source).resolve().name


def check_adapters(args, cfg) -> dict[str, str]:
    """--adapter NAME=DIR, each a PEFT folder for this model (its config checked, no weight read); the
    names distinct and none the base model's. Returns {name: folder}."""
    from jaxpar.convert import ConvertError, adapter_config  # deferred: imports jax, flax and the model zoo

    out = {}
    for spec in args.adapters:
        name, sep, folder = spec.partition("=")
        if not sep or not name.strip() or not folder or name != name.strip():
            raise ConfigError(f"--adapter {spec!r}: give NAME=DIR (a name clients send as model, a PEFT folder)")
        if name in out or name == served_name(args):
            raise ConfigError(f"--adapter {spec!r}: the name {name!r} is already served; give each its own")
        try:
            adapter_config(folder, cfg)
        except ConvertError as err:
            raise ConfigError(f"--adapter {spec!r}: {err}") from None
        out[name] = folder
    return out


def check_access(host: str, api_key: str | None, insecure: bool) -> None:
    """A server reachable from other machines needs an API key, or --insecure said on purpose."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not api_key and not insecure:
        raise ConfigError(
            f"--host {host}: other machines could reach this server; give --api-key (or JAXPAR_API_KEY), "
            "or --insecure to serve without one"
        )
    if api_key is not None and not api_key.strip():
        raise ConfigError("--api-key: empty")


def limits(args) -> Limits:
    """The ``Limits`` of the command line."""
    return Limits(**{field: getattr(args, field) for _, field, _, _, _ in Limits.flags()})


def check_budget(cfg, args, max_length: int) -> None:
    """--memory-budget must hold one sequence of max_length positions: checked on the abstract model."""
    # deferred: jax, flax and modules that import them
    from flax import nnx

    from jaxpar.inference.generate import for_generation
    from jaxpar.inference.placement import pages_for_budget
    from jaxpar.models import build_model

    if args.memory_budget is not None:
        abstract = for_generation(nnx.eval_shape(lambda: build_model(cfg, rngs=nnx.Rngs(0))))
        try:
            pages_for_budget(abstract, args.page_size, args.memory_budget, max_length)
        except ConfigError as err:
            raise ConfigError(f"--memory-budget: {err}") from None


def tokenizer_eos(tokenizer, special: dict, eos) -> tuple[int, ...]:
    """The tokenizer's own end token (``eos_token`` of tokenizer_config.json, e.g. a chat template's
    end-of-turn ``<|im_end|>``) as one more EOS id, when the model's files name another or none: a model
    fine-tuned on chat (``jaxpar train --init-from``) and exported ends its replies with it."""
    found = tokenizer.token_to_id(special["eos_token"]) if "eos_token" in special else None
    return () if found is None or found in eos else (found,)


def build_service(args, cfg, eos, kind: str, tokenizer, tokenizer_file):
    # deferred: jax, and modules that import it, the model zoo and the HTTP stack
    import jax

    from jaxpar.chat import load_chat_template
    from jaxpar.inference.adapters import read_peft
    from jaxpar.inference.api import Parser
    from jaxpar.inference.engine import Engine
    from jaxpar.inference.layouts import build_inference_mesh
    from jaxpar.inference.server import Service

    max_length, group = check_args(args, cfg)
    check_budget(cfg, args, max_length)
    template, special = load_chat_template(tokenizer_file, args.chat_template)
    eos = tuple(eos) + tokenizer_eos(tokenizer, special, eos)
    parser = Parser(
        model_name=served_name(args),
        adapters=[spec.partition("=")[0] for spec in args.adapters],
        vocab_size=cfg.vocab_size,
        max_length=max_length,
        tokenizer=tokenizer,
        chat_template=template,
        special_tokens=special,
        limits=limits(args),
    )
    name, mesh = build_inference_mesh("decode_dp", devices=jax.devices()[:1])
    model = load_weights(kind, args.source, cfg, mesh, name, args.overrides)
    adapters = [read_peft(name, folder, model) for name, folder in check_adapters(args, cfg).items()]
    draft = load_draft(args.draft, args.overrides) if args.draft else None
    engines = []
    for r in range(args.replicas):
        devices = jax.devices()[r * group : (r + 1) * group]
        engine = Engine(
            model,
            max_slots=args.max_slots,
            page_size=args.page_size,
            max_length=max_length,
            memory_budget=args.memory_budget,
            chunk=args.chunk,
            speculate=args.speculate,
            draft=draft,
            mesh=args.mesh,
            devices=devices,
            adapters=adapters,
        )
        engine.warm_up()
        engines.append(engine)
    return Service(
        engines,
        parser,
        tokenizer=tokenizer,
        eos_ids=eos,
        page_size=args.page_size,
        limits=limits(args),
        api_key=args.api_key,
    )


def load_draft(folder: str, overrides: list[str]):
    """The draft model of --draft, on one device (the engine places it beside the target)."""
    # deferred: jax, and a module that imports it
    import jax

    from jaxpar.inference.layouts import build_inference_mesh

    kind = source_kind(folder)
    cfg, _, _ = model_config(kind, folder)
    name, mesh = build_inference_mesh("decode_dp", devices=jax.devices()[:1])
    return load_weights(kind, folder, cfg, mesh, name, overrides)


def serve(service, host: str, port: int) -> int:
    """Run uvicorn on ``host:port`` until SIGTERM/SIGINT; the engines drain before it returns 0."""
    # deferred: the HTTP stack, and a module that imports jax
    import uvicorn

    from jaxpar.inference.server import build_app

    app = build_app(service)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(
        app,
        log_level="warning",
        limit_concurrency=service.limits.max_connections,
        timeout_graceful_shutdown=service.limits.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    original = server.handle_exit

    def on_signal(sig, frame):  # stop taking requests at once; uvicorn waits for the rest
        if not service.draining:
            print(
                f"jaxpar serve: {signal.Signals(sig).name}: finishing {sum(w.load for w in service.workers)} "
                f"sequence(s) in flight, taking no new requests",
                file=sys.stderr,
                flush=True,
            )
        service.draining = True
        original(sig, frame)

    server.handle_exit = on_signal
    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn raises the signal again once it has drained:
        signal.signal(sig, lambda *_: None)  # by then the work is done, and the exit status is 0
    print(f"jaxpar serve: listening on http://{host}:{sock.getsockname()[1]}", file=sys.stderr, flush=True)
    server.run(sockets=[sock])
    return 0


def run(args: argparse.Namespace, /) -> int:
    check_overrides(args.overrides, command="serve")
    if args.cpu_devices:
        simulate_cpu_devices(args.cpu_devices)
    kind = source_kind(args.source)
    tokenizer = load_tokenizer(args.tokenizer, args.source)
    if tokenizer is None:
        raise DataError(f"--tokenizer: none given and no {TOKENIZER} in --from {args.source}; the API speaks text")
    tokenizer_file = args.tokenizer or str(Path(args.source) / TOKENIZER)
    cfg, eos, _ = model_config(kind, args.source)
    service = build_service(args, cfg, eos, kind, tokenizer, tokenizer_file)
    return serve(service, args.host, args.port)
