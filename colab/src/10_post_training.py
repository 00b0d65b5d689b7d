# %% [markdown]
# # 10 · Post-training: SFT → LoRA → DPO → GRPO
#
# A pretrained model is taught a task in stages. **Supervised fine-tuning** (SFT) shows it
# demonstrations. **LoRA** trains small adapters beside the frozen weights instead of the weights.
# **DPO** shows it pairs of answers, one preferred, and needs no reward model. **GRPO** lets it answer,
# scores the answers with a program, and pushes it towards the better ones of each group. This notebook
# runs all four on one toy task with jaxpar, on 8 simulated CPU devices: a byte-level `tiny` model is
# asked `word>` and should answer the word reversed.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)
import dataclasses
import json
import math
import pathlib
import tempfile

import jax
import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxpar.cli import main
from jaxpar.convert.store import load_model
from jaxpar.inference.engine import Engine
from jaxpar.inference.scheduler import Request
from jaxpar.rl.grpo import GRPOConfig
from jaxpar.rl.loop import run_grpo
from jaxpar.shardings import default_layout
from jaxpar.train.config import apply_overrides, default_config
from jaxpar.train.loop import train
from jaxpar.train.optim import OptimizerConfig

work = pathlib.Path(tempfile.mkdtemp(prefix="post-training-"))
rng = np.random.default_rng(0)
words = ["".join(rng.choice(list("abcd"), rng.integers(3, 6))) for _ in range(1100)]
train_words, held_out = words[:1000], words[1000:]
EOS = 256  # the byte tokenizer's end of document
key_numbers = {}


def metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def settings(*extra):
    common = ["model.vocab_size=257", "log.progress=false", "log.tensorboard=false", "mesh=fsdp=8", "batch=16"]
    return apply_overrides(default_config("tiny"), [*common, *extra])


# %% [markdown]
# ## 1. SFT: demonstrations
#
# Each demonstration is a document `word>drow`, written by `jaxpar prepare` as bytes with an EOS after
# it. Training on whole documents (`data.pack=documents`) is plain next-token prediction; in 250 steps
# the model learns the format and about half of the reversals.

# %%
(work / "sft.jsonl").write_text("".join(json.dumps({"text": f"{w}>{w[::-1]}"}) + "\n" for w in train_words))
main(["prepare", str(work / "sft.jsonl"), "--bytes", "--out", str(work / "sft.npy")])
sft = train(
    settings(
        "data.source=files",
        f"data.path={work / 'sft.npy'}",
        "data.pack=documents",
        "seq=32",
        "steps=250",
        "optimizer.learning_rate=3e-3",
        "optimizer.warmup_steps=20",
        "log.eval_every=50",
    ),
    work / "sft",
)
sft_curve = metrics(work / "sft")


def answers(model, words):
    """The model's greedy answers (the serving engine, continuous batching over a paged cache)."""
    engine = Engine(model, max_slots=100, page_size=16, max_length=32)
    requests = [Request(i, list(f"{w}>".encode()), 8, stop_ids=frozenset([EOS])) for i, w in enumerate(words)]
    engine.run(requests)
    return [bytes(t for t in r.tokens[len(r.prompt) :] if t < 256).decode("latin-1") for r in requests]


def reversal_accuracy(model, words):
    """The share of words the model reverses exactly."""
    return float(np.mean([a == w[::-1] for a, w in zip(answers(model, words), words)]))


one = default_layout(settings().model, "dp", devices=jax.devices()[:1])
sft_model, _ = load_model(work / "sft", one)
key_numbers["sft_accuracy"] = reversal_accuracy(sft_model, held_out)
print(f"SFT: held-out words reversed exactly: {key_numbers['sft_accuracy']:.0%}")

# %% [markdown]
# ## 2. LoRA + DPO: preferences
#
# DPO needs pairs: for each prompt a chosen answer (the reversal) and a rejected one: here the SFT
# model's own wrong answers to the training words, so DPO works on the mistakes it makes. `jaxpar
# prepare --field preference` writes each pair as two documents, and `data.pack=pairs` puts both in one
# row, kept apart by segment ids. The run starts from the SFT
# weights (`init_from`) and trains rank-8 LoRA adapters only; the reference is the same model with the
# adapters switched off, so the first step's loss is log 2 exactly.

