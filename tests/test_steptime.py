"""The step-time model from mechanisms (jaxpar.analysis.steptime) and its calibration on published runs."""

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from jaxpar.analysis.calibration import CALIBRATED, calibrate, leave_one_out, load_runs, measured_step
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.analysis.links import axis_links, torus_split
from jaxpar.analysis.steptime import (
    SCORE_BYTES,
    Calibration,
    elementwise_values,
    layer_forward,
    matmul_seconds,
    model_flops,
    step_seconds,
)
from jaxpar.analysis.workload import RECOMPUTE, Workload, workload_of
from jaxpar.errors import ConfigError

V5P, H100 = HARDWARE["tpu-v5p"], HARDWARE["h100"]
CAL = Calibration(
    {"tpu": 0.8, "tpu-v6e": 0.6, "gpu": 0.5, "a100": 0.7},
    {"tpu": 1.0, "tpu-v6e": 1.0, "gpu": 1.0, "a100": 0.5},
    {"tpu": 1.0, "tpu-v6e": 1.0, "gpu": 1.0, "a100": 0.5},
)
SMALL = Workload(
    embed_dim=1024,
    num_heads=8,
    kv_heads=8,
    head_dim=128,
    mlp_dim=4096,
    mlp_matrices=3,
    num_layers=4,
    vocab=8192,
    batch=8,
    seq=1024,
    mesh={},
    remat="none",
)


def test_one_device_by_hand():
    w, T = SMALL, 8 * 1024
    mm = lambda k, n: 2 * T * k * n / (H100.peak_bf16_flops * 0.5)  # every dimension a multiple of 128
    fwd_mm = mm(1024, 3 * 1024) + mm(1024, 1024) + mm(1024, 2 * 4096) + mm(4096, 1024)
    att = 4 * T * 1024 * 8 * 128 / 2 / (H100.peak_bf16_flops * 0.5 * 0.75)  # causal half, flash at 0.75 of a GEMM
    ew = (8 * 1024 + 3 * 4096 + 2 * 16 * 128) * T * 2 / H100.hbm_bandwidth
    p = step_seconds(w, H100, CAL)
    assert p["matmul_s"] == pytest.approx(4 * 3 * fwd_mm)  # forward + 2 × backward, no remat
    assert p["attention_s"] == pytest.approx(4 * 3.5 * att)
    assert p["elementwise_s"] == pytest.approx(4 * 3 * ew)
    params = 4 * w.layer_params() + 8192 * 1024
    assert p["optimizer_s"] == pytest.approx(28 * params / H100.hbm_bandwidth)
    head = 3 * mm(1024, 8192) + 16 * T * 8192 / H100.hbm_bandwidth
    assert p["head_s"] == pytest.approx(head)
    assert p["tensor_exposed_s"] == p["fsdp_exposed_s"] == p["dcn_exposed_s"] == 0
    assert p["step_s"] == pytest.approx(4 * (3 * fwd_mm + 3.5 * att + 3 * ew) + head + p["optimizer_s"])
    full = step_seconds(dataclasses.replace(w, remat="full"), H100, CAL)  # full remat: one more forward,
    assert full["step_s"] - p["step_s"] == pytest.approx(4 * (fwd_mm - mm(4096, 1024) + att + ew))  # but mlp_out
    torch = step_seconds(dataclasses.replace(w, remat="full", remat_dce=False), H100, CAL)  # all of it
    assert torch["step_s"] - p["step_s"] == pytest.approx(4 * (fwd_mm + att + ew))
    assert elementwise_values(w) == 8 * 1024 + 3 * 4096 + 2 * 16 * 128


def _layer(T, chip=H100, eta=0.5):
    """SMALL's forward matmuls and causal flash attention on T tokens, by hand (dimensions on the tile)."""
    mm = lambda k, n: 2 * T * k * n / (chip.peak_bf16_flops * eta)
    fwd_mm = mm(1024, 3 * 1024) + mm(1024, 1024) + mm(1024, 2 * 4096) + mm(4096, 1024)
    return fwd_mm, 4 * T * 1024 * 8 * 128 / 2 / (chip.peak_bf16_flops * eta * chip.attention_efficiency), mm


def test_pipeline_by_hand():
    """stage=2 on one NVLink node, 8 sequences in microbatches of 2: m = 4; each stage runs 2 of the 4 layers
    on every microbatch, the last one the LM head too; a chunk boundary sends a microbatch's [2048, 1024]
    bf16 activations forward and their gradient back. 1F1B idles (p − 1)/(m + p − 1) = 1/5 of the step;
    interleaving v = 2 chunks a device: 1/9, at twice the sends."""
    w = dataclasses.replace(SMALL, mesh=dict(stage=2), microbatch=2)
    assert w.microbatches == 4
    T = 2 * 1024
    fwd_mm, att, mm = _layer(T)
    ew = elementwise_values(w) * T * 2 / H100.hbm_bandwidth
    head = 3 * mm(1024, 8192) + 16 * T * 8192 / H100.hbm_bandwidth
    send = 2 * T * 1024 * 2 / H100.fast_link
    busy = 4 * (2 * (3 * fwd_mm + 3.5 * att + 3 * ew) + head + send)
    p = step_seconds(w, H100, CAL)
    assert p["stage_exposed_s"] == pytest.approx(4 * send) and p["head_s"] == pytest.approx(4 * head)
    assert p["bubble_s"] == pytest.approx(busy * (1 / 5) / (4 / 5))
    assert p["optimizer_s"] == pytest.approx(28 * w.params() / 2 / H100.hbm_bandwidth)
    assert p["step_s"] == pytest.approx(busy / (4 / 5) + p["optimizer_s"])
    v2 = step_seconds(dataclasses.replace(w, virtual_stages=2), H100, CAL)
    assert v2["bubble_s"] == pytest.approx((busy + 4 * send) / 8) and v2["stage_exposed_s"] == pytest.approx(8 * send)
    # jaxpar's executor: its bubble and its critical-path stage bytes as the compiled program gives them,
    # every backward recomputes its chunk's forward (one more forward of the layers) and runs the head
    ex = step_seconds(dataclasses.replace(w, bubble=0.5, stage_bytes=1e9, executor=True), H100, CAL)
    assert ex["stage_exposed_s"] == pytest.approx(1e9 / H100.fast_link)
    assert ex["matmul_s"] == pytest.approx(4 * 2 * 4 * fwd_mm) and ex["bubble_s"] == pytest.approx(
        sum(v for k, v in ex.items() if k in ("matmul_s", "attention_s", "elementwise_s", "head_s"))
    )
    ex2 = step_seconds(dataclasses.replace(w, virtual_stages=2, stage_bytes=1e9, executor=True), H100, CAL)
    assert ex2["head_s"] == pytest.approx(2 * 4 * head)  # in both chunks' backward


