"""PEFT LoRA adapters in and out (jaxpar.convert.peft): an adapter PEFT made loads onto the Hugging Face
folder and gives PEFT's logits within the bound the Hugging Face model's own float noise sets
(tests/hf_models.py), sharded as well as on one device; written back, it is PEFT's file tensor for
tensor; a wrong map (gate and up swapped) is caught by that bound; and every field or tensor we do
not implement is refused by name before anything is placed."""

import json

import numpy as np
import pytest
from hf_models import IDS, build, logit_bound, logits, own_noise, save
from safetensors.numpy import load_file, save_file

from jaxpar.cli import main
from jaxpar.convert import ConvertError, from_hf, save_adapter
from jaxpar.convert.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS

MLP = ["gate_proj", "up_proj", "down_proj"]
MODULES = {  # family -> the modules its adapter targets (Mixtral's MLPs are experts: attention only)
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", *MLP],
    "qwen2": ["q_proj", "v_proj", *MLP],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],  # MLA's
}


def _peft_adapter(family: str, folder, **fields):
    """A PEFT adapter with random A and B on ``family``'s tiny model, saved to ``folder``; its model."""
    import peft

    config = dict(r=4, lora_alpha=8, target_modules=MODULES[family], init_lora_weights=False) | fields
    model = peft.get_peft_model(build(family), peft.LoraConfig(task_type="CAUSAL_LM", **config)).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny Llama folder and a PEFT adapter on every projection: (folder, adapter, PEFT's logits, bound)."""
    tmp = tmp_path_factory.mktemp("peft")
    save(build("llama"), tmp / "hf")
    theirs = _peft_adapter("llama", tmp / "adapter")
    return tmp / "hf", tmp / "adapter", logits(theirs, IDS), logit_bound(own_noise(theirs, IDS))


MESHES = [
    ("llama", "fsdp=4,tensor=2"),
    ("qwen2", None),
    ("mixtral", "data=4,tensor=2"),
    ("deepseek_v3", "fsdp=4,tensor=2"),
]


@pytest.mark.parametrize("family, mesh", MESHES)
def test_a_peft_adapter_imports_with_its_logits_and_exports_as_it_was(tmp_path, family, mesh):
    save(build(family), tmp_path / "hf")
    theirs = _peft_adapter(family, tmp_path / "adapter")
    ids = np.concatenate([IDS] * 4)  # a batch the meshes divide
    want, bound = logits(theirs, ids), logit_bound(own_noise(theirs, ids))
    model = from_hf(tmp_path / "hf", mesh=mesh, adapter=tmp_path / "adapter")
    with model.layout.activate():
        got = np.asarray(model(ids), np.float64)
    assert np.max(np.abs(got - want)) <= bound
    assert np.max(np.abs(logits(build(family), ids) - want)) > 100 * bound  # the adapter matters
    save_adapter(model, tmp_path / "out")
    ours, peft_file = load_file(tmp_path / "out" / ADAPTER_WEIGHTS), load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS)
    assert sorted(ours) == sorted(peft_file)
    assert all(np.array_equal(ours[k], peft_file[k]) for k in ours)
    config = json.loads((tmp_path / "out" / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 8, sorted(MODULES[family]))


def test_an_exported_adapter_loads_in_peft_and_a_wrong_map_is_caught(llama, tmp_path):
    import peft

    hf, adapter, want, bound = llama
    model = from_hf(hf, adapter=adapter)
    save_adapter(model, tmp_path / "out")
    theirs = peft.PeftModel.from_pretrained(build("llama"), tmp_path / "out").eval()
    assert np.max(np.abs(logits(theirs, IDS) - want)) <= bound
    tensors = load_file(tmp_path / "out" / ADAPTER_WEIGHTS)  # mutation: gate's and up's B swapped
    swapped = {
        k.replace("gate_proj", "@").replace("up_proj", "gate_proj").replace("@", "up_proj"): v
        for k, v in tensors.items()
    }
    save_file(
        {k: v for k, v in tensors.items() if "lora_A" in k} | {k: v for k, v in swapped.items() if "lora_B" in k},
        tmp_path / "out" / ADAPTER_WEIGHTS,
    )
    wrong = peft.PeftModel.from_pretrained(build("llama"), tmp_path / "out").eval()
    assert np.max(np.abs(logits(wrong, IDS) - want)) > 100 * bound


def test_rslora_reads_as_the_equivalent_alpha(tmp_path):
    save(build("llama"), tmp_path / "hf")
    theirs = _peft_adapter("llama", tmp_path / "adapter", use_rslora=True, r=16, lora_alpha=4)
    model = from_hf(tmp_path / "hf", adapter=tmp_path / "adapter")
    assert model.cfg.lora.scale == pytest.approx(4 / 4)  # 4 / √16
    got = np.asarray(model(IDS), np.float64)
    assert np.max(np.abs(got - logits(theirs, IDS))) <= logit_bound(own_noise(theirs, IDS))


def _edited(src, dst, config=None, tensors=None):
    """A copy of the adapter folder ``src`` at ``dst`` with its config fields and tensors changed."""
    dst.mkdir()
    fields = json.loads((src / ADAPTER_CONFIG).read_text()) | (config or {})
    (dst / ADAPTER_CONFIG).write_text(json.dumps(fields))
    stored = load_file(src / ADAPTER_WEIGHTS)
    save_file(
        {k: v for k, v in (tensors(stored) if tensors else stored).items() if v is not None}, dst / ADAPTER_WEIGHTS
    )
    return dst


Q = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
BAD = {
    "dora": ({"use_dora": True}, None, "use_dora=True"),
    "bias": ({"bias": "all"}, None, "bias='all'"),
    "not lora": ({"peft_type": "IA3"}, None, "peft_type='IA3'"),
    "regex": ({"target_modules": ".*proj"}, None, "target_modules"),
    "unknown module": ({"target_modules": ["q_proj", "lm_head"]}, None, "'lm_head'"),
    "rank pattern": ({"rank_pattern": {"q_proj": 8}}, None, "rank_pattern"),
    "saved modules": ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    "new field": ({"some_future_switch": "on"}, None, "some_future_switch"),
    "rank": ({"r": 0}, None, "r=0"),
    "extra tensor": (None, lambda t: t | {"base_model.model.lm_head.lora_A.weight": t[Q + "A.weight"]}, "lm_head"),
    "shape": (None, lambda t: t | {Q + "A.weight": t[Q + "A.weight"][:2]}, "has shape [2, 64]"),
    "half a pair": (None, lambda t: t | {Q + "B.weight": None}, Q + "B.weight is missing"),
}


@pytest.mark.parametrize("case", BAD)
def test_what_the_import_does_not_implement_is_refused_by_name(llama, tmp_path, case):
    config, tensors, message = BAD[case]
    folder = _edited(llama[1], tmp_path / "bad", config, tensors)
    with pytest.raises(ConvertError, match=message.replace("[", r"\[").replace(".", r"\.")):
        from_hf(llama[0], adapter=folder)


def test_the_command_line_refuses_before_writing(llama, tmp_path, capsys):
    hf, adapter, _, _ = llama
    assert main(["convert", "--from-hf", str(hf), "--out", str(tmp_path / "plain")]) == 0
    assert main(["convert", "--to-peft", str(tmp_path / "plain"), "--out", str(tmp_path / "x")]) == 2
    assert "no LoRA adapters" in capsys.readouterr().err
    plain = str(tmp_path / "plain")
    assert main(["convert", "--to-hf", plain, "--adapter", str(adapter), "--out", str(tmp_path / "x")]) == 2
    assert "--adapter: goes with --from-hf" in capsys.readouterr().err
    with pytest.raises(ConvertError, match="exists"):
        save_adapter(from_hf(hf, adapter=adapter), adapter)
    assert not (tmp_path / "x").exists()
