"""What every config dataclass of jaxpar shares: string choices as enums checked when the config is
built, and one serializer to and from JSON-ready data.

Choices. A field typed with a ``Choice`` (a ``StrEnum``) accepts the enum or its string; ``check_choices``
(called by each config's ``__post_init__``) turns the string into the enum and refuses anything else with
a ``ConfigError`` naming the field and the choices. A ``StrEnum`` is a ``str``, so ``cfg.router ==
"sigmoid"`` and ``jnp.dtype(cfg.dtype)`` keep working.

Serialization. ``to_dict(cfg)`` gives plain JSON data; ``from_dict(Type, data)`` rebuilds the same object.
Where a field's type admits more than one config class — ``TrainConfig.model`` holds a ``DenseConfig`` or
any family that extends it, ``rope_scaling`` a ``RopeScaling`` or a ``YarnScaling`` — the data carries the
class name under ``"class"``, so a Mixture-of-Experts config comes back as one. Data written before the
tag existed is read by the smallest class whose fields cover its keys.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any

from jaxpar.errors import ConfigError, suggest

CLASS_KEY = "class"


class Choice(enum.StrEnum):
    """A string choice of a config field."""

    @classmethod
    def parse(cls, value, /, *, field: str):
        """``value`` (the enum or its string) as a member; ``ConfigError`` naming ``field`` otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            hint = suggest(value, [c.value for c in cls]) if isinstance(value, str) else ""
            raise ConfigError(f"{field}={value!r}: choose one of {', '.join(c.value for c in cls)}{hint}") from None


class DType(Choice):
    """A floating-point dtype of parameters or computation."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class WeightFormat(Choice):
    """How a model stores its projections for serving (``jaxpar.layers.codes``)."""

    NONE = "none"  # the parameter dtype
    INT8 = "int8"  # per output channel
    INT4 = "int4"  # groups of 128 along the input
    FP8 = "fp8"  # e4m3 in 128 × 128 blocks


# ------------------------------------------------------------------------------------------ types
@functools.cache
def hints(cls) -> dict[str, Any]:
    """The resolved annotations of a dataclass."""
    return typing.get_type_hints(cls)


def is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def members(tp) -> tuple:
    """The types a hint admits: the union's members, or the hint itself."""
    return typing.get_args(tp) if is_union(tp) else (tp,)


def choice_in(tp) -> type[Choice] | None:
    return next((t for t in members(tp) if isinstance(t, type) and issubclass(t, Choice)), None)


def _subclasses(cls) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


def config_classes(tp) -> list[type]:
    """The config classes a hint admits: its dataclasses and every subclass of them."""
    out = []
    for t in members(tp):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            out += [c for c in _subclasses(t) if c not in out]
    return out


def check_choices(obj, section: str, /) -> None:
    """Turns every ``Choice`` field of the frozen dataclass ``obj`` from its string into the enum;
    ``ConfigError`` naming ``section.field`` for a value that is not a choice."""
    for name, tp in hints(type(obj)).items():
        choice, value = choice_in(tp), getattr(obj, name)
        if choice is not None and value is not None:
            object.__setattr__(obj, name, choice.parse(value, field=f"{section}.{name}" if section else name))


# ---------------------------------------------------------------------------------- serialization
def to_dict(obj, hint=None, /) -> Any:
    """``obj`` as JSON data: dataclasses as dicts (tagged with ``"class"`` where ``hint`` admits several
    config classes), enums as their values, tuples as lists."""
    if dataclasses.is_dataclass(obj):
        fields = hints(type(obj))
        out = {f.name: to_dict(getattr(obj, f.name), fields[f.name]) for f in dataclasses.fields(obj)}
        if hint is not None and len(config_classes(hint)) > 1:
            out = {CLASS_KEY: type(obj).__name__, **out}
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(x) for x in obj]
    return obj


def from_dict(hint, data, /, *, where: str = "config") -> Any:
    """Inverse of ``to_dict``: ``data`` read as a value of type ``hint``. Unknown or missing fields raise
    ``ConfigError`` naming them (``where`` is the dotted path for messages)."""
    if data is None or not isinstance(data, (dict, list)):
        return data
    if isinstance(data, list):
        return tuple(data) if any(typing.get_origin(t) is tuple for t in members(hint)) else data
    classes = config_classes(hint)
    if not classes:
        return data
    cls = _pick_class(classes, data, where)
    fields = hints(cls)
    values = {k: v for k, v in data.items() if k != CLASS_KEY}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)} for {cls.__name__}")
    try:
        return cls(**{k: from_dict(fields[k], v, where=f"{where}.{k}") for k, v in values.items()})
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{where}: {cls.__name__} {err}") from None


def _pick_class(classes: list[type], data: dict, where: str) -> type:
    tag = data.get(CLASS_KEY)
    by_name = {c.__name__: c for c in classes}
    if tag is not None:
        if tag not in by_name:
            raise ConfigError(f"{where}.{CLASS_KEY}={tag!r}: expected one of {', '.join(by_name)}")
        return by_name[tag]
    keys = set(data)
    covering = [c for c in classes if keys <= {f.name for f in dataclasses.fields(c)}]
    if not covering:
        known = {f.name for c in classes for f in dataclasses.fields(c)}
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(sorted(keys - known)) or '(none)'}; the fields "
            f"fit none of {', '.join(by_name)}"
        )
    return min(covering, key=lambda c: len(dataclasses.fields(c)))
