"""The OpenAI-compatible request format: parsing and validation (the JSON that goes back is built in
``jaxpar.inference.responses``).

``Parser`` turns the body of a ``/v1/completions`` or ``/v1/chat/completions`` request into a ``Job``
(token ids, limits, sampling settings) or raises ``APIError``, which the server sends as OpenAI's error
object with status 400 (the engine never sees a bad request). Refused, each with the field named:

* a body that is not UTF-8, not JSON (NaN and Infinity included), nested too deep, or not a JSON object;
  a field this server does not know or does not implement (``logit_bias``, ``best_of``, ...); a model
  other than the one served or one of its adapters (``--adapter``);
* a prompt that is empty, not text or token ids, outside the vocabulary, holds a lone surrogate (not
  encodable as UTF-8), or is too long for the cache ever to hold (``max_length`` positions per sequence);
* ``max_tokens`` that is not a positive integer or does not fit beside the prompt in the cache;
* sampling settings that are not finite or out of range (``temperature`` in [0, 2], ``top_p`` in (0, 1],
  ``min_p`` in [0, 1], ``top_k`` ≥ 0, ``seed`` in [0, 2**32), the one seed range of the engine);
* log-prob and penalty settings out of range or not finite (``Parser._scoring``): ``logprobs`` an
  integer in [0, 20] (completions) or a boolean with ``top_logprobs`` in [0, 20] (chat), ``echo`` a
  boolean (completions; it alone lets ``max_tokens`` be 0), ``presence_penalty`` and
  ``frequency_penalty`` in [-2, 2], ``repetition_penalty`` > 0. Each may be null (its default);
* anything over the server's ``Limits`` (``jaxpar.inference.limits``): text longer than
  ``max_text_chars`` (checked before tokenizing), more than ``max_choices`` choices (prompts × n), more
  than ``max_stops`` stop strings or one longer than ``max_stop_chars``, a ``user`` longer than
  ``max_user_chars``.

Every string of the client's that a message quotes is JSON-escaped and cut short, so an error body and
a log line are always valid text.

Chat messages are rendered with the tokenizer's chat template (Hugging Face's Jinja format, rendered in
a sandbox), as ``apply_chat_template`` does with ``add_generation_prompt``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from collections.abc import Sequence

from jaxpar.chat import ChatTemplate
from jaxpar.inference.limits import Limits
from jaxpar.inference.sampling import SEEDS, choice_seed

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions
QUOTED = 80  # characters of a client's string that an error message quotes
COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "stream",
    "stream_options",
    "n",
    "user",
}
SCORING = {"logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty"}
MAX_LOGPROBS = 20  # alternatives per token (the engine computes this many: jaxpar.inference.logprobs.K)
FIELDS = {
    "completions": COMMON | SCORING | {"prompt", "echo"},
    "chat": COMMON | SCORING | {"messages", "max_completion_tokens", "top_logprobs"},
}


class APIError(Exception):
    """A request refused: OpenAI's error object, sent with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Job:
    """One parsed request: a choice per (prompt, n)."""

    kind: str  # "completions" or "chat"
    prompts: list[list[int]]
    max_tokens: int | list[int]
    sampling: dict  # temperature, top_k, top_p, min_p, seed
    stop_text: list[str]
    stop_ids: frozenset
    stream: bool
    include_usage: bool
    n: int
    user: str | None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(12))
    echo: bool = False  # completions: the prompt's text (and log-probs) in front of the completion
    logprobs: int | None = None  # alternatives per token in the response's logprobs; None: no logprobs
    model: str = ""  # the model the request named: the base model's name or an adapter's

    def choices(self) -> list[tuple[int, list[int], int, dict]]:
        """(index, prompt, max_tokens, sampling) per choice; choice i of n samples with seed + i."""
        limits = self.max_tokens if isinstance(self.max_tokens, list) else [self.max_tokens] * len(self.prompts)
        return [
            (p * self.n + i, prompt, limits[p], {**self.sampling, "seed": choice_seed(self.sampling["seed"], i)})
            for p, prompt in enumerate(self.prompts)
            for i in range(self.n)
        ]


def quote(value) -> str:
    """A client's value as an error message shows it: JSON (non-ASCII and lone surrogates escaped),
    at most ``QUOTED`` characters."""
    text = json.dumps(value, ensure_ascii=True)
    return text if len(text) <= QUOTED else text[: QUOTED - 1] + "…"