def test_attention_without_flash_and_overlapped_gradients():
    """Without a flash kernel every score is computed (causal or not) at the GEMM share and written, soft-
    maxed, dropped out and read over HBM: SCORE_BYTES each. torch DDP's buckets hide the cross-node
    gradient all-reduce behind the backward, as far as it reaches."""
    T = 8 * 1024
    plain = step_seconds(dataclasses.replace(SMALL, flash=False), H100, CAL)
    att = 4 * T * 1024 * 8 * 128 / (H100.peak_bf16_flops * 0.5) + T * 1024 * 8 * SCORE_BYTES / H100.hbm_bandwidth
    assert plain["attention_s"] == pytest.approx(4 * 3.5 * att)
    w = dataclasses.replace(SMALL, dcn=dict(data=2), batch=16)
    exposed = step_seconds(w, H100, CAL)["dcn_exposed_s"]
    assert exposed == pytest.approx(2 * 1 / 2 * w.params() * 4 / H100.slow_link)
    hidden = step_seconds(dataclasses.replace(w, dcn_overlap=True), H100, CAL)
    fwd_mm, att, _ = _layer(T)
    bwd = 2 * fwd_mm + 2.5 * att + 2 * elementwise_values(w) * T * 2 / H100.hbm_bandwidth
    assert hidden["dcn_exposed_s"] == pytest.approx(max(0.0, exposed - 4 * bwd))


MOE = dataclasses.replace(
    SMALL, num_layers=2, experts=4, top_k=2, expert_mlp_dim=1024, capacity_factor=1.0, mesh=dict(expert=2)
)


def test_moe_layer_by_hand():
    """Two MoE layers (4 experts of width 1024, top-2, capacity factor 1) on expert=2 H100s inside a node,
    no remat. A device holds 4096 tokens and 2 experts; C = 1024·2/4 = 512 slots per expert and sequence,
    so E·C/S = 2 slots a token: each local expert runs 8192 / 2 = 4096 slots. Dispatch and combine are
    [E·C, S] × [S, D] per sequence: 8192 × 1024 × 1024 on the device. The all-to-all sends half of the
    8192 slots' [D] rows out and back, forward and backward, over NVLink (exposed: no async overlap on
    GPU; on a TPU the backward's would hide behind the experts' weight-gradient matmuls)."""
    w, T = MOE, 4096
    mm = lambda m, k, n: 2 * m * k * n / (H100.peak_bf16_flops * 0.5)  # each compute-bound here
    router = matmul_seconds(T, 1024, 4, H100, 0.5)  # [T, D] × [D, 4]: HBM-bound
    fwd_mm = (
        mm(T, 1024, 3 * 1024)
        + mm(T, 1024, 1024)
        + router
        + 2 * mm(4096, 1024, 2048)
        + 2 * mm(4096, 1024, 1024)
        + 2 * mm(8192, 1024, 1024)
    )
    assert w.slots_per_token == 2 and elementwise_values(w, True) == 8 * 1024 + 2 * 16 * 128 + 3 * 2 * 1024 + 2 * 2
    p = step_seconds(w, H100, CAL)
    assert p["matmul_s"] == pytest.approx(2 * (3 * fwd_mm - mm(8192, 1024, 1024)))  # the mask has no gradient
    a2a = 2 * (1 / 2) * 8192 * 1024 * 2 / H100.fast_link
    assert p["expert_exposed_s"] == pytest.approx(2 * 2 * a2a)  # forward and backward, both ways
    tpu_like = step_seconds(w, dataclasses.replace(H100, tensor_overlap=True), CAL)
    assert tpu_like["expert_exposed_s"] == pytest.approx(2 * a2a)  # a2a < the experts' matmuls
    rest, experts = 2 * (1024 * 128 * 32 + 1024 * 4) + 8192 * 1024, 2 * 4 * 3 * 1024 * 1024
    assert w.params() == rest + experts and w.local_params() == rest + experts / 2
    assert dataclasses.replace(w, expert_fsdp=True).local_params() == (rest + experts) / 2  # MaxText's sharding
    assert p["optimizer_s"] == pytest.approx(28 * (rest + experts / 2) / H100.hbm_bandwidth)
    active = rest + experts / 2  # 2 of 4 experts a token
    assert model_flops(w) == pytest.approx(T * (6 * active + 12 * 2 * 8 * 128 * 1024 / 2))
    dropless = dataclasses.replace(w, capacity_factor=None)  # k slots, sorted: no einsums
    assert (
        dropless.slots_per_token == 2
        and elementwise_values(dropless, True) == 8 * 1024 + 2 * 16 * 128 + 3 * 2 * 1024 + 4 * 2 * 1024
    )
    assert step_seconds(dropless, H100, CAL)["matmul_s"] == pytest.approx(2 * 3 * (fwd_mm - 2 * mm(8192, 1024, 1024)))


