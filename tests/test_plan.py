"""The layout lab: analytic minimum bytes on hand-worked cases, measured bytes against the minimum on
small models for dp, fsdp, tp, ring and ep, the HLO reading against a direct count, bad input, and
pipeline parallelism over ``stage`` (sends, bubble, step time, search)."""

import dataclasses
import math
import re
import types

import pytest

from jaxpar.analysis.costmodel import Activations, activation_bytes, weight_bytes
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.analysis.plan import link_of, plan, predict
from jaxpar.cli import main
from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.meshes import compose_rules


def _param(size_shape, spec, names=None, dtype="float32"):
    import math

    return types.SimpleNamespace(
        size=math.prod(size_shape), spec=spec, names=names or (None,) * len(spec), dtype=dtype, shard_shape=size_shape
    )


def test_weight_bytes_by_hand():
    """data=2 × fsdp=4: a [1000, 64] weight sharded on fsdp is gathered twice and reduce-scattered over
    fsdp (3/4 · (2·4 + 4) · 64,000 = 576,000 B), its gradient shard all-reduced over data
    (2·1/2 · 4 · 16,000 = 64,000 B); a replicated [64] norm is all-reduced over data+fsdp together
    (2·7/8 · 4 · 64 = 448 B). An expert weight sharded on expert=2 is never gathered over it."""
    mesh = dict(stage=1, data=2, fsdp=4, expert=1, sequence=1, tensor=1)
    report = types.SimpleNamespace(params=[_param((1000, 64), ("fsdp", None)), _param((64,), (None,))])
    assert weight_bytes(report, mesh, {"data", "fsdp"}) == pytest.approx(
        {"fsdp": 576_000, "data": 64_000, "data+fsdp": 448}
    )
    mesh = dict(stage=1, data=2, fsdp=1, expert=2, sequence=1, tensor=1)
    expert = _param((4, 16, 16), ("expert", None, None), names=("experts", "embed", "mlp"))
    assert weight_bytes(types.SimpleNamespace(params=[expert]), mesh, {"data", "expert"}) == pytest.approx(
        {"data": 2 * 0.5 * 4 * 1024 / 2}
    )


def test_activation_bytes_by_hand():
    """tensor=4, B=8, L=16 (128 tokens on the tensor group), D=32, 2 layers, f32: (4·2 + 2) all-reduce
    equivalents of 2·3/4 · 128·32·4 B. Ring over sequence=4: 3 · 3/4 · 2·8·16·2·8·4 per layer."""
    a = Activations(
        batch=8,
        seq=16,
        embed_dim=32,
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        num_heads=8,
        act_bytes=4,
        context_parallel="ring",
    )
    tensor = dict(stage=1, data=1, fsdp=1, expert=1, sequence=1, tensor=4)
    assert activation_bytes(a, tensor, compose_rules("t", {"tensor"})) == pytest.approx(
        {"tensor": 10 * 1.5 * 128 * 32 * 4}
    )
    ring = dict(tensor, tensor=1, sequence=4)
    assert activation_bytes(a, ring, compose_rules("s", {"sequence"})) == pytest.approx(
        {"sequence": 2 * 3 * 0.75 * 2 * 8 * 16 * 2 * 8 * 4}
    )


def test_links_follow_the_axis_order():
    h100 = HARDWARE["h100"]  # 8 GPUs per NVLink domain
    mesh = dict(stage=1, data=4, fsdp=8, expert=1, sequence=1, tensor=1)
    assert link_of("fsdp", mesh, h100)[0] == "fast" and link_of("data", mesh, h100)[0] == "slow"
    assert link_of("fsdp", dict(mesh, tensor=2, fsdp=8), h100)[0] == "slow"  # 16 devices span


@pytest.mark.parametrize(
    "model, mesh, overrides, low, high",
    [
        ("tiny", "dp", {}, 1.0, 1.01),
        ("tiny", "fsdp", {}, 1.0, 1.15),
        # XLA:CPU lowers reduce-scatter as all-reduce + slice: 2(n−1)/n instead of (n−1)/n for half the pairs
        ("tiny", "tp", {}, 1.0, 1.7),
        ("tiny", "cp", dict(context_parallel="ring"), 1.0, 1.05),
        ("tiny-moe", "data=2,expert=4", {}, 1.0, 1.05),
    ],
)
def test_measured_bytes_against_the_minimum(model, mesh, overrides, low, high):
    p = plan(model, mesh, batch=8, seq=32, hardware="h100", execution=dict(remat="none", dtype="float32") | overrides)
    assert p.ratio_by_axis, p
    for key, ratio in p.ratio_by_axis.items():
        assert low - 1e-3 <= ratio <= high, (key, ratio, p.bytes_by_axis, p.analytic_min_bytes_by_axis)
    assert p.fits and 0 < p.predicted_mfu < 0.6 and p.predicted_step_s > 0


