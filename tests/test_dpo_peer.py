"""A peer's numbers for DPO: on the same tiny Hugging Face Llama with the same LoRA adapter (random, made
by PEFT) and the same preference batch, ``jaxpar prepare --field preference`` tokenizes and masks every
pair as TRL's ``DPOTrainer`` does, and the preference loss with the adapters-off reference equals TRL's,
sigmoid and IPO, with its rewards (TRL, PEFT, transformers and torch: test-only)."""

import numpy as np
import pytest
from test_corpus import _jsonl, _prepare
from test_sft_peer import chat_llama

from jaxpar.convert import from_hf
from jaxpar.data import PackedRows, batch_of_rows, plan_pairs
from jaxpar.train.loss import token_weights
from jaxpar.train.preference import PreferenceConfig, preference_loss

TRL_BOUND = 1e-5  # the bound on |jaxpar - TRL| (float32 on both sides)
BETA = 0.5
USER = lambda text: [{"role": "user", "content": text}]  # noqa: E731
SAYS = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
PAIRS = [
    {"prompt": USER("reverse abc"), "chosen": SAYS("cba"), "rejected": SAYS("abc")},
    {"prompt": USER("hello the cat"), "chosen": SAYS("the cat says hello"), "rejected": SAYS("no")},
    {"prompt": USER("a dog ran"), "chosen": SAYS("ran dog a"), "rejected": SAYS("a dog ran a dog ran")},
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random Llama with a byte-level BPE tokenizer and a ChatML template, and a PEFT adapter."""
    import peft

    folder = tmp_path_factory.mktemp("hf")
    model = chat_llama(folder)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(folder / "adapter")
    return folder


def _trl(folder, tmp_path, loss: str):
    """(loss, {metric: value}, [(chosen ids, rejected ids, prompt length)]) of TRL's DPOTrainer, one batch."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, folder / "adapter", is_trainable=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=BETA,
        loss_type=[loss],
        per_device_train_batch_size=len(PAIRS),
        report_to=[],
        use_cpu=True,
        bf16=False,  # TRL's default: the reference model would run under bfloat16 autocast
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # the base
    data = datasets.Dataset.from_list(PAIRS)
    trainer = trl.DPOTrainer(
        model=model, ref_model=reference, args=args, train_dataset=data, processing_class=tokenizer
    )
    rows = [
        (r["prompt_ids"] + r["chosen_ids"], r["prompt_ids"] + r["rejected_ids"], len(r["prompt_ids"]))
        for r in trainer.train_dataset
    ]
    batch = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        value = float(trainer.compute_loss(model, batch))
    metrics = {k: v[-1] for k, v in trainer._metrics["eval"].items()}
    return value, metrics, rows


def _ours(folder, tmp_path, capsys) -> tuple[list, dict]:
    """(the pairs as prepared: [(chosen ids, rejected ids, first trained token)], their batch)."""
    data = tmp_path / "prefs.jsonl"
    data.write_bytes(_jsonl(PAIRS))
    out = tmp_path / "p.bin"
    rc, _, err = _prepare(capsys, data, "--field", "preference", "--tokenizer", folder / "tokenizer.json", "--out", out)
    assert rc == 0, err
    ids, mask = np.fromfile(out, np.uint16), np.fromfile(tmp_path / "p.mask.bin", np.uint8)
    offsets = np.load(tmp_path / "p.docs.npy")
    docs = [(ids[a:b].tolist(), int(np.argmax(mask[a:b]))) for a, b in zip(offsets[:-1], offsets[1:])]
    pairs = [(c, r, start) for (c, start), (r, _) in zip(docs[0::2], docs[1::2])]
    row = 2 * max(len(c) + len(r) for c, r, _ in pairs)
    plan, dropped = plan_pairs(offsets[:-1], np.diff(offsets), row)
    assert dropped == 0
    rows = PackedRows(lambda a, b: ids[a:b], lambda a, b: mask[a:b], plan, row, 0, plan.rows, pairs=True)
    stacked = {k: np.stack([rows[i][k] for i in range(plan.rows)]) for k in rows[0]}
    return pairs, batch_of_rows(stacked)


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_the_preference_loss_equals_trl_dpo(folder, tmp_path, capsys, loss):
    want, metrics, theirs = _trl(folder, tmp_path, loss)
    pairs, batch = _ours(folder, tmp_path, capsys)
    assert [(c, r) for c, r, _ in pairs] == [(c, r) for c, r, _ in theirs]  # the same tokens, pair by pair
    assert [start for _, _, start in pairs] == [n for _, _, n in theirs]  # the same completions trained
    model = from_hf(folder, adapter=folder / "adapter")
    cfg = PreferenceConfig(beta=BETA, loss=loss, reference="adapters_off")
    got, parts = preference_loss(model, token_weights(batch), cfg=cfg)
    assert abs(float(got) - want) <= TRL_BOUND, (float(got), want)
    for ours, trl_name in [
        ("rewards/margin", "rewards/margins"),
        ("rewards/chosen", "rewards/chosen"),
        ("logps/rejected", "logps/rejected"),
    ]:
        assert abs(float(parts.extra[ours]) - metrics[trl_name]) <= TRL_BOUND * max(1.0, abs(metrics[trl_name])), ours