def test_context_parallel_by_hand():
    """SMALL on sequence=4 H100s in a node, no remat: 2048 local tokens a device. Ring attention over zig-zag
    storage: each device computes 9 of its 16 (query half, key half) tiles (``ring_work``), so 9/16 of its
    queries' full attention. Forward: 3 sends of the local K/V (2048 × 2 × 8 × 128 values in bf16) beside
    the attention; backward: K/V with float32 dK/dV 3 times, and the dK/dV home once, beside 2.5× the
    attention. Ulysses: q, k, v and the output, 3/4 of 2048 × 32 × 128 values a pass, exposed both ways.
    Allgather (jaxpar's ``none``: GSPMD gathers the K/V): 3 devices' K/V in, their gradients out, exposed;
    natural order, so the last device's queries see 3.5 of 4 blocks (a balanced order, MaxText's, halves it)."""
    w, T = dataclasses.replace(SMALL, mesh=dict(sequence=4)), 2048
    assert w.attention_share == 9 / 16 and dataclasses.replace(w, cp_order="contiguous").attention_share == 15 / 16
    att = 4 * T * 1024 * 8 * 128 * 9 / 16 / (H100.peak_bf16_flops * 0.5 * 0.75)
    p = step_seconds(w, H100, CAL)
    assert p["attention_s"] == pytest.approx(4 * 3.5 * att)
    kv = T * 2 * 8 * 128
    fwd = max(0.0, 3 * kv * 2 / H100.fast_link - att)
    bwd = max(0.0, (3 * kv * 6 + kv * 4) / H100.fast_link - 2.5 * att)
    assert fwd > 0 and bwd > 0 and p["sequence_exposed_s"] == pytest.approx(4 * (fwd + bwd))
    assert p["fsdp_exposed_s"] == 0  # the gradient all-reduce over sequence hides
    u = step_seconds(dataclasses.replace(w, context_parallel="ulysses"), H100, CAL)
    a2a = 3 / 4 * T * 32 * 128 * 2 / H100.fast_link
    assert u["sequence_exposed_s"] == pytest.approx(4 * 2 * a2a) and u["attention_s"] == pytest.approx(
        4 * 3.5 * att * 8 / 9
    )
    gspmd = dataclasses.replace(w, context_parallel="allgather", cp_order="contiguous")  # GSPMD's gather
    g = step_seconds(gspmd, H100, CAL)
    assert gspmd.attention_share == 3.5 / 4  # the last chunk's
    assert dataclasses.replace(gspmd, cp_order="zigzag").attention_share == 0.5  # MaxText's, balanced
    assert g["sequence_exposed_s"] == pytest.approx(4 * 2 * 3 * kv * 2 / H100.fast_link)
    tpu = step_seconds(w, V5P, CAL)  # the ring sends one way over one 100 GB/s link
    att_tpu = 4 * T * 1024 * 8 * 128 * 9 / 16 / (V5P.peak_bf16_flops * 0.8)
    assert axis_links(w, V5P)["sequence"] == 4 * 100e9
    assert tpu["sequence_exposed_s"] == pytest.approx(
        4 * (3 * kv * 2 / 100e9 - att_tpu + (3 * kv * 6 + kv * 4) / 100e9 - 2.5 * att_tpu)
    )


def test_sliding_window_attention_share():
    """A window of W keys: a query at position p sees min(p + 1, W) of them, (W/S)·(1 − W/2S) of S on average
    (mistral-7b's 4,096 at 8,192 tokens: 3/8); no window, or one as long as the sequence: causal half. Under
    ring attention the kernel's live tiles count (``ring_work`` with the window, at the real length)."""
    from jaxpar.models import ExecutionConfig, get_model_preset
    from jaxpar.parallel.ring import ring_work

    w = workload_of(get_model_preset("mistral-7b"), ExecutionConfig(), dict(fsdp=8), batch=8, seq=8192)
    assert (w.window, w.causal, w.attention_share) == (4096, True, 0.375)
    assert dataclasses.replace(w, seq=4096).attention_share == dataclasses.replace(w, window=0).attention_share == 0.5
    ring = dataclasses.replace(w, mesh=dict(fsdp=2, sequence=4), seq=32768, context_parallel="ring", cp_order="zigzag")
    assert ring.attention_share == ring_work(32768, 4, "zigzag", window=4096).max() / 16 == 0.25
    assert dataclasses.replace(ring, context_parallel="allgather").attention_share == 4096 / 32768 * (1 - 4096 / 65536)
    half = dataclasses.replace(w, window=128, window_layers=16)  # gpt-oss: every second layer
    assert half.attention_share == pytest.approx((128 / 8192 * (1 - 128 / 16384) + 0.5) / 2)


def test_matmul_roofline_and_tiles():
    # a thin matmul is HBM-bound: its operands over the bandwidth
    assert matmul_seconds(8, 8192, 8192, H100, 1.0) == pytest.approx(2 * (8 * 8192 * 2 + 8192**2) / H100.hbm_bandwidth)
    # a shape off the tile pays for the padded one: 129 → 256 rows
    assert matmul_seconds(4096, 4096, 129, V5P, 1.0) == pytest.approx(matmul_seconds(4096, 4096, 256, V5P, 1.0))


