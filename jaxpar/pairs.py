"""A preference record (prompt, chosen, rejected) as the two documents ``jaxpar prepare --field
preference`` writes: prompt + chosen, then prompt + rejected, each with a loss mask on its completion.

The completion starts where the tokenized prompt and the tokenized prompt + completion part (the
shorter of the two common prefixes, so both documents share it): a chat template may render the prompt
alone differently from the prompt followed by a reply, and tokens may merge across the boundary. A
chat's completion is the template's rendering of the reply, its end-of-turn and whatever the template
writes after it; a text completion is followed by the EOS id. The mask is 1 from there to the end.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpar.errors import DataError


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def pair_texts(pair: tuple, chat) -> tuple[list[str], bool]:
    """(the texts of prompt, prompt + chosen and prompt + rejected, whether they are chats) of a record;
    ``chat``: the ``ChatTemplate`` that renders chats (None: refused for a chat record)."""
    prompt, chosen, rejected = pair
    if isinstance(prompt, str):
        return [prompt, prompt + chosen, prompt + rejected], False
    if chat is None:
        raise DataError("--field preference: a chat record needs --tokenizer with a chat template")
    return [
        chat.render(prompt, add_generation_prompt=True),
        chat.render(prompt + chosen, add_generation_prompt=False),
        chat.render(prompt + rejected, add_generation_prompt=False),
    ], True


def pair_pieces(pair: tuple, chat, encode: Callable[[list[str]], list[np.ndarray]], eos_id: int):
    """The two documents of a record: [(ids, uint8 mask)] for chosen, then rejected."""
    texts, is_chat = pair_texts(pair, chat)
    prompt, *full = encode(texts)
    start = min(common_prefix(prompt, f) for f in full)
    out = []
    for ids in full:
        ids = ids if is_chat else np.concatenate([ids, [eos_id]])
        if start >= len(ids):
            raise DataError("a completion has no tokens after the prompt")
        mask = np.zeros(len(ids), np.uint8)
        mask[start:] = 1
        out.append((np.asarray(ids, np.int64), mask))
    return out