def whole(value) -> int | None:
    """``value`` as an integer when JSON Schema calls it one (3 or 3.0), else None (true, 3.5, "3")."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    return value


def wholes(value) -> list[int] | None:
    """``value`` as a list of integers (``whole`` of each entry, each converted once), or None when it is
    not a list or an entry is not an integer."""
    if not isinstance(value, list):
        return None
    out = [whole(t) for t in value]
    return None if None in out else out


def _number(body: dict, name: str, default, low, high, *, low_open: bool = False, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if integer and whole(value) is not None:
        value = whole(value)
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise APIError(f"'{name}' must be {kind}, got {quote(value)}", param=name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(f"'{name}' must be a finite number, got {value}", param=name)
    if value < low or (low_open and value == low) or (high is not None and value > high):
        span = f"{'(' if low_open else '['}{low}, {high if high is not None else '∞'}{']' if high is not None else ')'}"
        raise APIError(f"'{name}' = {value} is outside {span}", param=name)
    return value


class Parser:
    """Validates requests for one served model and its adapters (see the module doc)."""

    def __init__(
        self,
        *,
        model_name: str,
        vocab_size: int,
        max_length: int,
        tokenizer=None,
        chat_template: str | None = None,
        special_tokens: dict | None = None,
        limits: Limits | None = None,
        adapters: Sequence[str] = (),
    ):
        self.model_name, self.vocab_size, self.max_length = model_name, vocab_size, max_length
        self.models = (model_name, *adapters)  # what a request's ``model`` may name: the base, an adapter
        self.limits = limits or Limits()
        self.tokenizer, self.special = tokenizer, special_tokens or {}
        self.template = None
        if chat_template is not None:
            self.template = ChatTemplate(chat_template, self.special, refuse=self._template_error)

    @staticmethod
    def _template_error(message: str) -> APIError:
        return APIError(f"'messages': the chat template refused them: {message}", param="messages")

    # ------------------------------------------------------------------------------------ requests
    def parse(self, kind: str, raw: bytes) -> Job:
        body = self._body(raw, kind)
        model = body.get("model")
        if not isinstance(model, str) or model not in self.models:
            raise APIError(
                f"model {quote(model)} is not served here; this server serves {', '.join(map(quote, self.models))}",
                param="model",
                code="model_not_found",
            )
        prompts = [self._chat(body)] if kind == "chat" else self._prompts(body.get("prompt"))
        limit_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        scoring, echo, logprobs = self._scoring(body, kind)
        limits = [self._max_tokens(body, limit_field, p, kind, least=0 if echo else 1) for p in prompts]
        seed = _number(body, "seed", None, 0, SEEDS - 1, integer=True)
        sampling = dict(
            temperature=float(_number(body, "temperature", 1.0, 0.0, 2.0)),
            top_p=float(_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True)),
            top_k=int(_number(body, "top_k", 0, 0, self.vocab_size, integer=True)),
            min_p=float(_number(body, "min_p", 0.0, 0.0, 1.0)),
            seed=secrets.randbelow(SEEDS) if seed is None else seed,
            **scoring,
        )
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise APIError("'stream_options' must be an object with at most 'include_usage'", param="stream_options")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(f"'stream' must be true or false, got {quote(stream)}", param="stream")
        n = _number(body, "n", 1, 1, self.limits.max_choices, integer=True)
        if len(prompts) * n > self.limits.max_choices:
            raise APIError(
                f"{len(prompts)} prompts × n={n} = {len(prompts) * n} choices; at most {self.limits.max_choices} "
                "per request",
                param="n",
            )
        return Job(
            kind,
            prompts,
            limits,
            sampling,
            self._stops(body.get("stop")),
            self._stop_ids(body),
            stream,
            bool(options.get("include_usage")),
            n,
            self._user(body.get("user")),
            echo=echo,
            logprobs=logprobs,
            model=model,
        )

    def _user(self, user) -> str | None:
        if user is not None and not isinstance(user, str):
            raise APIError("'user' must be a string", param="user")
        if user is not None and len(user) > self.limits.max_user_chars:
            raise APIError(f"'user' has {len(user)} characters; at most {self.limits.max_user_chars}", param="user")
        return user

    def _body(self, raw: bytes, kind: str) -> dict:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise APIError(f"the request body is not valid UTF-8 (byte {err.start})", code="invalid_encoding") from None
        try:
            body = json.loads(text, parse_constant=_no_constant)
        except ValueError as err:
            raise APIError(f"the request body is not valid JSON ({err})", code="invalid_json") from None
        except RecursionError:
            raise APIError("the request body is nested too deep", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object")
        unknown = sorted(set(body) - FIELDS[kind])
        if unknown:
            name = quote(unknown[0])[1:-1]  # the name escaped, without JSON's quotes
            raise APIError(
                f"unknown or unsupported field '{name}'; this endpoint accepts {', '.join(sorted(FIELDS[kind]))}",
                param=name,
                code="unknown_field",
            )
        return body

    def _text(self, text: str, field: str, *, special: bool = True) -> list[int]:
        if len(text) > self.limits.max_text_chars:
            raise APIError(
                f"'{field}' has {len(text)} characters; this server tokenizes at most {self.limits.max_text_chars}",
                param=field.split("[")[0],
                code="context_length_exceeded",
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                f"'{field}' is not valid UTF-8 (it holds a lone surrogate)", param=field, code="invalid_encoding"
            ) from None
        if self.tokenizer is None:
            raise APIError(f"'{field}': this server has no tokenizer; send token ids", param=field)
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    def _prompts(self, prompt) -> list[list[int]]:
        def ids(value, where: str) -> list[int]:
            out = self._text(value, where) if isinstance(value, str) else wholes(value)
            if out is None:
                raise APIError(f"'{where}' must be text, a list of token ids, or a list of either", param="prompt")
            bad = [t for t in out if not 0 <= t < self.vocab_size]
            if bad:
                raise APIError(
                    f"'{where}': token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
            if not out:
                raise APIError(f"'{where}' is empty; a prompt needs at least one token", param="prompt")
            return out

        if prompt is None:
            raise APIError("'prompt' is required", param="prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            if len(prompt) > self.limits.max_choices:
                raise APIError(
                    f"'prompt': {len(prompt)} prompts; at most {self.limits.max_choices} per request", param="prompt"
                )
            return [ids(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [ids(prompt, "prompt")]

    def _chat(self, body: dict) -> list[int]:
        if self.template is None:
            raise APIError(
                "this model's tokenizer has no chat template; use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise APIError(
                "'messages' must be a non-empty list of {role, content} objects with text content", param="messages"
            )
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.limits.max_text_chars:
            raise APIError(
                f"'messages' hold {chars} characters; this server tokenizes at most {self.limits.max_text_chars}",
                param="messages",
                code="context_length_exceeded",
            )
        text = self.template.render(messages, add_generation_prompt=True)
        out = self._text(text, "messages", special=False)
        if not out:
            raise APIError("'messages' rendered to no tokens", param="messages")
        return out

    def _max_tokens(self, body: dict, field: str, prompt: list[int], kind: str, least: int = 1) -> int:
        room = self.max_length - len(prompt)
        if room < 1:
            raise APIError(
                f"the prompt has {len(prompt)} tokens; this server's cache holds {self.max_length} "
                f"positions per sequence (prompt + completion)",
                param="prompt",
                code="context_length_exceeded",
            )
        value = _number(body, field, DEFAULT_MAX_TOKENS if kind == "completions" else room, least, None, integer=True)
        if value > room:
            raise APIError(
                f"'{field}' = {value}: the prompt's {len(prompt)} tokens leave room for {room} in the "
                f"cache of {self.max_length} positions",
                param=field,
                code="context_length_exceeded",
            )
        return value

    def _scoring(self, body: dict, kind: str) -> tuple[dict, bool, int | None]:
        """(the engine's settings: the three penalties, ``logprobs`` and ``prompt_logprobs``; ``echo``; the
        alternatives per token the response lists, None for no logprobs) of ``body``; null is the default."""

        def flag(name: str) -> bool:
            value = body.get(name)
            if value is not None and not isinstance(value, bool):
                raise APIError(f"'{name}' must be true or false, got {json.dumps(value)}", param=name)
            return bool(value)

        def finite(name: str, default: float, low: float, high: float | None, **kw) -> float:
            value = _number(body, name, default, low, high, **kw)
            if not math.isfinite(value):
                raise APIError(f"'{name}' = {value} is not a finite number", param=name)
            return float(value)

        if kind == "chat":
            top = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
            if top and not flag("logprobs"):
                raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            logprobs, echo = top if flag("logprobs") else None, False
        else:
            logprobs, echo = _number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True), flag("echo")
        settings = dict(
            presence_penalty=finite("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=finite("frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=finite("repetition_penalty", 1.0, 0.0, None, low_open=True),
            logprobs=logprobs,
            prompt_logprobs=echo and logprobs is not None,
        )
        return settings, echo, logprobs

    def _stops(self, stop) -> list[str]:
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        most, longest = self.limits.max_stops, self.limits.max_stop_chars
        if not isinstance(stops, list) or len(stops) > most or not all(isinstance(s, str) and s for s in stops):
            raise APIError(f"'stop' must be a non-empty string or a list of at most {most} of them", param="stop")
        for s in stops:
            if len(s) > longest:
                raise APIError(f"'stop': a stop string of {len(s)} characters; at most {longest}", param="stop")
            if self.tokenizer is not None:
                self._text(s, "stop")
        return stops

    def _stop_ids(self, body: dict) -> frozenset:
        ids = wholes(body.get("stop_token_ids") or [])
        if ids is None or not all(0 <= t < self.vocab_size for t in ids):
            raise APIError(
                f"'stop_token_ids' must be a list of token ids in [0, {self.vocab_size})", param="stop_token_ids"
            )
        return frozenset(ids)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")