def test_links_by_topology():
    assert torus_split(V5P, 64) == [4, 4, 4] and torus_split(V5P, 128) == [8, 4, 4]
    assert torus_split(HARDWARE["tpu-v5e"], 256) == [16, 16]
    w = dataclasses.replace(SMALL, mesh=dict(fsdp=16, tensor=4), batch=64)
    links = axis_links(w, V5P)  # tensor on one side of 4, fsdp on the other two: both directions of each
    assert links["tensor"] == 2 * 100e9 and links["fsdp"] == 4 * 100e9
    assert axis_links(dataclasses.replace(SMALL, mesh=dict(fsdp=8)), H100)["fsdp"] == H100.fast_link
    assert axis_links(dataclasses.replace(SMALL, mesh=dict(fsdp=16), batch=16), H100)["fsdp"] == H100.slow_link


def test_torus_sides_are_jax_s_own_assignment():
    """The side rule (``axis_links``) against jax's mesh_utils, which assigns each logical axis of a TPU mesh
    its physical torus axes (MaxText builds its meshes with it): for every TPU mesh of the published runs,
    each axis spans as many torus sides under both (tensor=16 on 8×8×8 splits a side under both)."""
    from jax._src.mesh_utils import _create_device_mesh_for_nd_torus

    meshes = {(r.hardware, tuple(sorted(r.workload.mesh.items()))) for r in load_runs() if r.hardware.startswith("tpu")}
    assert len(meshes) == 22
    for hardware, mesh in sorted(meshes):
        mesh, chip = dict(mesh), HARDWARE[hardware]
        sides = torus_split(chip, math.prod(mesh.values()))
        order = ("data", "fsdp", "sequence", "tensor", "expert")  # by increasing network intensity, as jax wants
        shape = [mesh.get(a, 1) for a in order]
        physical = np.arange(math.prod(sides)).reshape(sides)
        try:
            _, assignment = _create_device_mesh_for_nd_torus(physical, shape)
        except NotImplementedError:  # no whole sides fit: jax splits one, as we do
            _, assignment = _create_device_mesh_for_nd_torus(physical, shape, allow_split_physical_axes=True)
        w = dataclasses.replace(SMALL, mesh=mesh, batch=math.prod(mesh.values()))
        links = axis_links(w, chip)
        for i, axis in enumerate(order):
            if mesh.get(axis, 1) > 1:
                assert links[axis] == 2 * chip.ici_link * int((assignment[:, i] > 1).sum()), (hardware, mesh, axis)


def test_tensor_traffic_exposed_forward_hidden_backward_on_tpu():
    w = dataclasses.replace(SMALL, mesh=dict(tensor=4), remat="none")
    T = 8 * 1024
    assert torus_split(V5P, 4) == [2, 2, 1] and axis_links(w, V5P)["tensor"] == 4 * 100e9  # 2 sides of 2
    tp = 2 * 2 * 3 / 4 * T * 1024 * 2 / (4 * 100e9)  # two ring all-reduces of [T, D] a forward
    tpu = step_seconds(w, V5P, CAL)
    gpu = step_seconds(w, dataclasses.replace(V5P, tensor_overlap=False), CAL)
    assert tpu["tensor_exposed_s"] == pytest.approx(4 * tp)  # the backward's run beside weight gradients
    assert gpu["tensor_exposed_s"] == pytest.approx(4 * 2 * tp)  # without that overlap, both exposed


def test_fsdp_gather_hides_behind_compute_until_it_cannot():
    def exposed(batch):
        w = dataclasses.replace(SMALL, mesh=dict(fsdp=8), batch=batch, dcn={}, remat="full")
        return step_seconds(w, dataclasses.replace(H100, fast_link=50e9), CAL)["fsdp_exposed_s"]

    assert exposed(512) == 0 and exposed(8) > 0


def test_published_step_times_by_convention():
    runs = {r.name: r for r in load_runs()}
    r = runs["MaxText 32B, 1× v5p-128"]
    w = r.workload
    params = 32 * (10240 * 256 * 4 * 32 + 2 * 10240 * 32768) + 32768 * 10240
    flops = 8 * 2048 * (6 * params + 6 * 32 * 32 * 256 * 2048)  # v5p table: causal attention halved
    assert model_flops(w, causal_attention=True, count_embedding=True) == pytest.approx(flops)
    assert r.measured_step_s == pytest.approx(flops / (0.7147 * 459e12))
    t = runs["torchtitan Llama 3.1 8B, 8 × H100 (FSDP 8, torch.compile)"]
    assert t.measured_step_s == pytest.approx(2 * 8192 / 6667)
    assert measured_step(w, V5P, dict(mfu=0.5, convention=dict(attention="full", embedding="counted"))) > measured_step(
        w, V5P, dict(mfu=0.5, convention=dict(attention="causal", embedding="counted"))
    )
    # Megatron-LM's Eq. 3 (full recompute counted): 96·B·s·l·h²·(1 + s/6h + V/16lh) per step
    m = runs["Megatron-LM GPT 1008B, 3072 × A100 (TP 8, PP 64, DP 6)"]
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    eq3 = 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    assert m.measured_step_s == pytest.approx(eq3 / 3072 / 163e12)
    assert m.workload.microbatches == 512 and m.workload.size("stage") == 64
    # tpu-recipes' logs give the step itself; its tokens/s must agree with the configuration's tokens
    v = runs["MaxText Llama3.1-8B, v6e-8"]
    assert v.measured_step_s == 3.443 and v.workload.batch * v.workload.seq / v.workload.devices == 3 * 8192
    with pytest.raises(ValueError, match="not the configuration's 24576 tokens per device"):
        measured_step(v.workload, HARDWARE["tpu-v6e"], dict(step_s=3.443, tokens_per_s_per_device=4759.0))


