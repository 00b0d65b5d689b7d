"""OpenAI's ``logprobs`` objects, built from the engine's per-token scores (``TokenScore``: the token's
log-probability, the ids and log-probabilities of the most likely tokens at its position).

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, one entry per token;
``top_logprobs`` maps each of the ``logprobs`` most likely tokens' text to its log-probability, the sampled
token included (so up to ``logprobs`` + 1 entries). With ``echo`` the prompt's tokens come first, the
first of them with ``null`` log-probabilities (nothing precedes it). Chat: ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``.

A token's text is the text it adds to the decoded text of the tokens before it (decoded over a window of
the previous ``WINDOW`` tokens: tokenizers that drop a leading space or join bytes into characters need
that context). ``text_offset`` counts characters of the choice's text before each token: the echoed prompt
(decoded alone), then the completion (decoded alone, as the choice's text is). A token that ends inside a
multi-byte character adds no text; its ``token`` is then written ``bytes:\\xNN…`` from its own bytes
where the tokenizer's pieces give them (byte-level BPE, byte fallback), as OpenAI writes such tokens.
"""

from __future__ import annotations

import re

WINDOW = 6  # previous tokens decoded with each token to find the text it adds
_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a byte-fallback piece (Llama-2, Mistral)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's characters -> bytes: the printable bytes stand for themselves, every other byte
    for the character 256 + n, n counting those bytes in increasing order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


BYTE_LEVEL = _byte_level_alphabet()


def echo_text(tokenizer, prompt: list[int]) -> str:
    """The prompt's text, as an echoed completion begins."""
    return tokenizer.decode(prompt) if tokenizer is not None else ""


class ChoiceLogprobs:
    """The ``logprobs`` objects of one choice, chunk by chunk (module doc); ``chunk`` also returns the
    echoed prompt's text in front of the first chunk."""

    def __init__(self, tokenizer, job, prompt: list[int]):
        self.tokenizer, self.kind, self.top, self.echo = tokenizer, job.kind, job.logprobs, job.echo
        self.prompt = prompt
        self.context: list[int] = []  # the completion's tokens so far (its text is decoded alone)
        self.offset = 0  # characters of the choice's text before the next token
        self.started = False
        decoder = getattr(tokenizer, "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"  # pieces spell bytes in BYTE_LEVEL

    def chunk(self, ids: list[int], scores: list, prompt_scores: list | None) -> tuple[str, dict | None]:
        """(text in front of this chunk's: the echoed prompt on the first chunk, else ""; the logprobs
        object of the chunk's tokens, None when the request asked for none)."""
        prefix, entries = "", []
        if not self.started and self.echo:
            prefix = echo_text(self.tokenizer, self.prompt)
            if self.top is not None:
                entries = self._entries(self.prompt, prompt_scores or [None] * len(self.prompt), [])
            self.offset = len(prefix)
        self.started = True
        if self.top is None:
            return prefix, None
        entries += self._entries(ids, scores, self.context)
        return prefix, self._render(entries)

    # ---------------------------------------------------------------------------------------- entries
    def _entries(self, ids: list[int], scores: list, context: list[int]) -> list[dict]:
        """One entry per token: its text, bytes, offset, log-prob and alternatives. ``context`` (the
        tokens before ``ids`` in the same text) grows with them."""
        out = []
        for token, score in zip(ids, scores):
            before = context[-WINDOW:]
            piece = self._piece(before, token)
            label, raw = self._label(token, piece)
            entry = dict(token=label, bytes=raw, offset=self.offset, logprob=None, top=None)
            if score is not None:
                alternatives = [self._label(t, self._piece(before, t)) for t in score.top_ids[: self.top]]
                entry["logprob"] = score.logprob
                entry["top"] = [(a, b, lp) for (a, b), lp in zip(alternatives, score.top_logprobs)]
            out.append(entry)
            context.append(token)
            self.offset += len(piece)
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if ids else ""

    def _piece(self, before: list[int], token: int) -> str:
        """The text ``token`` adds after ``before``; "" while it ends inside a multi-byte character (the
        token that completes the character adds all of it)."""
        if self.tokenizer is None:
            return ""
        head = self._decode(before).rstrip("\ufffd")
        text = self._decode(before + [token]).rstrip("\ufffd")
        return text[len(head) :] if text.startswith(head) else text

    def _label(self, token: int, piece: str) -> tuple[str, list[int]]:
        """(the token's text as the response writes it, its bytes): its own bytes where its piece gives
        them (byte-level BPE, a byte-fallback piece), written ``bytes:\\x..`` when they are not UTF-8
        alone; else the text it adds and its UTF-8 (the text is then its vocabulary name when it adds
        none, e.g. a special token or a leading "▁" the decoder strips)."""
        raw = self._own_bytes(token)
        if raw is None:
            label = piece or (self.tokenizer.id_to_token(token) if self.tokenizer is not None else None) or ""
            return label, list(piece.encode())
        try:
            return raw.decode(), list(raw)
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def _own_bytes(self, token: int) -> bytes | None:
        name = self.tokenizer.id_to_token(token) if self.tokenizer is not None else None
        if not name:
            return None
        fallback = _FALLBACK.fullmatch(name)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if self.byte_level and all(c in BYTE_LEVEL for c in name):
            return bytes(BYTE_LEVEL[c] for c in name)
        return None

    # --------------------------------------------------------------------------------------- rendering
    def _render(self, entries: list[dict]) -> dict:
        if self.kind == "chat":
            return {
                "content": [
                    {
                        "token": e["token"],
                        "logprob": e["logprob"],
                        "bytes": e["bytes"],
                        "top_logprobs": [{"token": a, "logprob": lp, "bytes": b} for a, b, lp in e["top"]],
                    }
                    for e in entries
                ]
            }
        tops = []
        for e in entries:
            if e["top"] is None:
                tops.append(None)
                continue
            top: dict[str, float] = {}
            for label, _, lp in sorted([*e["top"], (e["token"], None, e["logprob"])], key=lambda a: -a[2]):
                top.setdefault(label, lp)  # the more likely of two tokens with the same text
            tops.append(top)
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops,
            "text_offset": [e["offset"] for e in entries],
        }
