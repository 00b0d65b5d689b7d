"""``--set PATH=VALUE``: the one grammar every command speaks, with one parser and one "did you mean".

A path is dotted: ``model.num_layers``, ``execution.remat``, ``pipeline.microbatches``,
``optimizer.learning_rate``. The root it walks is a config dataclass (``jaxpar train``'s ``TrainConfig``)
or a dict of sections (``{"execution": ExecutionConfig()}`` for ``jaxpar generate``). A command says which
paths it takes (``takes``: prefixes such as ``("model.", "execution.")``); a path outside them is refused
with the list of what the command does take, a path inside them that names no field with the closest
known one. Every value is parsed by its field's annotated type (int, float, str, bool, ``Choice`` enums,
``X | None`` where ``none`` means None), and the config's own checks run as each value is set, so the
message names the path and the value. ``describe`` lists the paths a command takes, with their
defaults, for its ``--help``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import typing
from collections.abc import Callable, Sequence
from typing import Any

from jaxpar.config import Choice, WeightFormat, config_classes, hints, is_union, to_dict
from jaxpar.errors import ConfigError

Refuse = Callable[[str], "str | None"]  # a path -> why it cannot be set (renamed, moved), or None


def field_paths(obj, prefix: str = "") -> dict[str, Any]:
    """Every settable leaf path → its annotated type. ``obj`` is a config, a config class or a dict of
    sections; nested dataclasses are walked by their actual class when ``obj`` is an instance (so an MoE
    model's ``model.moe.top_k`` is settable while a dense model has no ``model.moe``)."""
    if isinstance(obj, dict):
        return {p: tp for name, value in obj.items() for p, tp in field_paths(value, f"{prefix}{name}.").items()}
    out = {}
    cls = obj if isinstance(obj, type) else type(obj)
    for name, tp in hints(cls).items():
        value = None if isinstance(obj, type) else getattr(obj, name)
        inner = type(value) if dataclasses.is_dataclass(value) else _dataclass_in(tp)
        if inner is not None:
            out.update(field_paths(value if dataclasses.is_dataclass(value) else inner, f"{prefix}{name}."))
        else:
            out[prefix + name] = tp
    return out


def _dataclass_in(tp):
    classes = config_classes(tp)
    return classes[0] if classes else None


def parse_value(path: str, tp, text: str):
    """``text`` as a value of type ``tp``; ``ConfigError`` naming ``path`` if it is not one."""
    if is_union(tp):
        if type(None) in typing.get_args(tp) and text.lower() in ("none", "null"):
            return None
        errors = []
        for a in (a for a in typing.get_args(tp) if a is not type(None)):
            try:
                return parse_value(path, a, text)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0])
    if tp is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"--set {path}={text}: expected true or false")
    if isinstance(tp, type) and issubclass(tp, Choice):
        return tp.parse(text, field=f"--set {path}")
    if tp in (int, float, str):
        try:
            value = tp(text)
        except ValueError:
            raise ConfigError(f"--set {path}={text}: expected {tp.__name__}") from None
        if tp is float and not math.isfinite(value):
            raise ConfigError(f"--set {path}={text}: expected a finite number")
        return value
    raise ConfigError(f"--set {path}: fields of type {tp} cannot be set from the command line")


def _replace(obj, parts: list[str], value):
    head, rest = parts[0], parts[1:]
    child = obj[head] if isinstance(obj, dict) else getattr(obj, head)
    if rest and child is None:
        raise ConfigError(f"--set {'.'.join(parts)}: {head} is None here; it has no fields to set")
    new = _replace(child, rest, value) if rest else value
    return {**obj, head: new} if isinstance(obj, dict) else dataclasses.replace(obj, **{head: new})


def closest(path: str, paths) -> str:
    """``; did you mean X?`` for the known path nearest ``path`` (whole, or by its last part), or ``''``."""
    leaves = {p.rsplit(".", 1)[-1]: p for p in paths}
    match = difflib.get_close_matches(path, list(paths), n=1, cutoff=0.6) or [
        leaves[m] for m in difflib.get_close_matches(path.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=0.6)
    ]
    return f"; did you mean {match[0]}?" if match else ""