def test_leave_one_out_over_published_runs():
    """The validation (docs/validation.md): 99 runs, each predicted with constants fitted without it; four of
    them (named, each with its reason in the JSON) enter no fit."""
    runs = load_runs()
    assert len(runs) == 99
    assert calibrate(runs) == CALIBRATED  # the constants in the code are the fit's
    rows = leave_one_out(runs)
    err = np.abs([r["error"] for r in rows if r["in_fit"]])
    assert len(err) == 95 and np.median(err) == pytest.approx(0.051, abs=0.0005)  # goal: ≤ 10%
    assert np.sum(err > 0.10) == 19 and np.sum(err > 0.20) == 0  # goal: none > 20%
    by = {r["name"]: r["error"] for r in rows}
    megatron = [abs(r["error"]) for r in rows if r["hardware"] == "a100"]  # tensor × pipeline × data
    assert len(megatron) == 10 and max(megatron) == pytest.approx(0.072, abs=0.0005)
    v6e = [abs(e) for n, e in by.items() if "v6e" in n and "Mixtral" not in n]
    assert len(v6e) == 10 and max(v6e) == pytest.approx(0.092, abs=0.0005)
    assert by["MaxText Mixtral-8x7B, v6e-256 (capacity 1.25)"] == pytest.approx(-0.076, abs=0.0005)  # MoE
    assert by["MaxText Mixtral-8x22B, v6e-256 (capacity 1.25, expert 4)"] == pytest.approx(-0.198, abs=0.0005)
    assert by["MaxText 128B, 2× v5p-512"] == pytest.approx(0.132, abs=0.0005)
    dense = [abs(e) for n, e in by.items() if "tpu7x" in n and "Llama" in n and "128k" not in n and "fp8" not in n]
    assert len(dense) == 3 and max(dense) == pytest.approx(0.067, abs=0.0005)
    dropless = {n: round(e, 3) for n, e in by.items() if "dropless" in n and "fp8" not in n and "oss" not in n}
    assert dropless == {
        "MaxText Qwen3-235B-A22B, tpu7x-4x8x8 (256 chips, dropless)": -0.118,
        "MaxText DeepSeek-V3, tpu7x (128 chips, dropless)": 0.071,
        "MaxText DeepSeek-V3, tpu7x (256 chips, dropless)": 0.062,
    }
    titan = [abs(e) for n, e in by.items() if n.startswith("torchtitan")]  # H100: FSDP, CP, TP, PP, FP8
    assert len(titan) == 16 and max(titan) == pytest.approx(0.191, abs=0.0005)
    assert np.median(titan) == pytest.approx(0.068, abs=0.0005)
    fp8 = [abs(e) for n, e in by.items() if "fp8" in n and "tpu7x" in n and "128k" not in n]  # dense and grouped
    assert len(fp8) == 6 and max(fp8) == pytest.approx(0.061, abs=0.0005)
    assert [(r["name"], round(r["error"], 3)) for r in rows if not r["in_fit"]] == [
        ("MaxText Llama3.1-70B 128k context, tpu7x-4x8x8 (context 8 devices)", 0.404),
        ("MaxText Llama3.1-70B 128k context fp8, tpu7x-4x8x8 (context 8 devices)", 0.497),
        ("MaxText gpt-oss-120b, tpu7x (64 chips, dropless)", 0.493),
        ("MaxText gpt-oss-120b, tpu7x (256 chips, dropless)", 0.516),
    ]


def test_mla_and_grouped_experts_by_hand():
    """DeepSeek-V3's Workload: its matmul weights are jaxpar's parameter count less the norms (two a layer
    of width D, the two latents' and the final one). MLA's matmuls: q through its 1536 latent to 128 heads
    × (128 + 64), k/v through the 512 latent (plus the shared 64-wide RoPE key) to 128 × (128 + 128), the
    output from 128 × 128; attention 2·S·H·(192 + 128) FLOPs a token. A grouped share g makes the dropless
    experts' matmuls 1/g slower and nothing else."""
    from jaxpar.models import get_execution_preset, get_model_preset

    cfg = get_model_preset("deepseek-v3")
    w = workload_of(cfg, get_execution_preset("deepseek-v3"), dict(fsdp=8), batch=8, seq=4096)
    norms = cfg.num_layers * (2 * 7168 + 1536 + 512) + 7168
    assert w.params(2) == cfg.num_params() - norms
    assert w.attention_shapes(2) == dict(
        q=[(7168, 1536), (1536, 64 * 192)], kv=[(7168, 576), (512, 64 * 256)], out=[(64 * 128, 7168)]
    )
    assert model_flops(w) - model_flops(dataclasses.replace(w, seq=2048)) * 2 == pytest.approx(
        8 * 4096 / 8 * 6 * 61 * 128 * 320 * 2048 / 2
    )  # the attention term: S doubles, per token
    tpu7x = HARDWARE["tpu7x"]
    base = Calibration({"tpu7x": 0.6}, {"tpu7x": 1.0}, {"tpu7x": 1.0})
    half = Calibration({"tpu7x": 0.6}, {"tpu7x": 1.0}, {"tpu7x": 1.0}, grouped={"tpu7x": 0.5})
    assert w.capacity_factor == 1.25 and step_seconds(w, tpu7x, half) == step_seconds(w, tpu7x, base)  # one-hot
    w = dataclasses.replace(w, capacity_factor=None)  # dropless
    a, b = layer_forward(w, tpu7x, 0.6, 4096, True), layer_forward(w, tpu7x, 0.6, 4096, True, grouped=0.5)
    assert b[0]["experts_in"] == pytest.approx(2 * a[0]["experts_in"]) and b[0]["q"] == a[0]["q"]
    big = dataclasses.replace(w, batch=512)  # (at 8 sequences the gathers set the pace and hide it)
    fp8 = Calibration(
        {"tpu7x": 0.6},
        {"tpu7x": 1.0},
        {"tpu7x": 1.0},
        grouped={"tpu7x": 0.5},
        fp8={"tpu7x": 0.3},
        grouped_fp8={"tpu7x": 0.25},
    )  # FP8: 4,614 TFLOP/s at 0.3, grouped at 0.25 of that
    c = layer_forward(dataclasses.replace(big, fp8=True), tpu7x, 0.6, 4096, True, fp8.grouped_share("tpu7x", True), 0.3)
    assert c[0]["q"] == pytest.approx(a[0]["q"] * (2307 * 0.6) / (4614 * 0.3))  # the same time: 0.3 of twice
    assert c[0]["experts_in"] == pytest.approx(a[0]["experts_in"] * 2307 * 0.6 / (4614 * 0.3 * 0.25))  # 4×
    assert c[0]["router"] == a[0]["router"] and c[1] == a[1]  # bf16: router and attention
    assert step_seconds(big, tpu7x, half)["matmul_s"] > step_seconds(big, tpu7x, base)["matmul_s"]
    assert step_seconds(big, tpu7x, half)["step_s"] > step_seconds(big, tpu7x, base)["step_s"]


