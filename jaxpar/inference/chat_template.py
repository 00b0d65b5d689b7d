"""Where a served model's chat template comes from: an explicit Jinja file, or the files Hugging Face
keeps beside a tokenizer (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``),
with the special tokens the template may name. Every file is checked as it is read: readable text, a
JSON object for the config, a template Jinja can parse; a ``DataError`` names the file otherwise."""

from __future__ import annotations

import json
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
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise DataError(f"{where}: not a Jinja template (line {err.lineno}: {err.message})") from None
    return template
