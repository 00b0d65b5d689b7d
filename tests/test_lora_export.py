"""LoRA on a Hugging Face model, in and out: ``jaxpar train --init-from HF_DIR --set model.lora.rank=4``
trains adapters on the folder's weights (left bit for bit as they were); ``jaxpar convert --to-hf``
writes the run merged, so that ``transformers`` gives the adapted model's logits, and ``--to-peft`` its
adapters alone, which ``peft`` loads onto the folder's model with the same logits, within the bound the
Hugging Face model's own float noise sets (tests/hf_models.py). ``--from-hf --adapter`` reads them
back: the run's model, bit for bit."""

import jax
import numpy as np
from flax import nnx
from hf_models import IDS, build, logit_bound, logits, own_noise, save

from jaxpar.cli import main
from jaxpar.convert import from_hf
from jaxpar.convert.store import load_model
from jaxpar.layers.lora import LoraParam
from jaxpar.shardings import default_layout

QUIET = ["log.progress=false", "log.tensorboard=false", "log.eval_every=0", "checkpoint.every=3"]
LORA = ["model.lora.rank=4", "model.lora.targets=q,k,v,o,gate_up,down", "optimizer.learning_rate=1e-2"]


def test_adapters_on_a_hugging_face_model_train_and_export_merged(tmp_path):
    import peft
    import transformers

    save(build("llama"), tmp_path / "hf")
    args = ["train", "--init-from", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), "--steps", "3"]
    args += ["--batch", "8", "--seq", "16", "--mesh", "fsdp=8"]
    assert main(args + [x for item in QUIET + LORA for x in ("--set", item)]) == 0
    base = from_hf(tmp_path / "hf")  # on one device
    layout = default_layout(base.cfg, "dp", devices=jax.devices()[:1], execution=base.execution)
    run, step = load_model(tmp_path / "run", layout)
    assert step == 3 and run.cfg.lora.rank == 4
    trained = dict(nnx.to_flat_state(nnx.state(run, nnx.Not(LoraParam))))
    for path, var in nnx.to_flat_state(nnx.state(base)):  # the folder's weights, bit for bit
        assert np.array_equal(np.asarray(var.get_value()), np.asarray(trained[path].get_value())), path
    b = [
        np.abs(np.asarray(v.get_value())).max()
        for p, v in nnx.to_flat_state(nnx.state(run, LoraParam))
        if "_b" in str(p[-1])
    ]
    assert min(b) > 0  # every adapter trained
    assert main(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "merged")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with layout.activate():
        want = np.asarray(run(IDS), np.float64)
    got = logits(theirs, IDS)
    assert np.max(np.abs(got - want)) <= logit_bound(own_noise(theirs, IDS))
    assert np.max(np.abs(want - logits(build("llama"), IDS))) > 100 * logit_bound(own_noise(theirs, IDS))  # adapted
    assert main(["convert", "--to-peft", str(tmp_path / "run"), "--out", str(tmp_path / "adapter")]) == 0
    adapted = peft.PeftModel.from_pretrained(build("llama"), tmp_path / "adapter").eval()
    assert np.max(np.abs(logits(adapted, IDS) - want)) <= logit_bound(own_noise(adapted, IDS))
    back = ["convert", "--from-hf", str(tmp_path / "hf"), "--adapter", str(tmp_path / "adapter")]
    assert main([*back, "--out", str(tmp_path / "ckpt")]) == 0
    again, _ = load_model(tmp_path / "ckpt", layout)
    with layout.activate():
        assert np.array_equal(np.asarray(again(IDS)), np.asarray(run(IDS)))  # the same weights and program
