"""The server's OpenAPI 3 schema (``GET /openapi.json``): every route, every request field the parser
accepts with its type and range, and every status a route answers with.

``tests/test_serve_fuzz.py`` checks that the request fields here are exactly those ``jaxpar.inference.api``
accepts, and fuzzes every route from this schema (schemathesis): no request may get a 5xx that is not a
limit's answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpar.inference.api import MAX_LOGPROBS
from jaxpar.inference.limits import Limits
from jaxpar.inference.sampling import SEEDS

_STOP = {"oneOf": [{"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "string", "minLength": 1}}]}
_NULLABLE_INT = {"type": ["integer", "null"], "minimum": 1}

COMMON = {
    "model": {"type": "string"},  # the served model's name (``schema`` sets it)
    "max_tokens": _NULLABLE_INT,
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": 0},
    "min_p": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": SEEDS - 1},
    "stop": _STOP,
    "stop_token_ids": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
    "stream": {"type": "boolean"},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": ["integer", "null"], "minimum": 1},
    "user": {"type": ["string", "null"]},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0},
}
_TOP = {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_LOGPROBS}
MESSAGES = {
    "type": "array",
    "minItems": 1,
    "items": {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
    },
}
REQUESTS = {
    # the prompt's token ids are bounded by the vocabulary: ``schema`` fills "prompt" in
    "completions": {**COMMON, "prompt": {}, "logprobs": _TOP, "echo": {"type": ["boolean", "null"]}},
    "chat": {
        **COMMON,
        "messages": MESSAGES,
        "max_completion_tokens": _NULLABLE_INT,
        "logprobs": {"type": ["boolean", "null"]},
        "top_logprobs": _TOP,
    },
}
ERROR = {
    "description": "OpenAI's error object",
    "content": {"application/json": {"schema": {"type": "object", "required": ["error"]}}},
}


def _answers(statuses: dict[str, str]) -> dict:
    out = {}
    for status, text in statuses.items():
        body = {"description": text, "content": {"application/json": {"schema": {"type": "object"}}}}
        out[status] = body if status.startswith("2") else {**ERROR, "description": text}
    return out


def _prompt(vocab_size: int) -> dict:
    tokens = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}, "minItems": 1}
    return {"oneOf": [{"type": "string"}, tokens, {"type": "array", "items": {"oneOf": [{"type": "string"}, tokens]}}]}


def _generation(kind: str, limits: Limits, models: Sequence[str], vocab_size: int) -> dict:
    required = ["model", "prompt"] if kind == "completions" else ["model", "messages"]
    fields = {**REQUESTS[kind], "model": {"type": "string", "enum": list(models)}}
    if kind == "completions":
        fields["prompt"] = _prompt(vocab_size)
    body = {"type": "object", "required": required, "properties": fields, "additionalProperties": False}
    statuses = {
        "200": "the completion, or with stream: true an event stream of chunks",
        "400": "a malformed request or one over a limit, the field named",
        "401": "no valid API key (when the server has one)",
        "408": f"the body did not arrive within --body-timeout (default {limits.body_timeout} s)",
        "413": f"the body is over --max-body-bytes (default {limits.max_body_bytes})",
        "429": "the replicas' queues are full (Retry-After)",
        "503": "shutting down, or no replica available",
        "504": "past --request-timeout",
    }
    return {"post": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                     "responses": _answers(statuses)}}  # fmt: skip


def schema(models: Sequence[str], vocab_size: int, limits: Limits | None = None) -> dict:
    """The OpenAPI document of a server of ``models`` (the base model's name and its adapters'), its
    vocabulary and ``limits``."""
    limits = limits or Limits()
    plain = {"get": {"responses": _answers({"200": "ok", "401": "no valid API key"})}}
    text = {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxpar serve", "version": "1"},
        "paths": {
            "/v1/completions": _generation("completions", limits, models, vocab_size),
            "/v1/chat/completions": _generation("chat", limits, models, vocab_size),
            "/v1/models": plain,
            "/health": {"get": {"responses": _answers({"200": "every replica progressing", "503": "degraded"})}},
            "/metrics": {"get": {"responses": {"200": text}}},
        },
    }
