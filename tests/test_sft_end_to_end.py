"""Supervised fine-tuning end to end, as docs/fine-tuning.md tells it: a random Hugging Face Llama
fine-tuned from its folder on a chat jsonl (``jaxpar train --init-from HF_DIR --data chat.jsonl``: the
records prepared on the fly with the folder's tokenizer, template and mask) on packed rows until it
reverses strings of letters; exported (``jaxpar convert --to-hf``) and served (``jaxpar serve``), where
the ``openai`` client's chat gets held-out strings (never in the training data) reversed. The user's
turns were never trained: the prefix every user turn opens with ("reverse: ") stays no likelier than
before, though the model saw it in every conversation."""

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hf_build import build, save
from serve_process import launch

from jaxpar.cli import main
from jaxpar.convert import from_hf

openai = pytest.importorskip("openai")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # <|im_end|> (id 2) ends a turn and a reply
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz :\n"))
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS, HELD_OUT, STEPS = 3000, 20, 200


def _hf_folder(folder):
    """A character-level tokenizer with the template beside it, and a random tiny Llama of its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    model = build("llama")
    model.resize_token_embeddings(len(vocab), mean_resizing=False)
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    save(model, folder)
    _tokenizer_files(tok, folder)
    return folder


def _tokenizer_files(tok, folder):
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def _chats(path):
    """Conversations reversing strings of 3 to 5 letters; returns the held-out strings (never trained)."""
    rng = random.Random(0)
    words = sorted({"".join(rng.choice("abcd") for _ in range(rng.randint(3, 5))) for _ in range(600)})
    rng.shuffle(words)
    held, train = words[:HELD_OUT], words[HELD_OUT:]
    with open(path, "w") as f:
        for _ in range(CONVERSATIONS):
            s = rng.choice(train)
            chat = [{"role": "user", "content": "reverse: " + s}, {"role": "assistant", "content": s[::-1]}]
            f.write(json.dumps({"messages": chat}) + "\n")
    return held


def _user_prefix_nll(folder) -> float:
    """Mean negative log-likelihood of "everse: " after "<|im_start|>user\\nr": user tokens only."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = np.asarray([tok.encode("<|im_start|>user\nreverse: ", add_special_tokens=False).ids], np.int32)
    logits = np.asarray(from_hf(folder)(ids))[0].astype(np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    targets = ids[0, 4:]  # after <|im_start|>, "u", "s", "e", "r", "\n", "r": the tokens of "everse: "
    return float(-np.mean(logp[3:-1][np.arange(len(targets)), targets]))


def test_fine_tune_a_hugging_face_model_on_chat_and_serve_it(tmp_path):
    hf = _hf_folder(tmp_path / "hf")
    held = _chats(tmp_path / "chat.jsonl")
    before = _user_prefix_nll(hf)
    train = [sys.executable, "-m", "jaxpar", "train", "--init-from", str(hf), "--out", str(tmp_path / "run")]
    train += ["--data", str(tmp_path / "chat.jsonl")]  # tokenized on the fly with hf's tokenizer and template
    train += ["--batch", "16", "--seq", "64", "--steps", str(STEPS), "--cpu-devices", "1", "--mesh", "data=1"]
    train += ["--set", "log.progress=false", "--set", "optimizer.learning_rate=3e-3", "--set", "log.eval_every=0"]
    train += ["--set", f"checkpoint.every={STEPS}"]
    env = os.environ | {"JAXPAR_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(train, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "--data: prepared into" in done.stdout and "with loss masks" in done.stdout
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == STEPS and last["loss"] < 0.05, last
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "ft")]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf / name, tmp_path / "ft" / name)
    # the user's turns were never trained: "everse: " (every user turn's opening) no likelier than before
    after = _user_prefix_nll(tmp_path / "ft")
    assert after > min(before, np.log(len(SPECIAL) + len(CHARS))) - 0.5, (before, after)
    proc, url = launch(["--from", str(tmp_path / "ft"), "--port", "0", "--cpu-devices", "1"], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        answers = [
            client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": "reverse: " + word}],
                max_tokens=8,
                temperature=0,
            ).choices[0]
            for word in held
        ]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert [a.message.content for a in answers] == [w[::-1] for w in held]
    assert all(a.finish_reason == "stop" for a in answers)  # each reply ended with <|im_end|>