def _takes_text(takes: Sequence[str]) -> str:
    return ", ".join(t + "<field>" if t.endswith(".") else t for t in takes)


def split_item(item: str, /) -> tuple[str, str]:
    """``"a.b=1"`` → ``("a.b", "1")``; refused without ``=`` or without a path."""
    path, sep, text = item.partition("=")
    if not sep or not path.strip():
        raise ConfigError(f"--set {item!r}: expected PATH=VALUE, e.g. model.num_layers=4")
    return path.strip(), text.strip()


def apply_overrides(
    root, items: Sequence[str], /, *, command: str, takes: Sequence[str] = ("",), why: str = "", refuse: Refuse = None
):
    """``root`` with each ``path=value`` of ``items`` applied in order. ``command`` names the command
    whose ``--help`` lists the paths; ``takes`` the path prefixes it accepts (``why``: the reason it takes
    no others); ``refuse`` gives the message for a path that moved or was renamed."""
    every = field_paths(root)
    paths = {p: tp for p, tp in every.items() if p.startswith(tuple(takes))}
    for item in items:
        path, text = split_item(item)
        why_not = refuse(path) if refuse is not None else None
        if why_not:
            raise ConfigError(f"--set {path}: {why_not}")
        if not path.startswith(tuple(takes)):
            hint = "" if path in every else closest(path, paths)  # a field it does not take: no near miss
            raise ConfigError(f"--set {path}: jaxpar {command} takes {_takes_text(takes)}{why}{hint}")
        if path not in paths:
            raise ConfigError(
                f"--set {path}: unknown field{closest(path, paths)} (`jaxpar {command} --help` lists them)"
            )
        value = parse_value(path, paths[path], text)
        try:
            root = _replace(root, path.split("."), value)
        except (ValueError, TypeError) as err:  # a config's own check: prefix where the value came from
            if str(err).startswith("--set "):
                raise
            raise ConfigError(f"--set {path}={text}: {err}") from None
    return root


def describe(root, takes: Sequence[str] = ("",)) -> str:
    """The paths under ``takes`` with their values in ``root`` (the defaults), one per line, for ``--help``."""
    data = to_dict(root) if not isinstance(root, dict) else {k: to_dict(v) for k, v in root.items()}
    lines = []
    for path in (p for p in field_paths(root) if p.startswith(tuple(takes))):
        value = data
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        lines.append(f"  {path} = {value!r}")
    return "\n".join(lines)


def add_set_argument(parser: argparse.ArgumentParser, root, takes: Sequence[str] = ("",), *, note: str = "") -> None:
    """``--set`` (dest ``overrides``, repeatable) on ``parser``, and the paths it takes with their values
    in ``root`` at the end of its ``--help`` (``note``: what those values are, e.g. "for --model tiny")."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    listing = f"fields for --set{note}:\n" + describe(root, takes)
    parser.epilog = f"{parser.epilog}\n\n{listing}" if parser.epilog else listing
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help=f"set a field by its dotted path (repeatable): {_takes_text(takes) or 'any field'}, listed below",
    )


def changed(new, old) -> dict:
    """The fields of dataclass ``new`` whose values differ from ``old``'s."""
    fields = (f.name for f in dataclasses.fields(new))
    return {name: getattr(new, name) for name in fields if getattr(new, name) != getattr(old, name)}


def add_quantize_argument(parser: argparse.ArgumentParser, /, *, when: str) -> None:
    """``--quantize int8|int4|fp8``, the stored weights' format (``model.quantize``), for ``when``."""
    parser.add_argument(
        "--quantize",
        choices=[k.value for k in WeightFormat if k != WeightFormat.NONE],
        default=None,
        help=f"{when}: the projections stored int8 (per channel), int4 (groups of 128) or fp8 (128×128 blocks) "
        "(= --set model.quantize=...)",
    )


def positive_int(text: str) -> int:
    """An argparse ``type``: a positive integer, else a usage error that quotes the text."""
    value = int(text) if text.strip().isdecimal() and text.strip().isascii() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value