def test_moe_plan_in_bf16_prices_the_experts_by_mechanisms():
    """tiny-moe (bf16, full remat: the plan's defaults) on data=2 × expert=4. Its train step compiles on
    XLA:CPU (a bf16 gradient reduction of the expert weights over the batch shards once aborted XLA:CPU's
    all-reduce promotion; the kernels now take the weights as stored), and the step is priced by the
    mechanism model, the expert all-to-all among its exposed communication: the bytes the model sends for it
    are the bytes the compiled program's all-to-alls send."""
    from jaxpar.analysis.workload import workload_of
    from jaxpar.models import get_execution_preset, get_model_preset

    p = plan("tiny-moe", "data=2,expert=4", batch=16, seq=64, hardware="h100")
    assert p.assumptions["model"] == "mechanisms" and p.times["communication_s"]["expert"] > 0
    assert p.times["step_s"] == pytest.approx(
        p.times["compute_s"] + p.times["memory_s"] + p.times["exposed_communication_s"]
    )
    run = get_execution_preset("tiny-moe", dtype="bfloat16")
    w = workload_of(get_model_preset("tiny-moe"), run, dict(data=2, expert=4), batch=16, seq=64)
    assert (w.experts, w.top_k, w.expert_mlp_dim, w.capacity_factor, w.moe_layers) == (4, 2, 64, 2.0, 2)
    assert w.slots_per_token == 4 and w.replicas == 8  # C = 2·64·2/4 = 64 slots: E·C/S = 4
    # the model's all-to-all, one pass (dispatch and combine, 3/4 of 128 tokens × 4 slots × 64 × 2 B each way),
    # runs forward, again in full remat's recompute, and backward, in both layers: what the program sends
    a2a = 2 * 3 / 4 * 4 * 128 * 64 * 2
    assert p.bytes_by_axis["expert"] == pytest.approx(3 * 2 * a2a, rel=1e-3)
    assert p.times["parts"]["expert_exposed_s"] == pytest.approx(3 * 2 * a2a / HARDWARE["h100"].fast_link)


def test_context_parallel_sends_priced_as_the_program_sends_them():
    """tiny (float32, no remat) with ring attention over sequence=8: 32 local tokens a device, K/V of
    2 × 2 heads × 8 = 32 values a token. The step-time model's ring (``steptime.context_seconds``) sends the
    local K/V 7 times forward, K/V with dK/dV 7 times and dK/dV once more backward, per layer; with the
    gradients' all-reduce over sequence (2·7/8 of the parameters' float32 bytes, as the lab counts an
    all-reduce), that is the program's sequence traffic to 1% (the rest: the token indices and segment
    ids that travel with each block, and the loss)."""
    from jaxpar.models import get_model_preset

    ring = dict(remat="none", dtype="float32", context_parallel="ring")
    p = plan("tiny", "cp", batch=8, seq=32, hardware="h100", execution=ring)
    kv = 32 * 32 * 4
    ring = 2 * (7 * kv + 7 * 2 * kv + kv)  # two layers
    params = get_model_preset("tiny").num_params(padded=True)
    assert p.bytes_by_axis["sequence"] == pytest.approx(ring + 2 * 7 / 8 * 4 * params, rel=0.01)
    assert p.assumptions["model"] == "mechanisms" and p.times["parts"]["sequence_exposed_s"] > 0
    # Ulysses over sequence=2 (data=4): q, k, v and the output, 1/2 of 32 tokens × (8 × 16 + 32) values each
    # way, forward and backward, two layers; the gradients' all-reduce over the pair is 2·1/2 of 4 B a weight
    u = plan(
        "tiny",
        "data=4,sequence=2",
        batch=8,
        seq=32,
        hardware="h100",
        execution=dict(remat="none", dtype="float32", context_parallel="ulysses"),
    )
    a2a = 1 / 2 * 32 * (8 * 16 + 32) * 4
    assert u.bytes_by_axis["sequence"] - 2 * 1 / 2 * 4 * params == pytest.approx(2 * 2 * a2a, rel=0.01)


