"""Where a served model's chat template comes from: an explicit Jinja file, or the files Hugging Face
keeps beside a tokenizer (``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``),
with the special tokens the template may name."""

from __future__ import annotations

import json
from pathlib import Path


def load_chat_template(tokenizer_file: str | Path | None, explicit: str | Path | None = None) -> tuple:
    """(template, special tokens) for chat: the template of ``explicit`` (a Jinja file), else
    ``chat_template.jinja`` or the ``chat_template`` of ``tokenizer_config.json`` beside the tokenizer
    file (None when there is none); the special tokens (``bos_token``, ``eos_token``) of that config."""
    folder = Path(tokenizer_file).parent if tokenizer_file is not None else None
    config = {}
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
    special = {}
    for name in ("bos_token", "eos_token"):
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            special[name] = value
    if explicit is not None:
        return Path(explicit).read_text(), special
    if folder is not None and (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(), special
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template, special
