"""A peer's numbers: on the same tiny Hugging Face Llama and the same chat batch, the masked loss of
``jaxpar prepare --field messages`` + the train step's objective, before any update, equals TRL's
``SFTTrainer`` loss with ``assistant_only_loss`` (TRL, transformers and torch: test-only), and the two
tokenize and mask every conversation alike."""

import json

import numpy as np
import pytest
from hf_build import build, save
from test_chat_mask import CHATML, CHATS
from test_corpus import _bpe, _jsonl, _prepare

from jaxpar.convert import from_hf
from jaxpar.train.loss import next_token_loss, token_weights

TRL_BOUND = 1e-5  # the bound on |jaxpar - TRL| (float32 on both sides)


def chat_llama(folder):
    """Writes a tiny random Llama with a byte-level BPE tokenizer and a ChatML template marked for
    transformers into ``folder``; returns the model (torch)."""
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(_bpe(folder / "tokenizer.json")))
    tokenizer.chat_template, tokenizer.eos_token, tokenizer.pad_token = CHATML, "<|im_end|>", "<|endoftext|>"
    tokenizer.save_pretrained(folder)
    model = build("llama")
    model.resize_token_embeddings(len(tokenizer))
    save(model, folder)
    return model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    chat_llama(folder)
    return folder


def _trl(folder, tmp_path):
    """(loss, [(input ids, trained mask)]) of TRL's SFTTrainer on the chats, one batch, no update."""
    import datasets
    import torch
    import transformers
    import trl

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        assistant_only_loss=True,
        per_device_train_batch_size=len(CHATS),
        report_to=[],
        packing=False,
        use_cpu=True,
    )
    data = datasets.Dataset.from_list([{"messages": c} for c in CHATS])
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
    # TRL's labels: the token where its assistant mask is 1, else -100 (ignored)
    rows = [(list(r["input_ids"]), [int(t != -100) for t in r["labels"]]) for r in trainer.train_dataset]
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
    return float(loss), rows


def test_masked_loss_equals_trl_assistant_only_loss(folder, tmp_path, capsys):
    want, rows = _trl(folder, tmp_path)
    data = tmp_path / "chat.jsonl"
    data.write_bytes(_jsonl([{"messages": c} for c in CHATS]))
    rc, _, err = _prepare(
        capsys, data, "--field", "messages", "--tokenizer", folder / "tokenizer.json", "--out", tmp_path / "c.bin"
    )
    assert rc == 0, err
    ids, mask = np.fromfile(tmp_path / "c.bin", np.uint16), np.fromfile(tmp_path / "c.mask.bin", np.uint8)
    offsets = np.load(tmp_path / "c.docs.npy")
    ours = [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]
    assert ours == rows  # the same tokens and the same mask, conversation by conversation
    length = max(len(r) for r, _ in ours)
    batch = {k: np.zeros((len(ours), length - 1), np.int32) for k in ("inputs", "targets", "mask")}
    for i, (r, m) in enumerate(ours):  # each conversation its own row, padding after it (never trained)
        batch["inputs"][i, : len(r) - 1], batch["targets"][i, : len(r) - 1] = r[:-1], r[1:]
        batch["mask"][i, : len(r) - 1] = m[1:]  # target t trains when token t + 1 is the assistant's
    model = from_hf(folder)
    got = float(next_token_loss(model, token_weights(batch))[1].cross_entropy)
    assert abs(got - want) <= TRL_BOUND, (got, want)
    assert json.loads((tmp_path / "c.json").read_text())["trained_tokens"] == sum(sum(m) for _, m in rows)
