"""The layout lab: analytic minimum bytes on hand-worked cases, measured bytes against the minimum on
small models for dp, fsdp, tp, ring and ep, the HLO reading against a direct count, bad input."""
import math
import re
import types

import pytest

from jaxpar.analysis.costmodel import Activations, activation_bytes, weight_bytes
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.analysis.plan import link_of, plan
from jaxpar.cli import main
from jaxpar.meshes import compose_rules


def _param(size_shape, spec, names=None, dtype="float32"):
    import math
    return types.SimpleNamespace(size=math.prod(size_shape), spec=spec, names=names or (None,) * len(spec),
                                 dtype=dtype, shard_shape=size_shape)


def test_weight_bytes_by_hand():
    """data=2 × fsdp=4: a [1000, 64] weight sharded on fsdp is gathered twice and reduce-scattered over
    fsdp (3/4 · (2·4 + 4) · 64,000 = 576,000 B), its gradient shard all-reduced over data
    (2·1/2 · 4 · 16,000 = 64,000 B); a replicated [64] norm is all-reduced over data+fsdp together
    (2·7/8 · 4 · 64 = 448 B). An expert weight sharded on expert=2 is never gathered over it."""
    mesh = dict(stage=1, data=2, fsdp=4, expert=1, sequence=1, tensor=1)
    report = types.SimpleNamespace(params=[_param((1000, 64), ("fsdp", None)), _param((64,), (None,))])
    assert weight_bytes(report, mesh, {"data", "fsdp"}) == pytest.approx({"fsdp": 576_000, "data": 64_000,
                                                                          "data+fsdp": 448})
    mesh = dict(stage=1, data=2, fsdp=1, expert=2, sequence=1, tensor=1)
    expert = _param((4, 16, 16), ("expert", None, None), names=("experts", "embed", "mlp"))
    assert weight_bytes(types.SimpleNamespace(params=[expert]), mesh, {"data", "expert"}) == pytest.approx(
        {"data": 2 * 0.5 * 4 * 1024 / 2})


def test_activation_bytes_by_hand():
    """tensor=4, B=8, L=16 (128 tokens on the tensor group), D=32, 2 layers, f32: (4·2 + 2) all-reduce
    equivalents of 2·3/4 · 128·32·4 B. Ring over sequence=4: 3 · 3/4 · 2·8·16·2·8·4 per layer."""
    a = Activations(batch=8, seq=16, embed_dim=32, num_layers=2, kv_heads=2, head_dim=8, num_heads=8, act_bytes=4,
                    context_parallel="ring")
    tensor = dict(stage=1, data=1, fsdp=1, expert=1, sequence=1, tensor=4)
    assert activation_bytes(a, tensor, compose_rules("t", {"tensor"})) == pytest.approx(
        {"tensor": 10 * 1.5 * 128 * 32 * 4})
    ring = dict(tensor, tensor=1, sequence=4)
    assert activation_bytes(a, ring, compose_rules("s", {"sequence"})) == pytest.approx(
        {"sequence": 2 * 3 * 0.75 * 2 * 8 * 16 * 2 * 8 * 4})


def test_links_follow_the_axis_order():
    h100 = HARDWARE["h100"]                        # 8 GPUs per NVLink domain
    mesh = dict(stage=1, data=4, fsdp=8, expert=1, sequence=1, tensor=1)
    assert link_of("fsdp", mesh, h100)[0] == "fast" and link_of("data", mesh, h100)[0] == "slow"
    assert link_of("fsdp", dict(mesh, tensor=2, fsdp=8), h100)[0] == "slow"       # 16 devices span


@pytest.mark.parametrize("model, mesh, overrides, low, high", [
    ("tiny", "dp", {}, 1.0, 1.01),
    ("tiny", "fsdp", {}, 1.0, 1.15),
    # XLA:CPU lowers reduce-scatter as all-reduce + slice: 2(n−1)/n instead of (n−1)/n for half the pairs
    ("tiny", "tp", {}, 1.0, 1.7),
    ("tiny", "cp", dict(context_parallel="ring"), 1.0, 1.05),
    ("tiny-moe", "data=2,expert=4", {}, 1.0, 1.05),
])
def test_measured_bytes_against_the_minimum(model, mesh, overrides, low, high):
    p = plan(model, mesh, batch=8, seq=32, hardware="h100", remat="none", dtype="float32", **overrides)
    assert p.ratio_by_axis, p
    for key, ratio in p.ratio_by_axis.items():
        assert low - 1e-3 <= ratio <= high, (key, ratio, p.bytes_by_axis, p.analytic_min_bytes_by_axis)
    assert p.fits and 0 < p.predicted_mfu < 0.6 and p.predicted_step_s > 0


