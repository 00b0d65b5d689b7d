# %% [markdown]
# # 08 · Checkpoints: Hugging Face in, fine-tune, interrupt, resume, Hugging Face out, generate
#
# The whole life of a checkpoint, offline: nothing is downloaded. We write a small text file, train a
# tokenizer on it, and save a randomly initialised Llama-style model with `transformers` as a stand-in
# for a published checkpoint. jaxpar imports it, fine-tunes it on the text under the `3d` layout on 8
# simulated devices, survives an interruption, exports the result back to the Hugging Face format, and
# checks that `transformers` computes the same logits from the export. Last, it generates text.
#
# Each step below is a `jaxpar` command, called in-process: `jaxpar(["convert", ...])` is
# `jaxpar convert ...` in a shell. Fine-tuning takes the `jaxpar train` command line too, then calls the
# training loop directly so that the run can be cut off on purpose.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(8)
import json
import pathlib
import tempfile

import jax
import numpy as np

from jaxpar.cli import main as jaxpar

work = pathlib.Path(tempfile.mkdtemp())
print(jax.device_count(), "devices; working in", work)

# %% [markdown]
# ## A local text file and a tokenizer
#
# 1,500 sentences from a tiny grammar, in ten files (a document each): regular enough that a small
# model learns it in a minute. The tokenizer is a byte-level BPE with a 320-token vocabulary trained on the file by the
# `tokenizers` library, with `</s>` as its end-of-text token.

# %%
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