def test_hlo_reading_equals_a_direct_count():
    """dp: every all-reduce's result bytes, counted straight from the compiled text, equal what the lab
    parsed; ops inside the layer loop run once per layer; the lab's data-axis bytes are 2·7/8 of the total."""
    from jaxpar.analysis import analyze_compiled
    from jaxpar.analysis.costmodel import measured_bytes
    from jaxpar.analysis.plan import compile_step
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import get_model_preset

    cfg, run = get_model_preset("tiny"), ExecutionConfig(remat="none")
    layout = make_layout(cfg, resolve_mesh_arg("dp"), batch=8, seq=32)
    compiled = compile_step(cfg, layout, batch=8, seq=32, execution=run)
    direct = []
    for line in compiled.as_text().splitlines():
        head, sep, _ = line.partition(" all-reduce(")
        if sep:
            direct.append(
                sum(
                    math.prod(int(d) for d in dims.split(",") if d) * int(re.sub(r"\D", "", t)) // 8
                    for t, dims in re.findall(r"([a-z]+\d+)\[([\d,]*)\]", head.partition("= ")[2])
                )
            )
    ops = [op for op in analyze_compiled(compiled, mesh=layout.mesh).ops if op.kind == "all-reduce"]
    assert sorted(op.bytes for op in ops) == sorted(direct)
    assert {op.executions for op in ops} <= {1, cfg.num_layers}
    total = sum(op.bytes * op.executions for op in ops)
    assert total == 4 * cfg.num_params(padded=True) + 4  # every gradient, and the loss
    assert measured_bytes(ops) == {"data": pytest.approx(2 * 7 / 8 * total)}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hardware", "h300"], "unknown hardware 'h300'"),
        (["--devices", "4096"], "--devices=4096: this machine simulates 1..2048"),
        (
            ["--mesh", "expert=8", "--model", "tiny-moe"],
            "model.moe.num_experts=4 (logical axis 'experts') is not divisible by mesh axes expert=8",
        ),
        (["--mesh", "stage=2,fsdp=4", "--microbatches", "3"], "batch=8 / pipeline.microbatches=3 = 2.66667 rows"),
        (
            ["--mesh", "stage=2,fsdp=4", "--schedule", "interleaved"],
            "pipeline.schedule=interleaved needs pipeline.virtual_stages >= 2",
        ),
        (["--mesh", "fsdp=8", "--grad-accum", "3"], "batch=8 / grad_accum=3 = 2.66667 rows per slice"),
        (["--mesh", "fsdp=8", "--grad-accum", "0"], "grad_accum=0: the slices of the batch"),
        (["--mesh", "stage=2,fsdp=4", "--grad-accum", "2"], "grad_accum=2 with mesh stage=2"),
    ],
)
def test_bad_input(argv, message, capsys):
    base = dict(
        zip(
            ["--model", "--mesh", "--batch", "--seq", "--hardware", "--devices"], ["tiny", "dp", "8", "32", "h100", "8"]
        )
    )
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
    meshes = factorizations(8, ("stage", "data", "fsdp", "sequence", "tensor"))
    piped = sum(m.get("stage", 1) > 1 for m in meshes)  # each under the four schedules
    assert len(ranked) + len(refused) == len(meshes) + 3 * piped
    assert {c.pipeline["schedule"] for c in ranked if c.pipeline} == {"gpipe", "1f1b", "interleaved", "zero_bubble"}
    fitting = [c for c in ranked if c.fits]
    ways = lambda c, axes: math.prod(c.mesh.get(a, 1) for a in axes)
    assert fitting and all(ways(c, ("fsdp", "tensor")) == 8 for c in fitting if "stage" not in c.mesh)
    # under a pipeline the layers split stage × fsdp × tensor ways, but every stage holds the embedding and
    # head (2 × 525M parameters) whole: stage=8 keeps 16 B × (6.98e9 / 8 + 1.05e9) = 30.8 GB and does not fit
    assert {tuple(c.mesh.items()) for c in fitting if "stage" in c.mesh} >= {(("stage", 2), ("fsdp", 4))}
    assert all(ways(c, ("stage", "fsdp", "tensor")) == 8 and c.mesh["stage"] < 8 for c in fitting if "stage" in c.mesh)
    assert ranked[: len(fitting)] == fitting
    assert [c.predicted_step_s for c in fitting] == sorted(c.predicted_step_s for c in fitting)
    for c in ranked:  # every layout priced by the mechanism model, its parts with it
        t = c.times
        assert t["step_s"] == c.predicted_step_s
        assert t["step_s"] == pytest.approx(
            t["compute_s"] + t["memory_s"] + t["exposed_communication_s"] + t["parts"]["bubble_s"]
        )
        assert (t["parts"]["bubble_s"] > 0) == ("stage" in c.mesh)
        assert (t["communication_s"]["sequence"] > 0) == ("sequence" in c.mesh)  # GSPMD's K/V gathers
    from jaxpar.analysis.plan_command import candidates_figure

    top, bottom = candidates_figure(fitting, title="fitting").axes
    assert len(top.patches) == len(fitting) and top.get_title() == "fitting"
    assert (
        main(
            [
                "plan",
                "--search",
                "--model",
                "llama3-8b",
                "--devices",
                "8",
                "--batch",
                "8",
                "--seq",
                "2048",
                "--hardware",
                "tpu-v6e",
                "--plot",
                str(tmp_path / "search.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "fitting ones first" in out and (tmp_path / "search.png").stat().st_size > 10_000
    assert "attention: XLA's, every score in HBM" in out  # the kernel the ranking priced


# ------------------------------------------------------------------------------------- pipelines (stage)
def test_stage_sends_and_bubble_of_a_compiled_pipeline():
    """tiny (bf16, full remat) on stage=2 × fsdp=4, 1F1B over m=4 microbatches of 16 × 32 tokens. One send
    is a microbatch's stage input on one device: 4 rows / fsdp 4 = 1 row × 32 × 64 × 2 B = 4096 B, read
    from the compiled collective-permutes. 2·m·(p·v − 1) = 8 sends over the ring, 16,384 B per device; the
    stage total adds the embedding, head and norm gradients' all-reduce over stage (and, measured only,
    the 18 float32 scalars of the losses XLA combines into it: 72 B of 49,480, the 2e-3). Durations in
    chunk forwards: head h = 2·256·64 / ((540,672/3 − 32,768)/2) = 4/9, B = 3 + 1 + 3h = 16/3; the table
    has 2 forward-only ticks and 8 with a B (the executor runs one vjp section on both stages there), so
    the executor's bubble is 1 − 4·(1 + 16/3) / (2 + 8·16/3): the lockstep one (slowest op per tick)."""
    from jaxpar.pipeline import build

    p = plan("tiny", "stage=2,fsdp=4", batch=16, seq=32, hardware="h100", schedule="1f1b", microbatches=4)
    pipe = p.pipeline
    assert pipe["stage_send_bytes"] == pipe["stage_send_bytes_analytic"] == 1 * 32 * 64 * 2
    assert pipe["sends"] == 2 * 4 * (2 * 1 - 1) and pipe["stage_bytes_per_device"] == 8 * 4096 / 2
    assert pipe["send_ticks"] == 8 and pipe["stage_critical_path_bytes"] == 8 * 4096
    assert abs(p.ratio_by_axis["stage"] - 1) < 2e-3, (p.bytes_by_axis, p.analytic_min_bytes_by_axis)
    all_reduce = 2 * 1 / 2 * 4 * (256 * 64 / 4 + 64 * 256 / 4 + 64)  # embed, head on fsdp; norm whole
    assert p.analytic_min_bytes_by_axis["stage"] == pytest.approx(8 * 4096 / 2 + all_reduce)
    assert p.link_by_axis["stage"] == "fast"  # 8 devices: one NVLink domain
    t_b = 3 + 1 + 3 * 4 / 9
    assert pipe["durations"] == pytest.approx({"F": 1.0, "B": t_b})
    table = build("1f1b", 2, 4)
    assert pipe["lockstep_bubble_fraction"] == pytest.approx(table.lockstep_bubble_fraction(1.0, t_b), abs=1e-12)
    assert pipe["bubble_fraction"] == pytest.approx(1 / 5)  # (p−1)/(m+p−1), any durations
    assert pipe["executor_bubble_fraction"] == pytest.approx(1 - 4 * (1 + t_b) / (2 + 8 * t_b))
    assert pipe["executor_bubble_fraction"] == pytest.approx(pipe["lockstep_bubble_fraction"])
    assert pipe["peak_in_flight"] == 2 and pipe["memory"]["stage_buffers"] == (2 + 1 + 2) * 32 * 64 * 2
    # the step from mechanisms: the stage's busy time stretched by the executor's bubble, and the stage
    # traffic on the critical path (the sends, the replicated parameters' all-reduce) over NVLink
    t, parts = p.times, p.times["parts"]
    assert t["bubble_fraction"] == pipe["executor_bubble_fraction"] and p.assumptions["model"] == "mechanisms"
    b = t["bubble_fraction"]
    busy = sum(
        v
        for k, v in parts.items()
        if k not in ("bubble_s", "optimizer_s", "dcn_exposed_s", "stage_exposed_s", "step_s")
    )
    assert parts["bubble_s"] == pytest.approx(busy * b / (1 - b))
    others = p.bytes_by_axis["stage"] - pipe["stage_bytes_per_device"]
    critical = others + pipe["stage_critical_path_bytes"]
    assert parts["stage_exposed_s"] == pytest.approx(critical / HARDWARE["h100"].fast_link)
    assert p.predicted_step_s == pytest.approx(sum(v for k, v in parts.items() if k != "step_s"))
    assert t["pipelined_s"] == pytest.approx(busy + parts["bubble_s"])
    from jaxpar.analysis.plan_command import format_plan

    text = format_plan(p)
    assert f"stretches compute to {t['pipelined_s'] * 1e3:.1f} ms" in text and "from mechanisms" in text
    assert p.flops_per_device == pytest.approx(4 * (1 + t_b) * (540_672 / 3 - 32_768) / 2 * 32)


def test_predict_stretches_compute_by_the_bubble_and_exposes_stage():
    """compute 0.1 s, memory 0.05 s, bubble 1/4: busy 0.1 / 0.75 = 0.133 s. fsdp traffic of 0.1 s on NVLink
    hides behind 0.8 × 0.133 s (the executor's masked sections compute too; unstretched, 0.08 s would
    leave 0.02 s exposed); the stage sends are exposed in full, counted on the critical path (0.03 s),
    not at their mean per device (0.01 s, what the step takes without ``stage_bytes``). On 16 devices the
    stage group spans two NVLink domains: its sends cross InfiniBand."""
    h100 = HARDWARE["h100"]
    mesh = dict(stage=2, data=1, fsdp=4, expert=1, sequence=1, tensor=1)
    measured = {"fsdp": 0.1 * h100.fast_link, "stage": 0.01 * h100.fast_link}
    t = predict(
        measured,
        flops=0.1 * 0.6 * h100.peak_bf16_flops,
        bytes_accessed=0.05 * h100.hbm_bandwidth,
        mesh=mesh,
        hw=h100,
        efficiency=0.6,
        overlap=0.8,
        bubble=0.25,
        stage_bytes=0.03 * h100.fast_link,
    )
    assert t["pipelined_s"] == pytest.approx(0.1 / 0.75)
    assert t["exposed_communication_s"] == pytest.approx(0.03)
    assert t["step_s"] == pytest.approx(0.1 / 0.75 + 0.03)
    plain = predict(measured, flops=0.1 * 0.6 * h100.peak_bf16_flops, bytes_accessed=0.0, mesh=mesh, hw=h100)
    assert plain["step_s"] == pytest.approx(0.1 + (0.1 - 0.08) + 0.01)
    sixteen = dict(mesh, fsdp=8)
    assert link_of("stage", sixteen, h100)[0] == "slow" and link_of("fsdp", sixteen, h100)[0] == "fast"


def test_stage_minimum_by_hand():
    """stage=2 × tensor=2 × data=2, 1F1B, m=4, B=16, T=32, D=64, bf16: a send is 16/4 rows / data 2 ×
    32 positions / tensor 2 (the buffer's length is split like the residual stream) × 64 × 2 B = 4096 B;
    2·4·1 sends over the ring, 16,384 B per device. Tensor's per-layer traffic counts the L/p layers a
    device runs: (4·2 + 2)/2 all-reduce equivalents of 2·1/2 · 8·32·64·2 B."""
    a = Activations(
        batch=16,
        seq=32,
        embed_dim=64,
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        num_heads=8,
        act_bytes=2,
        schedule="1f1b",
        microbatches=4,
    )
    mesh = dict(stage=2, data=2, fsdp=1, expert=1, sequence=1, tensor=2)
    rules = compose_rules("s", {"stage", "data", "tensor"})
    assert activation_bytes(a, mesh, rules) == pytest.approx({"stage": 16_384, "tensor": 5 * 8 * 32 * 64 * 2})
    held = _param((2, 64, 64), ("stage", None, "tensor"), names=("layers", "embed", "mlp"))
    whole = _param((64,), (None,))
    assert weight_bytes(types.SimpleNamespace(params=[held, whole]), mesh, {"data"}) == pytest.approx(
        {"data": 2 * 0.5 * 4 * 8192 / 4 + 2 * 0.5 * 4 * 64, "stage": 2 * 0.5 * 4 * 64}
    )


def test_search_lists_pipelines_and_refuses_indivisible_stacks(capsys):
    """tiny with 4 layers on 8 devices: stage=2 and stage=4 layouts are candidates under every schedule
    (m the largest ≤ 4·p that cuts each data group's rows), every stage=8 one is refused by the layout
    check naming the layers and stage. stage=2 × data=4: m = 4 (16 rows / data 4); stage bytes per device: 8 sends of
    1 row × 32 × 64 × 2 B over 2 stages, plus the 32,832 stage-replicated parameters' gradients
    all-reduced (2·1/2 · 4 B each)."""
    from jaxpar.analysis.search import search

    ranked, refused = search("tiny", 8, batch=16, seq=32, hardware="h100", num_layers=4)
    stages = {c.mesh.get("stage", 1) for c in ranked}
    assert {2, 4} <= stages and 8 not in stages
    eight = [reason for mesh, reason in refused if mesh["stage"] == 8]
    assert eight and all("model.num_layers=4" in r and "stage=8" in r for r in eight), eight
    (c,) = [c for c in ranked if c.mesh == {"stage": 2, "data": 4} and c.pipeline["schedule"] == "1f1b"]
    assert c.pipeline["microbatches"] == 4
    assert c.bytes_by_axis["stage"] == pytest.approx(8 * 32 * 64 * 2 / 2 + 2 * 0.5 * 4 * 32_832)
    ranked3, refused3 = search(
        "tiny", 8, batch=16, seq=32, hardware="h100", num_layers=4, microbatches=3, schedule="1f1b"
    )
    assert all("stage" not in c.mesh for c in ranked3)
    assert any("pipeline.microbatches=3" in r for _, r in refused3)
    assert (
        main(
            [
                "plan",
                "--search",
                "--model",
                "tiny",
                "--devices",
                "8",
                "--batch",
                "16",
                "--seq",
                "32",
                "--hardware",
                "h100",
                "--set",
                "model.num_layers=4",
            ]
        )
        == 0
    )
    assert re.search(r"stage=2,data=4 .* 1f1b m=4, bubble \d+%", capsys.readouterr().out)


@pytest.mark.parametrize(
    "mesh", ["stage=2,expert=4", "data=2,fsdp=2,tensor=2", "sequence=2,tensor=4", "stage=2,fsdp=2,expert=2", "fsdp=8"]
)
def test_search_reshards_as_an_abstract_build_does(mesh):
    """The search builds the model once and maps its parameters' logical names through each candidate's
    rules; that equals ``param_shardings`` building it under the candidate's layout."""
    from jaxpar.analysis.search import _abstract_mesh, base_report, resharded
    from jaxpar.layout import Layout
    from jaxpar.mesh import MeshConfig
    from jaxpar.models import get_model_preset
    from jaxpar.rules import Dim, check_layout
    from jaxpar.shardings import param_shardings

    cfg = get_model_preset("tiny-moe")
    shape = MeshConfig.parse(mesh).resolve(8).shape()
    rules = compose_rules(mesh, {a for a, n in shape.items() if n > 1})
    dims = dict(cfg.logical_dims()) | dict(batch=Dim(16, "batch"), length=Dim(32, "seq"), inner_length=Dim(32, "seq"))
    rules = check_layout(dims, rules, shape)
    assert (
        resharded(base_report(cfg), rules, shape).params
        == param_shardings(cfg, Layout(_abstract_mesh(shape), rules)).params
    )


def _saved_per_token(cfg, execution, batch: int, seq: int) -> tuple[float, float, float]:
    """What jax saves for the backward of ``cfg``'s layers run as ``execution`` says (``saved_residuals`` of
    the loss, one device): bytes per layer and token, per layer and score (a query-key pair), and per layer
    not per token (the weights' casts)."""
    import jax.numpy as jnp
    from flax import nnx
    from jax._src.ad_checkpoint import saved_residuals

    from jaxpar.models import build_model

    graphdef, params, rest = nnx.split(build_model(cfg, execution=execution, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tokens = jnp.zeros((batch, seq), jnp.int32)
    loss = lambda p: nnx.merge(graphdef, p, rest)(tokens).astype(jnp.float32).sum()
    per_token = per_score = per_layer = 0.0
    layers = cfg.num_layers
    for aval, where in saved_residuals(loss, params):
        shape = getattr(aval, "shape", ())
        if "argument" in where or not shape or shape[0] != layers:
            continue  # parameters, and what is outside the layers
        size = math.prod(shape) * aval.dtype.itemsize / layers
        if batch in shape and shape.count(seq) == 2:
            per_score += size / (batch * seq * seq)
        elif batch in shape and seq in shape:
            per_token += size / (batch * seq)
        else:
            per_layer += size
    return per_token, per_score, per_layer


@pytest.mark.parametrize("shape", [dict(), dict(embed_dim=48, num_heads=4, num_kv_heads=1, head_dim=32, mlp_dim=80)])
def test_kept_bytes_are_what_jax_saves(shape):
    """``kept_bytes`` and ``score_bytes`` against the residuals jax saves for tiny's layers (and a shape
    where N·H, D and F all differ), bf16 compute over float32 weights, under each remat policy. Under
    ``none`` jax also keeps each layer's weights cast to bf16 (2 B a parameter; float32 norm scales)."""
    from jaxpar.analysis.costmodel import kept_bytes
    from jaxpar.models import get_model_preset

    for policy in ("full", "attn", "dots", "none"):
        cfg, run = get_model_preset("tiny", **shape), ExecutionConfig(dtype="bfloat16", remat=policy)
        per_token, per_score, per_layer = _saved_per_token(cfg, run, batch=3, seq=40)
        assert per_token == kept_bytes(cfg, run, 2, 1), policy
        assert per_score == (6 * cfg.num_heads if policy == "none" else 0), policy
        d, n, k, h, f = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
        weights = 2 * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) + 4 * 2 * d
        assert per_layer == (weights if policy == "none" else 0), policy


def test_kept_bytes_by_hand():
    """llama3.2-1b in bf16: D = 2048, q and the attention output N·H = 2048, k + v 2·8·64 = 1024, F = 8192.
    full: 2D; attn: 2·(2D + q + kv + out) = 18,432; dots: 2·(2D + q + kv + 2F) = 47,104; none: 2·(2D + q + kv + out
    + 6F) + 24·D + 16
    + 8·32 = 166,160. tensor=2 halves each."""
    from jaxpar.analysis.costmodel import kept_bytes
    from jaxpar.models import get_model_preset

    want = {"full": 4096, "attn": 18_432, "dots": 47_104, "none": 166_160}
    for policy, value in want.items():
        cfg, run = get_model_preset("llama3.2-1b"), ExecutionConfig(remat=policy)
        assert kept_bytes(cfg, run, 2, 1) == value and kept_bytes(cfg, run, 2, 2) == value / 2


def test_memory_holds_xla_attentions_scores():
    """tiny (D 64, N 8 × H 8, K 2, F 128, 2 layers, V 256), bf16, 2 × 32 tokens on one device, 10 local
    parameter elements (none of them a layer's). Kept per layer and token under remat none: 2·(128 + 64 + 32
    + 64 + 768) + 24·64 + 16 + 64 = 3,728 B; XLA's attention adds one layer's scores, 64 queries × 8 heads ×
    32 keys, kept at 4 + 2 B and worked on at 8 + 2 B. cuDNN's flash kernel holds none; full remat keeps D."""
    from jaxpar.analysis.costmodel import flash_attention, memory_parts
    from jaxpar.analysis.plan import activations_of
    from jaxpar.models import get_model_preset

    report = types.SimpleNamespace(params=[types.SimpleNamespace(shard_shape=(10,), names=("embed",))])
    mesh = dict(stage=1, data=1, fsdp=1, expert=1, sequence=1, tensor=1)
    scores, common = 64 * 8 * 32, 16 * 64 * 128 * 2 + 8 * 64 * 256
    for policy, impl, kept, working in (
        ("none", None, 2 * (64 * 3728 + 6 * scores), 10 * scores),
        ("none", "cudnn", 2 * 64 * 3728, 0),
        ("full", None, 2 * 64 * 64 * 2, 10 * scores),
    ):
        cfg, run = get_model_preset("tiny"), ExecutionConfig(dtype="bfloat16", remat=policy, attention_impl=impl)
        assert flash_attention(run) == (impl == "cudnn")
        parts = memory_parts(cfg, run, report, activations_of(cfg, batch=2, seq=32, execution=run), mesh, set())
        assert parts["state"] == 160 and parts["kept"] == kept
        assert parts["activations"] == pytest.approx(kept + working + common)
    assert flash_attention(ExecutionConfig(context_parallel="ring"))


def test_plan_prices_the_attention_kernel_it_is_given():
    """``attention_impl=cudnn`` compiles (as XLA's: the CPU has no cuDNN) and is priced as flash: causal half
    of the scores at the flash share; XLA's attention computes every score and moves them over HBM."""
    from jaxpar.analysis.workload import workload_of
    from jaxpar.models import get_model_preset

    flash = plan("tiny", "dp", batch=4, seq=256, hardware="h100", devices=1, execution=dict(attention_impl="cudnn"))
    xla = plan("tiny", "dp", batch=4, seq=256, hardware="h100", devices=1)
    assert flash.times["parts"]["attention_s"] < xla.times["parts"]["attention_s"] / 2
    assert flash.estimated_memory_bytes < xla.estimated_memory_bytes
    assert not workload_of(get_model_preset("tiny"), ExecutionConfig(), {}, batch=4, seq=256).flash


def test_grad_accum_prices_what_the_accumulating_step_does():
    """``grad_accum`` k: one slice's activations live at a time (the estimate's and XLA:CPU's compiled
    temporaries both fall), a float32 gradient sum joins the state, and the weights are gathered and the
    gradients reduced once per slice, as the compiled step does (the loop's trip count in the measured
    bytes): nearly k times the one-slice step's on fsdp and on data."""
    args = dict(batch=32, seq=64, hardware="h100", execution=dict(remat="none", dtype="float32"))
    one, four = (plan("tiny", "data=2,fsdp=4", grad_accum=k, **args) for k in (1, 4))
    assert four.grad_accum == 4 and one.grad_accum == 1
    assert four.memory_parts["kept"] == pytest.approx(one.memory_parts["kept"] / 4)
    assert four.memory_parts["state"] == pytest.approx(one.memory_parts["state"] * 20 / 16)
    temp = lambda p: p.per_device_memory_bytes - p.memory_parts["state"]
    assert four.per_device_memory_bytes < one.per_device_memory_bytes or temp(four) < temp(one)
    for axis in ("fsdp", "data"):  # all but what runs once a step (the embedding's, the loss's) runs per slice
        assert four.bytes_by_axis[axis] > 3 * one.bytes_by_axis[axis], axis
        assert axis in four.flagged  # several times the one reduction a step needs at least
    assert four.predicted_step_s > one.predicted_step_s


def test_search_fits_a_layout_by_accumulating():
    """A batch whose activations overflow every 8-device layout of an 8B model fits once accumulated
    over 8 slices, without a pipeline (the candidates say how many slices they price)."""
    from jaxpar.analysis.search import search

    args = dict(batch=64, seq=8192, hardware="h100", execution=dict(remat="full"))
    plain, _ = search("llama3-8b", 8, **args)
    sliced, _ = search("llama3-8b", 8, grad_accum=8, **args)
    flat = lambda ranked: [c for c in ranked if c.pipeline is None]
    assert not any(c.fits for c in flat(plain))
    fitting = [c for c in flat(sliced) if c.fits]
    assert fitting and all(c.grad_accum == 8 for c in flat(sliced))


def test_plan_prices_a_pipeline_gathering_its_weights_once():
    """``fsdp_gather=step``: the measured fsdp bytes fall (the weights gathered once, not per section), the
    memory estimate gains the stage's weights whole over fsdp, and XLA:CPU's compiled memory grows by as
    much, less what a section already held whole (one layer's weights: between 1 − 1/4 of the estimate,
    at 4 layers a stage, and all of it)."""
    args = dict(batch=16, seq=64, hardware="h100", microbatches=4, execution=dict(remat="none", dtype="float32"))
    wide = dict(embed_dim=512, mlp_dim=2048, head_dim=128, num_layers=8)  # weights above the other buffers
    section, step = (plan("tiny", "stage=2,fsdp=4", fsdp_gather=g, **args, **wide) for g in ("section", "step"))
    assert step.bytes_by_axis["fsdp"] < section.bytes_by_axis["fsdp"] / 2
    assert section.memory_parts["gathered"] == 0 < step.memory_parts["gathered"]
    grown = step.per_device_memory_bytes - section.per_device_memory_bytes
    assert 0.75 * step.memory_parts["gathered"] <= grown <= step.memory_parts["gathered"], (grown, step.memory_parts)


def test_grad_reduce_step_prices_one_reduction_a_step():
    """``grad_reduce=step``: the measured bytes on fsdp and on data are the one-slice step's minimum (one
    gather, one reduce-scatter, one all-reduce on the scattered part; none flagged), and the memory
    estimate holds the weights and their float32 gradient sum whole over fsdp; under a pipeline too, where
    per section (the default) flags fsdp."""
    args = dict(batch=32, seq=64, hardware="h100", grad_accum=4, execution=dict(remat="none", dtype="float32"))
    p = plan("tiny", "data=2,fsdp=4", grad_reduce="step", **args)
    for axis in ("fsdp", "data", "data+fsdp"):
        assert p.ratio_by_axis[axis] <= 1.05 and axis not in p.flagged, (axis, p.ratio_by_axis)
    assert p.memory_parts["gathered"] > 0
    with pytest.raises(ConfigError, match="grad_reduce=step with a mixture of experts"):
        plan("tiny-moe", "data=2,fsdp=4", grad_reduce="step", **args)
    piped = dict(args, grad_accum=1, microbatches=4)  # a pipeline reduces its microbatches' gradients once too
    staged, once = (plan("tiny", "stage=2,fsdp=4", grad_reduce=g, **piped) for g in ("slice", "step"))
    assert "fsdp" in staged.flagged and once.ratio_by_axis["fsdp"] <= 1.05, once.ratio_by_axis


def test_own_actions_priced_from_the_table():
    """``grad_reduce=step`` on stage=2 × fsdp=4 (tiny, bf16, full remat, 1F1B over m=4): each stage runs
    its own action (``jaxpar.pipeline.actions``). Durations in chunk forwards: F 1; B 2 + 1 (full remat
    recomputes each layer once); the head's forward and backward, 3h = 3 · 4/9 (h as in
    ``test_stage_sends_and_bubble_of_a_compiled_pipeline``), with the last chunk's F only. The bubble is
    the paired-rendezvous one, which for 1F1B is the table's ideal bubble with those op times, below the
    one-section executor's; the work per device drops by the recomputed forward and the masked heads."""
    from jaxpar.pipeline import build
    from jaxpar.pipeline.timing import own_action_bubble_fraction

    args = dict(batch=16, seq=32, hardware="h100", schedule="1f1b", microbatches=4)
    lockstep, own = (plan("tiny", "stage=2,fsdp=4", grad_reduce=g, **args).pipeline for g in ("slice", "step"))
    assert own["executor"] == "own actions" and lockstep["executor"] == "one section a tick"
    head = 3 * 4 / 9
    assert own["durations"] == pytest.approx({"F": 1.0, "B": 3.0, "head": head})
    table = build("1f1b", 2, 4)
    assert own["executor_bubble_fraction"] == pytest.approx(own_action_bubble_fraction(table, 1.0, 3.0, None, head))
    assert own["executor_bubble_fraction"] < lockstep["executor_bubble_fraction"]
    work = 2 * 4 * (1 + 3) + 4 * head  # per stage pair: every microbatch's F and B on both, the head once each
    assert own["flops_per_device"] / lockstep["flops_per_device"] == pytest.approx(
        work / table.busy_time(1.0, 3 + 1 + 3 * 4 / 9), rel=1e-9
    )


def test_search_prices_gradients_reduced_once():
    """``--search --grad-reduce step``: every pipeline candidate is priced with each stage running its own
    action (a sequence split too: attention as XLA partitions it), at a bubble no larger than the
    one-section executor's; a mixture of experts is refused by name."""
    from jaxpar.analysis.search import search

    args = dict(batch=16, seq=32, hardware="h100", num_layers=4, schedule="1f1b")
    slice_, _ = search("tiny", 8, **args)
    step, _ = search("tiny", 8, grad_reduce="step", **args)
    piped = lambda ranked: {tuple(sorted(c.mesh.items())): c.pipeline for c in ranked if c.pipeline}
    one, own = piped(slice_), piped(step)
    assert own and own.keys() == one.keys() and any("sequence" in dict(m) for m in own)
    for mesh, pipe in own.items():
        assert pipe["executor"] == "own actions" and one[mesh]["executor"] == "one section a tick"
        assert pipe["executor_bubble_fraction"] <= one[mesh]["executor_bubble_fraction"] + 1e-12, mesh
    ranked, refused = search("tiny-moe", 8, grad_reduce="step", batch=16, seq=32, hardware="h100")
    assert not ranked and any("grad_reduce=step with a mixture of experts" in r for _, r in refused)


def test_plan_prices_megatron_uneven_split():
    """``--first-stage-layers 1 --last-stage-layers 1`` on stage=4 (tiny with 6 layers: 1, 2, 2, 1): the
    step compiles with the stack in storage order (each stage holds 2 rows, the end stages one of them
    padding), the JSON names the split, and the step time is paced by a middle stage's 2 layers or the
    last one's layer and the head, whichever is slower. Each stage running its own action, the end
    stages' ops last half a chunk in the executor's bubble. A split that does not exist is refused by
    name."""
    from jaxpar.pipeline import build
    from jaxpar.pipeline.timing import own_action_bubble_fraction

    args = dict(batch=16, seq=32, hardware="h100", schedule="1f1b", microbatches=4, num_layers=6)
    p = plan("tiny", "stage=4,data=2", first_stage_layers=1, last_stage_layers=1, **args)
    assert p.pipeline["stage_layers"] == [1, 2, 2, 1]
    even = plan("tiny", "stage=4,data=2", **(args | dict(num_layers=8)))  # 2 layers on every stage
    assert p.memory_parts["state"] == even.memory_parts["state"]  # 8 storage rows over 4 stages, as 8 layers
    assert p.predicted_step_s <= even.predicted_step_s
    own = plan("tiny", "stage=4,data=2", first_stage_layers=1, last_stage_layers=1, grad_reduce="step", **args)
    d, table = own.pipeline["durations"], build("1f1b", 4, 4)  # in the largest chunk's forwards
    scaled = own_action_bubble_fraction(table, d["F"], d["B"], None, d["head"], [0.5, 1, 1, 0.5])
    assert own.pipeline["executor_bubble_fraction"] == pytest.approx(scaled)
    with pytest.raises(ConfigError, match=r"- 2 = 4 layers do not split evenly over the other 3 stages"):
        plan("tiny", "stage=4,data=2", first_stage_layers=2, **args)


def test_plan_set_speaks_train_grammar():
    """``jaxpar plan --set`` parses as ``jaxpar train --set`` does (``jaxpar.settings``): dotted model
    fields (nested ones too) and execution settings, each value by its field's type; what the preset
    already holds is not passed on. A bare field is refused, pointing to the model's."""
    from jaxpar.analysis.plan_command import _overrides
    from jaxpar.models import get_model_preset

    with pytest.raises(ConfigError, match=r"--set qkv_bias: jaxpar plan takes .*did you mean model\.qkv_bias\?"):
        _overrides(["qkv_bias=true"], "tiny")
    got = _overrides(
        ["model.num_layers=3", "model.qkv_bias=true", "execution.remat=dots", "model.vocab_size=256"], "tiny"
    )
    assert got == {"num_layers": 3, "qkv_bias": True, "execution": {"remat": "dots"}}
    moe = _overrides(["model.moe.top_k=1"], "tiny-moe")
    assert moe == {"moe": dataclasses.replace(get_model_preset("tiny-moe").moe, top_k=1)}


def test_search_splits_an_indivisible_stack_as_megatron():
    """tiny with 6 layers on 8 devices: the stage=4 candidates split the stack 1, 2, 2, 1 (Megatron's
    uneven split, ``balanced_ends``), priced as ``plan`` prices that split: the memory of 8 layers split
    evenly (each stage stores 2 rows), a step no slower. stage=8 has no split and is refused by name."""
    from jaxpar.analysis.search import search
    from jaxpar.pipeline.stack import balanced_ends

    assert balanced_ends(58, 8) == (5, 5)  # DeepSeek-V3's 58 MoE layers: 5, 8 × 6, 5
    assert balanced_ends(7, 4) == (2, 1) and balanced_ends(9, 2) == (5, None) and balanced_ends(6, 8) is None
    args = dict(batch=16, seq=32, hardware="h100", schedule="1f1b", microbatches=4)
    ranked, refused = search("tiny", 8, num_layers=6, **args)
    four = {tuple(sorted(c.mesh.items())): c for c in ranked if c.mesh.get("stage") == 4}
    assert four and all(c.pipeline["stage_layers"] == [1, 2, 2, 1] for c in four.values())
    even = {tuple(sorted(c.mesh.items())): c for c in search("tiny", 8, num_layers=8, **args)[0]}
    for mesh, c in four.items():
        assert c.memory_bytes == even[mesh].memory_bytes and c.predicted_step_s <= even[mesh].predicted_step_s
    assert [m["stage"] for m, _ in refused] == [8]
