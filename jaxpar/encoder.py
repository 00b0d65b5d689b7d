"""Documents as token pieces for ``jaxpar prepare`` (``Encoder``): a text file read and encoded a piece at a
time, a text record followed by EOS, a chat rendered with its template and its assistant mask
(``jaxpar.chat``), a preference record as its two documents (``jaxpar.pairs``); ``--bytes`` gives byte
values and EOS = 256. A bad record raises with its place, or is skipped and counted (``--skip-bad``).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from jaxpar.chat import ChatTemplate, load_chat_template, token_mask
from jaxpar.corpus import Field
from jaxpar.errors import DataError
from jaxpar.pairs import pair_pieces

EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
PIECE_BYTES = 1 << 20  # text read (and encoded) per piece of a document
BATCH_BYTES = 8 << 20  # text per encode_batch call
REFUSED = "the chat template refused it"  # the skipped-record reason of a template's own refusal


class Encoder:
    """Turns documents into (ids, loss mask or None, ends a document) pieces."""

    def __init__(self, args, skipped: Counter):
        self.tokenizer, self.chat, self.skip_bad, self.skipped = None, None, args.skip_bad, skipped
        self.field = Field.parse(args.field, field="--field")
        if args.chat_template and args.field == Field.TEXT:
            raise DataError("--chat-template goes with --field messages or preference")
        if args.tokenizer is None:
            if args.field == Field.MESSAGES:
                raise DataError("--field messages needs --tokenizer: a chat is rendered with the tokenizer's template")
            self.name, self.vocab_size, self.eos_id = "bytes", 257, 256
            return
        from tokenizers import Tokenizer  # deferred: only when a tokenizer is named

        if not Path(args.tokenizer).is_file():
            raise DataError(f"--tokenizer {args.tokenizer}: no such file")
        try:
            self.tokenizer = Tokenizer.from_file(args.tokenizer)
        except Exception as err:  # tokenizers raises a bare Exception on bad JSON
            raise DataError(f"--tokenizer {args.tokenizer}: not a tokenizers file ({err})") from None
        self.name, self.vocab_size = str(Path(args.tokenizer).resolve()), self.tokenizer.get_vocab_size()
        self.eos_id = _eos_id(self.tokenizer, args.tokenizer, args.eos_token)
        if args.field == Field.MESSAGES:
            self.chat = _chat(args)
        elif args.field == Field.PREFERENCE:  # needed only by chat records
            template, special = load_chat_template(args.tokenizer, args.chat_template)
            self.chat = None if template is None else ChatTemplate(template, special)

    def chunks(self, docs):
        """Yields the pieces of ``docs`` in order; each text document ends with EOS, each chat with its mask."""
        eos = np.array([self.eos_id], np.int64)
        if self.field == Field.PREFERENCE:
            for doc in docs:
                yield from self._pair(doc)
            return
        if self.tokenizer is None:  # bytes (text only)
            for doc in docs:
                blocks = _blocks(doc.path) if doc.path else [doc.text.encode("utf-8")]
                for block in blocks:
                    yield np.frombuffer(block, np.uint8), None, False
                yield eos, None, True
            return
        batch, size = [], 0
        for doc in docs:
            for item in self._items(doc):
                batch.append(item)
                size += len(item[0])
                if size >= BATCH_BYTES:
                    yield from self._encode(batch, eos)
                    batch, size = [], 0
        yield from self._encode(batch, eos)

    def _items(self, doc):
        """(text, assistant spans or None, last piece of the document) of one document."""
        if doc.path:
            for text, last in _text_pieces(doc.path):
                yield text, None, last
        elif doc.messages is None:
            yield doc.text, None, True
        else:
            import jinja2  # deferred: only for chat

            try:
                text, spans = self.chat.assistant_spans(doc.messages)
            except (DataError, jinja2.TemplateError, TypeError) as err:
                if not self.skip_bad:
                    raise DataError(f"{doc.where}: {REFUSED}: {err}") from None
                self.skipped[REFUSED] += 1
                return
            yield text, spans, True

    def _pair(self, doc):
        """The chosen and rejected documents of a preference record (``jaxpar.pairs``), or none when it is
        bad and skipped."""
        import jinja2  # deferred: only for chat

        try:
            pieces = pair_pieces(doc.pair, self.chat, self._ids, self.eos_id)
        except (DataError, jinja2.TemplateError, TypeError) as err:
            if not self.skip_bad:
                raise DataError(f"{doc.where}: {REFUSED if self.chat else 'refused'}: {err}") from None
            self.skipped[REFUSED if self.chat else str(err)] += 1
            return
        for ids, mask in pieces:
            yield ids, mask, True

    def _ids(self, texts: list[str]) -> list[np.ndarray]:
        if self.tokenizer is None:
            return [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64) for t in texts]
        return [np.asarray(e.ids, np.int64) for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def _encode(self, batch, eos):
        encodings = self.tokenizer.encode_batch([text for text, _, _ in batch], add_special_tokens=False)
        for (_, spans, last), encoding in zip(batch, encodings):
            ids = np.asarray(encoding.ids, np.int64)
            if spans is not None:
                yield ids, np.asarray(token_mask(encoding.offsets, spans), np.uint8), True
                continue
            yield ids, None, False
            if last:
                yield eos, None, True


def _chat(args) -> ChatTemplate:
    template, special = load_chat_template(args.tokenizer, args.chat_template)
    if template is None:
        raise DataError(
            f"--field messages: no chat template beside {args.tokenizer} (chat_template.jinja, or chat_template "
            "in tokenizer_config.json); name one with --chat-template FILE"
        )
    return ChatTemplate(template, special)


def _eos_id(tokenizer, name: str, eos_token: str | None) -> int:
    names = [eos_token] if eos_token else [t for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None]
    if not names or tokenizer.token_to_id(names[0]) is None:
        raise DataError(
            f"--tokenizer {name}: "
            + (
                f"--eos-token {eos_token!r} is not in its vocabulary"
                if eos_token
                else f"none of {' '.join(EOS_CANDIDATES)} is in its vocabulary; "
                "name the end-of-document token with --eos-token"
            )
        )
    return tokenizer.token_to_id(names[0])


def _blocks(path: Path):
    with open(path, "rb") as f:
        while block := f.read(PIECE_BYTES):
            yield block


def _text_pieces(path: Path):
    """(text, is_last_piece) of one UTF-8 document, cut after newlines that start a non-space line."""

    def decode(raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {done + err.start}); try --bytes") from None

    carry, done = b"", 0
    with open(path, "rb") as f:
        while block := f.read(PIECE_BYTES):
            carry += block
            cut = len(carry) - 1
            while (cut := carry.rfind(b"\n", 0, cut)) >= 0 and carry[cut + 1 : cut + 2] in b" \t\r\n":
                pass
            if cut >= 0:
                yield decode(carry[: cut + 1]), False
                carry, done = carry[cut + 1 :], done + cut + 1
    yield decode(carry), True
