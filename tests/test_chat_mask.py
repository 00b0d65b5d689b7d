"""The loss mask of chat fine-tuning (jaxpar.chat, ``jaxpar prepare --field messages``): the assistant's
replies through their end-of-turn token, found by rendering prefixes and diffing; equal to transformers'
``return_assistant_tokens_mask`` where the template marks its ``{% generation %}`` blocks."""

import json

import numpy as np
import pytest
from test_corpus import _bpe, _jsonl, _prepare

from jaxpar.chat import ChatTemplate, token_mask
from jaxpar.errors import DataError

# ChatML, with the assistant's reply and its end-of-turn token marked for transformers' mask
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"  # (trim_blocks eats a bare newline)
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# the same turns without markers, the end of turn written after each one
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that rewrites earlier replies (keeps their first character): prefixes are not prefixes
REWRITES = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:1] }}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ALTERNATE = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
CHATS = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "abc cba"}],
    [
        {"role": "system", "content": "reverse"},
        {"role": "user", "content": "abc"},
        {"role": "assistant", "content": "cba"},
        {"role": "user", "content": "hello the cat"},
        {"role": "assistant", "content": "the end ✓"},
    ],
    [{"role": "user", "content": "a dog ran"}, {"role": "assistant", "content": ""}],  # an empty reply: its EOT
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json")))


def _mask(template: str, tokenizer, messages) -> tuple[list[int], list[bool]]:
    text, spans = ChatTemplate(template).assistant_spans(messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    return encoding.ids, token_mask(encoding.offsets, spans)


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_mask_equals_transformers_assistant_tokens_mask(tokenizer, chat):
    from transformers import PreTrainedTokenizerFast

    peer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    want = peer.apply_chat_template(
        CHATS[chat], chat_template=CHATML, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = _mask(CHATML, tokenizer, CHATS[chat])
    assert ids == list(want["input_ids"]) and [int(m) for m in mask] == list(want["assistant_masks"])
    assert _mask(PLAIN, tokenizer, CHATS[chat]) == (ids, mask)  # markers or not: the same mask


def test_mask_is_each_reply_and_its_end_of_turn(tokenizer):
    ids, mask = _mask(PLAIN, tokenizer, CHATS[1])
    kept = [i for i, m in zip(ids, mask) if m]
    eot = tokenizer.token_to_id("<|im_end|>")
    replies = [m["content"] for m in CHATS[1] if m["role"] == "assistant"]
    want = [t for r in replies for t in tokenizer.encode(r, add_special_tokens=False).ids + [eot]]
    assert kept == want
    # mutation: a mask one token late (the classic off-by-one) differs from it
    assert [i for i, m in zip(ids, [False] + mask[:-1]) if m] != want


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer):
    with pytest.raises(DataError, match=r"at message 2\).*cannot be found by diffing"):
        ChatTemplate(REWRITES).assistant_spans(CHATS[1])


def test_prepare_chat_writes_ids_mask_and_offsets(tmp_path, capsys, tokenizer):
    folder = tmp_path / "tok"
    folder.mkdir()
    tok_file = _bpe(folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": PLAIN, "eos_token": "<|im_end|>"}))
    data = tmp_path / "chat.jsonl"
    data.write_bytes(_jsonl([{"messages": c} for c in CHATS]))
    rc, out, err = _prepare(capsys, data, "--field", "messages", "--tokenizer", tok_file, "--out", tmp_path / "c.bin")
    assert rc == 0, err
    ids, mask = np.fromfile(tmp_path / "c.bin", np.uint16), np.fromfile(tmp_path / "c.mask.bin", np.uint8)
    want = [_mask(PLAIN, tokenizer, c) for c in CHATS]
    assert ids.tolist() == [i for w in want for i in w[0]]
    assert mask.tolist() == [int(m) for w in want for m in w[1]]
    offsets = np.cumsum([0] + [len(w[0]) for w in want]).tolist()
    assert np.load(tmp_path / "c.docs.npy").tolist() == offsets
    meta = json.loads((tmp_path / "c.json").read_text())
    assert meta["field"] == "messages" and meta["trained_tokens"] == int(mask.sum()) and "trained" in out


def test_template_refusals_name_the_record_or_are_skipped(tmp_path, capsys):
    tok_file = _bpe(tmp_path / "tokenizer.json")
    (tmp_path / "t.jinja").write_text(ALTERNATE)
    data = tmp_path / "chat.jsonl"
    data.write_bytes(_jsonl([{"messages": CHATS[0]}, {"messages": CHATS[1]}]))  # the second starts with system
    how = [data, "--field", "messages", "--tokenizer", tok_file, "--chat-template", tmp_path / "t.jinja"]
    rc, _, err = _prepare(capsys, *how, "--out", tmp_path / "c.bin")
    assert rc == 2 and f"{data}:2: the chat template refused it: roles must alternate" in err
    assert not (tmp_path / "c.bin").exists()
    rc, out, err = _prepare(capsys, *how, "--out", tmp_path / "c.bin", "--skip-bad")
    assert rc == 0 and "skipped 1 (the chat template refused it)" in out
    assert json.loads((tmp_path / "c.json").read_text())["documents"] == 1
