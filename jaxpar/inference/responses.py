"""The JSON bodies the server answers with: a choice (whole or a stream's delta), the envelope around
the choices, and the token usage, in OpenAI's shapes for completions and chat."""

from __future__ import annotations

from jaxpar.inference.api import Job


def usage(choices) -> dict:
    """Prompt and completion tokens of ``choices`` [(index, request, worker, events)]."""
    prompt = sum(len(r.prompt) for _, r, _, _ in choices)
    done = sum(r.generated for _, r, _, _ in choices)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def choice(job: Job, index: int, text: str, reason, ids=None, logprobs: dict | None = None) -> dict:
    """One choice: a whole one (with its token ``ids``) or a stream's delta (without)."""
    if job.kind == "chat":
        key = "message" if ids is not None else "delta"
        out = {
            "index": index,
            key: {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": reason,
        }
    else:
        out = {"index": index, "text": text, "finish_reason": reason, "logprobs": logprobs}
    if ids is not None:
        out["token_ids"] = ids  # an extension: the exact tokens behind the text
    return out


def envelope(job: Job, *, chunk: bool) -> dict:
    """The fields around the choices of a response (``chunk``: of one event of a stream)."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if job.kind == "chat" else "text_completion"
    prefix = "chatcmpl-" if job.kind == "chat" else "cmpl-"
    return {"id": prefix + job.id, "object": kind, "created": job.created, "model": job.model}