def test_jax_remat_leaves_unread_outputs_out():
    """``remat_dce``: the compiled train step of tiny (float32, one device) with remat=full runs, over remat=none,
    one layer's forward (XLA's cost analysis counts the scanned layer loop's body once) without the MLP's
    output projection, whose output no backward reads: its matmuls but mlp_out, its attention (XLA's, every
    score), and a little elementwise work (under 1/4 of mlp_out's FLOPs). remat=attn keeps q, k, v, the
    context and the attention's output: it reruns the MLP's input matmuls and the scores' half of XLA's
    attention (QKᵀ; the probabilities' AV product is kept), as ``RECOMPUTE["attn"]`` prices it."""
    import jax

    from jaxpar.analysis.plan import compile_step
    from jaxpar.layout import make_layout
    from jaxpar.meshes import resolve_mesh_arg
    from jaxpar.models import ExecutionConfig, get_model_preset

    B, S, flops = 8, 64, {}
    for remat in ("none", "full", "attn"):
        cfg, run = get_model_preset("tiny"), ExecutionConfig(remat=remat, dtype="float32")
        layout = make_layout(cfg, resolve_mesh_arg("data=1"), batch=B, seq=S, devices=jax.devices()[:1])
        cost = compile_step(cfg, layout, batch=B, seq=S, execution=run).cost_analysis()
        flops[remat] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    D, H, K, Dh, F, T = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, B * S
    read = 2 * T * (D * H * Dh + D * 2 * K * Dh + H * Dh * D + D * 2 * F) + 4 * T * S * H * Dh
    mlp_out = 2 * T * F * D
    assert 0 < flops["full"] - flops["none"] - read < mlp_out / 4
    assert RECOMPUTE["attn"][0] == ("q", "kv", "out") and not run.attention_impl
    assert 0 < flops["attn"] - flops["none"] - (2 * T * D * 2 * F + 2 * T * S * H * Dh) < mlp_out / 4


def test_flash_attention_2_and_uneven_stages_by_hand():
    """FlashAttention-2 (``attention_kernel="fa2"``, torch's SDPA on H100s in 2024) prices attention at 0.42
    of a GEMM's share where the chip's own kernel runs at 0.75: the attention time × 0.75/0.42, nothing else.
    126 layers over 8 stages (torchtitan's split: 15 or 16 a stage) are priced at the largest, ⌈126/8⌉ = 16,
    as 128 layers are; under 2 chunks a device, 2 × ⌈126/16⌉ = 16 as well."""
    fa3, fa2 = (layer_forward(dataclasses.replace(SMALL, attention_kernel=k), H100, 0.5, 8192) for k in ("", "fa2"))
    assert fa2[1] == pytest.approx(fa3[1] * 0.75 / 0.42) and (fa2[0], fa2[2]) == (fa3[0], fa3[2])
    staged = dict(mesh=dict(stage=8), batch=64, microbatch=8, remat="full")
    uneven, even = (dataclasses.replace(SMALL, num_layers=n, **staged) for n in (126, 128))
    assert uneven.stage_layers == even.stage_layers == 16
    assert dataclasses.replace(uneven, virtual_stages=2).stage_layers == 16
    a, b = step_seconds(uneven, H100, CAL), step_seconds(even, H100, CAL)
    assert a["matmul_s"] == pytest.approx(b["matmul_s"]) and a["bubble_s"] == pytest.approx(b["bubble_s"])


NOT_LAYERS = {"head_s", "stage_exposed_s", "bubble_s", "optimizer_s", "dcn_exposed_s", "step_s"}


