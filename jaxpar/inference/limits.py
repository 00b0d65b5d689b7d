"""What one client may ask of ``jaxpar serve``: every limit, its flag, its default and the status that
answers a request over it.

``Limits`` is the one list. ``jaxpar serve`` makes a flag of each field (``--max-body-bytes`` ...), the
server and the request parser read them from here, and the documentation renders its table of limits
from ``Limits.table()``. A limit holds for each request alone; none of them can fail another request or
an engine.
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import ConfigError


def _limit(default, answer: str, text: str):
    return dataclasses.field(default=default, metadata={"answer": answer, "help": text})


@dataclasses.dataclass(frozen=True)
class Limits:
    """The limits of one server (module doc). Sizes in bytes or characters, times in seconds."""

    # 1 MiB holds 16 prompts of 4,096 token ids, or the longest text; json.loads of 1 MiB holds the GIL
    # ~20 ms on a 2-core CPU (4 MiB: ~80 ms), and /health must answer within 50 ms meanwhile
    max_body_bytes: int = _limit(2**20, "413", "request body size, from Content-Length and while it streams in")
    body_timeout: float = _limit(30.0, "408", "seconds to receive a request's whole body")
    max_text_chars: int = _limit(262_144, "400", "characters of text in a prompt or the messages, before tokenizing")
    max_stops: int = _limit(4, "400", "stop strings per request")
    max_stop_chars: int = _limit(1024, "400", "characters per stop string")
    max_user_chars: int = _limit(256, "400", "characters of `user` (the router keeps only its hash)")
    max_choices: int = _limit(16, "400", "choices per request: prompts × n")
    max_pending: int = _limit(256, "429, Retry-After", "choices queued or running over all replicas")
    max_connections: int = _limit(512, "503", "open connections (uvicorn's limit_concurrency)")
    request_timeout: float = _limit(600.0, "504", "seconds from a request's arrival to its last token")
    stall_timeout: float = _limit(
        60.0, "replica skipped, /health 503", "seconds a replica may hold work without finishing a step"
    )
    shutdown_timeout: float = _limit(30.0, "requests aborted", "seconds SIGTERM waits for the requests in flight")

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{flag(f.name)} {value!r}: must be a number > 0")

    @staticmethod
    def flags() -> list[tuple[str, str, type, object, str]]:
        """(flag, field, type, default, help) of every limit, for the command line."""
        types = {"int": int, "float": float}
        fields = dataclasses.fields(Limits)
        return [(flag(f.name), f.name, types[f.type], f.default, f.metadata["help"]) for f in fields]

    @staticmethod
    def table() -> list[tuple[str, object, str, str]]:
        """(flag, default, the answer over it, what it bounds) of every limit, for the documentation."""
        return [(flag(f.name), f.default, f.metadata["answer"], f.metadata["help"]) for f in dataclasses.fields(Limits)]


def flag(field: str) -> str:
    """The command-line flag of a limit: ``max_body_bytes`` -> ``--max-body-bytes``."""
    return "--" + field.replace("_", "-")