# %%
mistakes = [(w, a) for w, a in zip(train_words, answers(sft_model, train_words)) if a != w[::-1] and a]
pairs = [{"prompt": f"{w}>", "chosen": w[::-1], "rejected": a} for w, a in mistakes]
print(f"{len(pairs)} pairs from the SFT model's mistakes on {len(train_words)} training words")
(work / "prefs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
main(["prepare", str(work / "prefs.jsonl"), "--field", "preference", "--bytes", "--out", str(work / "prefs.npy")])
dpo = train(
    settings(
        "data.source=files",
        f"data.path={work / 'prefs.npy'}",
        "data.pack=pairs",
        "objective=dpo",
        f"init_from={work / 'sft'}",
        "model.lora.rank=8",
        "model.lora.targets=q,k,v,o,gate_up,down",
        "seq=48",
        "steps=40",
        "dpo.beta=0.1",
        "optimizer.learning_rate=1e-3",
        "optimizer.warmup_steps=0",
        "optimizer.schedule=constant",
        "log.eval_every=30",
    ),
    work / "dpo",
)
dpo_curve = metrics(work / "dpo")
dpo_model, _ = load_model(work / "dpo", one)  # the SFT weights and the trained adapters
key_numbers.update(
    dpo_first_loss=dpo_curve[0]["loss"],
    dpo_last_margin=dpo_curve[-1]["rewards/margin"],
    dpo_accuracy=reversal_accuracy(dpo_model, held_out),
)
first, last = dpo_curve[0], dpo_curve[-1]
print(f"DPO: first loss {first['loss']:.7f} (log 2 = {math.log(2):.7f}), final margin {last['rewards/margin']:.2f}")
print(
    f"held-out words reversed: after SFT {key_numbers['sft_accuracy']:.0%}, after DPO {key_numbers['dpo_accuracy']:.0%}"
)

fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
ax[0].plot([r["step"] for r in sft_curve], [r["loss"] for r in sft_curve])
ax[0].set(title="SFT: next-token loss", xlabel="step", ylabel="nats / token")
ax[1].plot([r["step"] for r in dpo_curve], [r["logps/chosen"] for r in dpo_curve], label="log π(chosen)")
ax[1].plot([r["step"] for r in dpo_curve], [r["logps/rejected"] for r in dpo_curve], label="log π(rejected)")
ax[1].set(title="DPO on LoRA adapters: both fall, the rejected faster", xlabel="step", ylabel="nats / completion")
ax[1].legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The margin grows and the reward accuracy rises, yet greedy accuracy falls: the chosen answers' log-prob
# falls too, only more slowly than the rejected ones' (Razin et al. 2024 call it likelihood
# displacement). The rejected answers here are the model's own likeliest mistakes, close to the chosen
# ones, which is where DPO moves probability mass to answers in neither set. Remedies add the chosen
# answers' likelihood to the loss (RPO) or keep β larger; the reward only sees the difference.
#
# ## 3. GRPO: rewards from a program, rollouts from the serving engine
#
# GRPO samples 8 answers to each of 4 prompts with the serving engine, in the training process and on the
# training weights, scores each (here: 1 for the exact reversal, else the share of right characters
# times 0.5), and compares each answer with its group's mean. It starts from the SFT model and trains
# every weight.


# %%
def reward(prompt, completion):
    word = bytes(prompt[:-1]).decode("latin-1")
    answer = bytes(t for t in completion if t < 256).decode("latin-1")
    if answer == word[::-1]:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(answer, word[::-1])) / len(word)


prompts = [list(f"{w}>".encode()) for w in train_words]
grpo = run_grpo(
    dataclasses.replace(settings().model),
    prompts,
    reward,
    cfg=GRPOConfig(prompts=4, group_size=8, max_new_tokens=8, updates=2),
    iterations=40,
    optimizer=OptimizerConfig(learning_rate=5e-5, warmup_steps=0, schedule="constant"),
    mesh="fsdp=8",
    stop_ids=[EOS],
    init=sft_model,
)
rewards = [r["reward"] for r in grpo.records]
grpo_model = nnx.merge(grpo.graphdef, grpo.state)[0]
key_numbers.update(
    grpo_first_reward=float(np.mean(rewards[:5])),
    grpo_last_reward=float(np.mean(rewards[-5:])),
    grpo_accuracy=reversal_accuracy(grpo_model, held_out),
    rollout_share=float(np.mean([r["rollout_s"] / (r["rollout_s"] + r["update_s"]) for r in grpo.records[1:]])),
)
plt.figure(figsize=(6, 3))
plt.plot([r["iteration"] for r in grpo.records], rewards)
plt.xlabel("rollout batch (2 updates each)")
plt.ylabel("mean reward")
plt.title("GRPO from the SFT model")
plt.show()
print(
    f"GRPO: mean reward {key_numbers['grpo_first_reward']:.2f} → {key_numbers['grpo_last_reward']:.2f}; "
    f"held-out words reversed: SFT {key_numbers['sft_accuracy']:.0%}, DPO {key_numbers['dpo_accuracy']:.0%}, "
    f"GRPO {key_numbers['grpo_accuracy']:.0%}; "
    f"rollouts took {key_numbers['rollout_share']:.0%} of each iteration"
)

# %% [markdown]
# At this scale (a 100k-parameter model, 40 rollout batches of 4 prompts, the mean reward of each batch
# over 32 samples) GRPO from the SFT model moves neither the reward nor the held-out accuracy by more than
# their noise; larger learning rates made it worse. On a task whose reward the model can find by
# sampling, the same loop learns within 40 batches: `benchmarks/grpo.py` teaches `tiny` to answer in
# digits, its mean reward going from 0.04 to 1 (docs: Post-training).
#
# ## What to take away
#
# - SFT teaches the format from demonstrations. DPO and GRPO move the model by comparisons, not
#   targets, and that is where they can go wrong: DPO's margin can grow while both answers lose
#   probability, and a policy gradient needs rewards the samples actually reach.
# - With LoRA only the adapters train: the optimizer holds adapter-sized state, and the reference of DPO
#   is the same weights with the adapters off, with no second model in memory.
# - GRPO's rollouts come from the same engine `jaxpar serve` runs, in the training process: the
#   log-probs it samples with are the trainer's own (`tests/test_grpo.py` checks them within 1e-5).