def test_megatron_split_paces_the_pipeline_by_its_slowest_stage():
    """Megatron's split (``stage_split``): the pace is the slowest stage's, the last one's with the LM
    head. On 4 stages, (8, 8, 8, 6), (8, 8, 8, 8) and (6, 8, 8, 2) price as the last stage's layers plus
    the head, or as 8 layers without it where those take longer; the head is priced only where the
    last stage sets the pace."""
    staged = dict(mesh=dict(stage=4), batch=64, microbatch=8, remat="full")
    even = dataclasses.replace(SMALL, num_layers=32, **staged)
    base = step_seconds(even, H100, CAL)
    per_layer = sum(base[k] for k in base if k.endswith("_s") and k not in NOT_LAYERS) / 8
    for split in ((8, 8, 8, 6), (8, 8, 8, 8), (6, 8, 8, 2)):
        w = dataclasses.replace(SMALL, num_layers=sum(split), stage_split=split, **staged)
        got = step_seconds(w, H100, CAL)
        last = split[-1] * per_layer + base["head_s"]
        want = max(last, 8 * per_layer)
        layers = sum(got[k] for k in got if k.endswith("_s") and k not in NOT_LAYERS)
        assert layers + got["head_s"] == pytest.approx(want), split
        assert (got["head_s"] > 0) == (last >= 8 * per_layer), split
    assert dataclasses.replace(even, stage_split=(8, 8, 8, 8)).stage_layers == 8


def test_bad_workloads_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"num_layers=4: fewer than stage × virtual_stages = 8 chunks"):
        dataclasses.replace(SMALL, mesh=dict(stage=4), virtual_stages=2).check()
    with pytest.raises(ConfigError, match=r"attention_kernel='fa3': '' \(the chip's own flash kernel\) or 'fa2'"):
        dataclasses.replace(SMALL, attention_kernel="fa3").check()
    with pytest.raises(
        ConfigError, match="batch=8: not divisible by the 16 sequences of data × fsdp × expert × microbatch=2"
    ):
        dataclasses.replace(SMALL, mesh=dict(data=8), microbatch=2).check()
    with pytest.raises(ConfigError, match="context_parallel='pipe', cp_order='zigzag': sequence=2"):
        dataclasses.replace(SMALL, mesh=dict(sequence=2), context_parallel="pipe").check()
    with pytest.raises(ConfigError, match="seq=1020: not divisible by the sequence=4 blocks"):
        dataclasses.replace(SMALL, mesh=dict(sequence=4), seq=1020).check()
    with pytest.raises(ConfigError, match="batch=8: not divisible by the 16 sequences"):
        dataclasses.replace(SMALL, mesh=dict(fsdp=16)).check()
    with pytest.raises(ConfigError, match="experts=0: not divisible by expert=2"):
        dataclasses.replace(SMALL, mesh=dict(expert=2)).check()
    with pytest.raises(ConfigError, match="experts=4: not divisible by expert=8"):
        dataclasses.replace(MOE, mesh=dict(expert=8)).check()
    with pytest.raises(ConfigError, match="top_k=5, dense_layers=0"):
        dataclasses.replace(MOE, top_k=5).check()
    with pytest.raises(ConfigError, match="remat='some'"):
        dataclasses.replace(SMALL, remat="some").check()
    with pytest.raises(ConfigError, match="num_heads=8: not divisible by tensor=16"):
        dataclasses.replace(SMALL, mesh=dict(tensor=16)).check()
    assert math.isfinite(step_seconds(SMALL, HARDWARE["tpu-v6e"], CAL)["step_s"])


RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _stored(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def test_validation_json_is_what_the_script_computes(capsys):
    """benchmarks/results/plan_validation.json, which docs/validation.md renders (its table, its summary by
    family, the calibrated constants), is exactly what benchmarks/plan_validation.py prints from the
    published runs and the code: rows in order, errors, fitted constants, shares of the step, summary."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_validation", RESULTS.parent / "plan_validation.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    capsys.readouterr()
    script.main()
    computed = json.loads(capsys.readouterr().out)
    stored = _stored("plan_validation.json")
    assert [r["name"] for r in stored["rows"]] == [r["name"] for r in computed["rows"]]
    for s, c in zip(stored["rows"], computed["rows"]):
        assert s == c, s["name"]
    assert stored == computed


def _notes() -> dict:
    return _stored("plan_validation_notes.json")


def test_validation_notes_cover_every_miss():
    """Every run that misses by more than 10% has a note saying why (plan_validation_notes.json); every
    note names a run of the validation and fills its figures from that run's row and the checked numbers."""
    from rendered import render

    rows, notes = {r["name"]: r for r in _stored("plan_validation.json")["rows"]}, _notes()
    misses = {name for name, r in rows.items() if abs(r["error"]) > 0.10}
    assert len(misses) == 23 and not misses - set(notes["notes"]), misses - set(notes["notes"])
    assert not set(notes["notes"]) - set(rows)
    for name, row in rows.items():
        text = render.note(row, notes)
        assert "{" not in text and "}" not in text, name
        assert bool(text) == (name in notes["notes"]), name
    # the rendered table carries every run, its note included
    table = render.validation_runs()
    assert all(render.note(row, notes) in table for row in rows.values())


def _note_numbers() -> dict:
    """The figures the validation notes quote, computed from the step-time model and the stored runs."""
    import dataclasses as dc

    from jaxpar.analysis.calibration import GRID, fit_share

    runs = {r.name: r for r in load_runs()}
    stored = {r["name"]: r for r in _stored("plan_validation.json")["rows"]}
    v6e, tpu7x = HARDWARE["tpu-v6e"], HARDWARE["tpu7x"]
    out = {}
    # Mixtral 8x22B at the link's full bandwidth (its fitted ICI share without it is GPT-3's 0.3)
    mix = runs["MaxText Mixtral-8x22B, v6e-256 (capacity 1.25, expert 4)"]
    full = step_seconds(mix.workload, v6e, Calibration({"tpu-v6e": 0.57}, {"tpu-v6e": 1.0}, {"tpu-v6e": 1.0}))
    out["mixtral_8x22b_full_link_error"] = mix.measured_step_s / full["step_s"] - 1
    # the 128k-token run: attention's share of the predicted step, and the share the measured step asks for
    long = runs["MaxText Llama3.1-70B 128k context, tpu7x-4x8x8 (context 8 devices)"]
    p = step_seconds(long.workload, tpu7x, CALIBRATED)
    out["long_context_attention_share"] = p["attention_s"] / p["step_s"]
    out["long_context_share_asked"] = p["attention_s"] / (long.measured_step_s - (p["step_s"] - p["attention_s"]))
    # the grouped share a dropless run would fit alone
    base = Calibration({"tpu7x": 0.67}, {"tpu7x": 1.0}, {"tpu7x": 1.0})
    alone = lambda name: fit_share([runs[name]], lambda g: dc.replace(base, grouped={"tpu7x": g}), GRID["grouped"])
    out["qwen3_grouped_share_alone"] = alone("MaxText Qwen3-235B-A22B, tpu7x-4x8x8 (256 chips, dropless)")
    out["gpt_oss_grouped_share_alone"] = alone("MaxText gpt-oss-120b, tpu7x (64 chips, dropless)")
    # GPT-3 175B: the ICI share it fits alone, and the share from which its gathers hide behind compute
    gpt3 = runs["MaxText GPT-3 175B, v6e-256"]
    v = Calibration({"tpu-v6e": 0.58}, {"tpu-v6e": 1.0}, {"tpu-v6e": 1.0})
    ici = lambda c: dc.replace(v, collective={"tpu-v6e": c})
    out["gpt3_ici_share_alone"] = fit_share([gpt3], ici, GRID["collective"])
    exposed = lambda c: step_seconds(gpt3.workload, v6e, ici(c))["fsdp_exposed_s"]
    out["gpt3_gathers_hidden_from"] = min(c for c in GRID["collective"] if exposed(c) == 0)
    assert exposed(out["gpt3_gathers_hidden_from"] - 0.05) > 0
    # torchtitan: priced with the FA3/cuDNN attention share instead of FlashAttention-2's
    fa3 = leave_one_out(
        [dataclasses.replace(r, workload=dataclasses.replace(r.workload, attention_kernel="")) for r in runs.values()]
    )
    by = {r["name"]: r["error"] for r in fa3}
    out["titan_fa3_error_8gpu"] = by["torchtitan Llama 3.1 8B, 8 × H100 (FSDP 8, torch.compile)"]
    out["titan_fa3_worst_error"] = max(e for n, e in by.items() if n.startswith("torchtitan"))
    # the 70B runs: what hiding all tensor traffic would gain, and what async TP gained (published steps)
    tp = "torchtitan Llama 3.1 70B fp8, 256 × H100 (FSDP 32, TP 8{})"
    parts = step_seconds(runs[tp.format(", async TP")].workload, HARDWARE["h100-gt"], CALIBRATED)
    out["titan_hidden_tp_gain"] = parts["step_s"] / (parts["step_s"] - parts["tensor_exposed_s"]) - 1
    out["titan_async_tp_gain"] = (
        stored[tp.format("")]["measured_step_s"] / stored[tp.format(", async TP")]["measured_step_s"] - 1
    )
    # the 405B pipeline: interleaved against 1F1B, predicted and published
    pp = "torchtitan Llama 3.1 405B fp8, 512 × H100 (FSDP 8, TP 8, PP 8, {})"
    one, two = stored[pp.format("1F1B")], stored[pp.format("Interleaved 1F1B")]
    out["interleaved_speedup_predicted"] = one["predicted_step_s"] / two["predicted_step_s"]
    out["interleaved_speedup_published"] = one["measured_step_s"] / two["measured_step_s"]
    return out


def test_validation_notes_numbers_are_the_models():
    """Every figure plan_validation_notes.json quotes (why Mixtral 8x22B, the 128k run, Qwen3, gpt-oss and
    GPT-3 miss; the torchtitan runs under another attention kernel, async TP, interleaving) is what the model
    and the stored runs give, to the digits the notes print; no figure is quoted that is not checked here."""
    quoted, computed = _notes()["numbers"], _note_numbers()
    assert set(quoted) == set(computed)
    for name, value in computed.items():
        digits = len(repr(quoted[name]).partition(".")[2])  # as the note prints it: to its last digit
        assert quoted[name] == pytest.approx(value, abs=0.5 * 10**-digits), name
    runs = _stored("plan_validation.json")["rows"]
    assert np.median([abs(r["error"]) for r in runs]) == pytest.approx(0.055, abs=0.0005)  # all 99, the unfitted too


def test_docs_state_the_calibrated_constants():
    """The calibration table of docs/layout-lab.md (from plan_validation.json) states ``CALIBRATED``, which
    ``calibrate()`` reproduces, for every chip family; the H100's FP8 share is fitted on its 14 Float8 runs."""
    from rendered import render, table_rows

    fp8_runs = [r for r in load_runs() if r.fitted and r.hardware.startswith("h100") and r.workload.fp8]
    assert len(fp8_runs) == 14
    table = {row[0]: row[1:] for row in table_rows(render.validation_calibration())}
    for field, label in render.CALIBRATION_NAMES.items():
        values = getattr(CALIBRATED, field)
        cells = dict(zip(render.CHIP_FAMILIES, table[label]))
        for family, cell in cells.items():
            assert cell == (f"{values[family]:g}" if family in values else "–"), (field, family)
        assert set(values) <= set(cells), field
