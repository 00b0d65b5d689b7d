"""The errors jaxpar raises for things a user can fix, each named for what went wrong.

Every one of them is a ``JaxparError``: the ``jaxpar`` command prints its message (which names the field,
flag, file or mesh axis, and the numbers) and exits with status 2, before anything is written. The one
exception is ``NonFiniteError``, raised *during* a run: the run failed, so the command exits with 1.

    ConfigError      a configuration value: out of range, not one of the choices, a field that does not exist
    MeshError        a mesh that cannot be built from the devices there are
    LayoutError      a model, batch and mesh that do not fit together, or a model traced on a multi-device
                     mesh without its layout (``NoLayoutError``)
    DataError        token files, tokenizers, data settings
    CheckpointError  a run directory or checkpoint this run cannot use (another model, another data stream)
    ConvertError     a Hugging Face folder or export that cannot be converted
    LaunchError      the multi-process flags and environment (``--coordinator``, ``--process-id``, ...)
    NonFiniteError   a step produced a NaN or inf loss or gradient norm
"""

from __future__ import annotations

import difflib


class JaxparError(Exception):
    """An error the user can act on; the message says what to change."""


class ConfigError(JaxparError, ValueError):
    """A configuration value the user can fix; the message names the field."""


class MeshError(JaxparError, ValueError):
    """A mesh that cannot be built: the message names the field, the axis and the numbers."""


class LayoutError(JaxparError, ValueError):
    """A model, batch and mesh that do not fit together. The message names field, axis and numbers."""


class NoLayoutError(LayoutError):
    """A model traced on a multi-device mesh without its layout: it would run without sharding
    constraints and with the one-device attention and MoE paths. The message says what to call."""


class DataError(JaxparError, ValueError):
    """Bad data input; the message names the file, the field or the token."""


class CheckpointError(JaxparError):
    """A checkpoint or run directory this run cannot use; the message lists every field that differs."""


class ConvertError(JaxparError):
    """A Hugging Face folder or export that cannot be converted; the message names the field or file."""


class LaunchError(JaxparError):
    """Multi-process launch settings that cannot work; the message names the flag or variable."""


class NonFiniteError(JaxparError, ArithmeticError):
    """A step produced a NaN or inf loss or gradient norm (the message names the step)."""


def suggest(word: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` (case-insensitive), or ``''``: the hint a
    message about an unknown name ends with."""
    by_lower = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""