rng = np.random.default_rng(0)
subjects = ["the cat", "a dog", "the old fox", "my sister", "the teacher", "a small bird"]
verbs = ["sees", "follows", "likes", "paints", "finds", "calls"]
objects = ["the river", "a red ball", "the garden", "an open door", "the moon", "a quiet town"]
lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(1500)]
texts = [work / f"stories{i}.txt" for i in range(10)]
for i, path in enumerate(texts):
    path.write_text("\n".join(lines[i::10]) + "\n")

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(
    [str(p) for p in texts],
    trainers.BpeTrainer(vocab_size=320, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
)
print(
    f"{sum(p.stat().st_size for p in texts)} bytes of text, vocabulary {tok.get_vocab_size()}:",
    tok.encode(lines[0]).tokens,
)

# %% [markdown]
# ## A Hugging Face checkpoint
#
# A Llama model with random weights (2 layers, width 64, 4 query heads over 2 key/value heads),
# saved as `config.json` + safetensors with its tokenizer: the same folder layout a published model has.

# %%
import torch
import transformers

torch.manual_seed(0)
hf_cfg = transformers.LlamaConfig(
    vocab_size=tok.get_vocab_size(),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=tok.token_to_id("</s>"),
)
hf_dir = work / "hf-tiny-llama"
transformers.LlamaForCausalLM(hf_cfg).eval().save_pretrained(hf_dir)
tok.save(str(hf_dir / "tokenizer.json"))
print(sorted(p.name for p in hf_dir.iterdir()))

# %% [markdown]
# ## Import, and tokenize the text
#
# `jaxpar convert --from-hf` writes a model checkpoint (orbax, with the model config); `jaxpar prepare`
# turns the text into a token file for the trainer, holding out one of the ten documents for evaluation.

# %%
ckpt, tokens = work / "ckpt", work / "tokens.bin"
assert jaxpar(["convert", "--from-hf", str(hf_dir), "--out", str(ckpt)]) == 0
assert (
    jaxpar(
        [
            "prepare",
            *map(str, texts),
            "--out",
            str(tokens),
            "--tokenizer",
            str(hf_dir / "tokenizer.json"),
            "--eval-fraction",
            "0.1",
        ]
    )
    == 0
)
print(json.loads(tokens.with_suffix(".json").read_text()))

# %% [markdown]
# ## Fine-tune, get interrupted, resume
#
# The arguments below are a `jaxpar train` command line: `build_config` turns them into the run's
# configuration exactly as the command does (the model and its config come from the checkpoint named by
# `--init-from`), and `train(cfg, out)` is what the command then calls. We call it directly for one
# reason: `stop_after` cuts the first run off after step 50 the way a lost runtime would (no final
# checkpoint), so the newest checkpoint on disk is step 40. The same call again finds it (parameters,
# optimizer state, data position), checks that it belongs to this run, and continues: steps 41–50
# repeat the losses of the first run bit for bit.

# %%
from jaxpar.cli import build_parser
from jaxpar.train.command import build_config
from jaxpar.train.loop import train

run = work / "run"
argv = [
    "train",
    "--init-from",
    str(ckpt),
    "--mesh",
    "3d",
    "--steps",
    "70",
    "--batch",
    "16",
    "--seq",
    "64",
    "--out",
    str(run),
]
for setting in (
    "data.source=files",
    f"data.path={tokens}",
    f"data.eval_path={tokens.with_suffix('.eval.bin')}",
    "optimizer.learning_rate=3e-3",
    "optimizer.warmup_steps=10",
    "checkpoint.every=20",
    "log.eval_every=35",
    "log.progress=false",
    "log.tensorboard=false",
):
    argv += ["--set", setting]
cfg = build_config(build_parser().parse_args(argv)).validate()
print("jaxpar " + " ".join(argv[:13]) + "".join(f" \\\n    --set {x}" for x in argv[14::2]))
first = train(cfg, run, stop_after=50)
print(
    f"stopped after step {first.last_step}; checkpoints:", sorted(int(p.name) for p in (run / "checkpoints").iterdir())
)
second = train(cfg, run)
same = all(first.losses[s] == second.losses[s] for s in range(41, 51))
print(f"resumed from step {second.start_step}; steps 41-50 identical: {same}")
eval_step = max(second.eval_losses)
print(
    f"loss {first.losses[1]:.3f} at step 1 -> {second.losses[70]:.3f} at step 70; "
    f"held-out loss {second.eval_losses[eval_step]:.3f} at step {eval_step} (ln {tok.get_vocab_size()} = "
    f"{np.log(tok.get_vocab_size()):.3f})"
)

# %%
import matplotlib.pyplot as plt

steps = sorted(second.losses)
plt.figure(figsize=(6, 3))
plt.plot(
    sorted(first.losses),
    [first.losses[s] for s in sorted(first.losses)],
    lw=3,
    alpha=0.4,
    label="first run (stopped at 50)",
)
plt.plot(steps, [second.losses[s] for s in steps], label="resumed run")
plt.xlabel("step")
plt.ylabel("train loss (nats/token)")
plt.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Export, and let `transformers` check it
#
# `jaxpar convert --to-hf` reads the run's newest checkpoint and writes a Hugging Face folder. Loading
# it with `transformers` and comparing logits with jaxpar's on the same tokens checks the whole round
# trip; the difference is float32 rounding between two implementations.

# %%
from jaxpar.convert.store import load_model
from jaxpar.shardings import default_layout

hf_out = work / "hf-finetuned"
assert jaxpar(["convert", "--to-hf", str(run), "--out", str(hf_out)]) == 0
tok.save(str(hf_out / "tokenizer.json"))
ids = np.asarray([tok.encode("the cat sees the moon. a dog finds").ids], np.int32)
layout = default_layout(cfg.model, "dp")
model, _ = load_model(run, layout)
with layout.activate():
    ours = np.asarray(jax.jit(lambda m, x: m(x))(model, ids))
reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_out, dtype=torch.float32).eval()
with torch.no_grad():
    theirs = reloaded(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
max_diff = float(np.abs(ours - theirs).max())
print(f"max |jaxpar - transformers| logit difference: {max_diff:.2e}")
assert max_diff < 1e-4, max_diff  # float32: the two implementations round differently, no more

# %% [markdown]
# ## Generate
#
# `jaxpar generate` from the exported folder (its `tokenizer.json` and EOS id come with it), greedy, on
# one device (a model of 4 heads cannot split 8 tensor ways: `--mesh decode_tp` is refused with that
# message before any weight loads; notebook 07 shows the decode layouts).

# %%
import contextlib
import io

out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert (
        jaxpar(
            [
                "generate",
                "--from",
                str(hf_out),
                "--prompt",
                "the old fox",
                "--prompt",
                "my sister paints",
                "--max-new-tokens",
                "12",
                "--json",
            ]
        )
        == 0
    )
generated = json.loads(out.getvalue())
for prompt, text in zip(["the old fox", "my sister paints"], generated["text"]):
    print(f"{prompt!r} -> {text!r}")

# %%
key_numbers = {
    "vocab_size": tok.get_vocab_size(),
    "first_loss": first.losses[1],
    "last_loss": second.losses[70],
    "eval_loss": second.eval_losses[eval_step],
    "resumed_from": second.start_step,
    "stopped_at": first.last_step,
    "identical_after_resume": same,
    "max_logit_diff": max_diff,
    "generated": generated["text"],
}
key_numbers
