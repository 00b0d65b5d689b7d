"""Chat templates, for serving and for fine-tuning: where a template comes from, how it renders, and
which characters of a conversation are the assistant's (the loss mask of supervised fine-tuning).

* ``load_chat_template``: an explicit Jinja file, or the files Hugging Face keeps beside a tokenizer
  (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``), with the special tokens
  the template may name. Every file is checked as it is read: readable text, a JSON object for the
  config, a template Jinja can parse; a ``DataError`` names the file otherwise.
* ``ChatTemplate``: the template compiled in Jinja's immutable sandbox, as ``apply_chat_template``
  compiles it (blocks trimmed, ``raise_exception``; ``{% generation %}`` blocks render their body).
* ``ChatTemplate.assistant_spans``: the assistant's characters, found by rendering prefixes of the
  conversation and diffing them: the text a reply adds after the generation prompt, through its
  end-of-turn token (whitespace the template writes after that token is formatting, not trained).
  A template that does not render each prefix of a conversation as a prefix of the whole (one that
  rewrites earlier turns) is refused by name: its spans cannot be found this way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from jaxpar.errors import DataError


def load_chat_template(tokenizer_file: str | Path | None, explicit: str | Path | None = None) -> tuple:
    """(template, special tokens) for chat: the template of ``explicit`` (a Jinja file, --chat-template),
    else ``chat_template.jinja`` or the ``chat_template`` of ``tokenizer_config.json`` beside the
    tokenizer file (None when there is none); the special tokens (``bos_token``, ``eos_token``) of that
    config."""
    folder = Path(tokenizer_file).parent if tokenizer_file is not None else None
    config = _config(folder / "tokenizer_config.json") if folder is not None else {}
    special = {}
    for name in ("bos_token", "eos_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    if explicit is not None:
        return _parsed(_text(Path(explicit), "--chat-template "), f"--chat-template {explicit}"), special
    if folder is not None and (folder / "chat_template.jinja").is_file():
        path = folder / "chat_template.jinja"
        return _parsed(_text(path), str(path)), special
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next(
            (t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if template is not None and not isinstance(template, str):
        raise DataError(f"{folder / 'tokenizer_config.json'}: chat_template is not a string")
    return (None if template is None else _parsed(template, str(folder / "tokenizer_config.json"))), special


def _text(path: Path, flag: str = "") -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) else "not UTF-8 text"
        raise DataError(f"{flag}{path}: cannot be read ({why})") from None


def _config(path: Path) -> dict:
    """``tokenizer_config.json`` as a dict ({} when there is none)."""
    if not path.is_file():
        return {}
    try:
        config = json.loads(_text(path))
    except ValueError as err:
        raise DataError(f"{path}: not JSON ({err})") from None
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _parsed(template: str, where: str) -> str:
    """``template`` if Jinja can parse it (the server compiles it in its sandbox)."""
    import jinja2  # deferred: only for a chat template

    try:
        jinja2.Environment(extensions=[_generation_extension()]).parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise DataError(f"{where}: not a Jinja template (line {err.lineno}: {err.message})") from None
    return template


def _generation_extension():
    """A Jinja extension for ``{% generation %}...{% endgeneration %}`` (the assistant-mask markers some
    templates carry for transformers): the block renders its body unchanged."""
    import jinja2.ext
    import jinja2.nodes

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    return Generation


class ChatTemplate:
    """A chat template compiled in Jinja's immutable sandbox; ``refuse(message)`` is what the template's
    ``raise_exception`` raises (the caller's own error type)."""

    def __init__(self, source: str, special: dict | None = None, *, refuse: Callable[[str], Exception] = DataError):
        from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred: only for a chat template

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension()])

        def raise_exception(message: str):
            raise refuse(message)

        env.globals["raise_exception"] = raise_exception
        self.template, self.special = env.from_string(source), dict(special or {})

    def render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(the rendered conversation, [start, end) character spans of each assistant reply through its
        end-of-turn token)."""
        whole = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1], add_generation_prompt=False)
            if not (through.startswith(before) and whole.startswith(through)):
                raise DataError(
                    "the chat template does not render the conversation up to a reply as a prefix of the "
                    f"whole conversation (at message {i}); its assistant tokens cannot be found by diffing "
                    "prefixes. Use a template that leaves earlier turns as they were (--chat-template FILE)"
                )
            end = len(through.rstrip())
            if end > len(before):
                spans.append((len(before), end))
        return whole, spans


def token_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[bool]:
    """Per token: does its first character lie in one of ``spans``? (``offsets``: each token's
    [start, end) characters, as a tokenizer reports them)."""
    out, k = [], 0
    for start, _ in offsets:
        while k < len(spans) and spans[k][1] <= start:
            k += 1
        out.append(k < len(spans) and spans[k][0] <= start)
    return out