def test_hlo_reading_equals_a_direct_count():
    """dp: every all-reduce's result bytes, counted straight from the compiled text, equal what the lab
    parsed; ops inside the layer loop run once per layer; the lab's data-axis bytes are 2·7/8 of the total."""
    from jaxpar.analysis import analyze_compiled
    from jaxpar.analysis.costmodel import measured_bytes
    from jaxpar.analysis.plan import compile_step
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import get_model_preset

    cfg = get_model_preset("tiny", remat="none")
    layout = make_layout(cfg, resolve_mesh_arg("dp"), batch=8, seq=32)
    compiled = compile_step(cfg, layout, batch=8, seq=32)
    direct = []
    for line in compiled.as_text().splitlines():
        head, sep, _ = line.partition(" all-reduce(")
        if sep:
            direct.append(sum(math.prod(int(d) for d in dims.split(",") if d) * int(re.sub(r"\D", "", t)) // 8
                              for t, dims in re.findall(r"([a-z]+\d+)\[([\d,]*)\]", head.partition("= ")[2])))
    ops = [op for op in analyze_compiled(compiled, mesh=layout.mesh).ops if op.kind == "all-reduce"]
    assert sorted(op.bytes for op in ops) == sorted(direct)
    assert {op.executions for op in ops} <= {1, cfg.num_layers}
    total = sum(op.bytes * op.executions for op in ops)
    assert total == 4 * cfg.num_params(padded=True) + 4                     # every gradient, and the loss
    assert measured_bytes(ops) == {"data": pytest.approx(2 * 7 / 8 * total)}


@pytest.mark.parametrize("argv, message", [
    (["--hardware", "h300"], "unknown hardware 'h300'"),
    (["--devices", "4096"], "--devices=4096: this machine simulates 1..2048"),
    (["--mesh", "expert=8", "--model", "tiny-moe"], "model.moe.num_experts=4 (logical axis 'experts') is not "
                                                     "divisible by mesh axes expert=8"),
])
def test_bad_input(argv, message, capsys):
    base = dict(zip(["--model", "--mesh", "--batch", "--seq", "--hardware", "--devices"],
                    ["tiny", "dp", "8", "32", "h100", "8"]))
    base.update(zip(argv[::2], argv[1::2]))
    assert main(["plan", *[x for kv in base.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err


def test_search_ranks_a_hand_made_case(tmp_path, capsys):
    """llama3-8b needs 16 B × 8.03e9 = 128 GB of parameters, gradients and Adam moments: on 32 GB TPU v6e
    chips it fits only when its weights are split 8 ways (fsdp × tensor = 8; 4 ways leave 32.1 GB before
    any activation). The fitting layouts come first, fastest first."""
    from jaxpar.analysis.search import factorizations, search

    assert len(factorizations(8, ("data", "fsdp", "tensor"))) == 10
    ranked, refused = search("llama3-8b", 8, batch=8, seq=2048, hardware="tpu-v6e")
    assert len(ranked) + len(refused) == len(factorizations(8, ("data", "fsdp", "sequence", "tensor")))
    fitting = [c for c in ranked if c.fits]
    assert fitting and all(c.mesh.get("fsdp", 1) * c.mesh.get("tensor", 1) == 8 for c in fitting)
    assert ranked[:len(fitting)] == fitting
    assert [c.predicted_step_s for c in fitting] == sorted(c.predicted_step_s for c in fitting)
    assert main(["plan", "--search", "--model", "llama3-8b", "--devices", "8", "--batch", "8", "--seq", "2048",
                 "--hardware", "tpu-v6e", "--plot", str(tmp_path / "search.png")]) == 0
    out = capsys.readouterr().out
    assert "fitting ones first" in out and (tmp_path / "search.png").stat().st_size > 10_000
