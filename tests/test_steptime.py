"""The step-time model from mechanisms (jaxpar.analysis.steptime) and its calibration on published runs."""
import dataclasses
import math

import numpy as np
import pytest

from jaxpar.analysis.calibration import CALIBRATED, calibrate, leave_one_out, load_runs, measured_step
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.analysis.steptime import (Calibration, Workload, axis_links, elementwise_values, matmul_seconds,
                                      model_flops, step_seconds, torus_split)
from jaxpar.errors import ConfigError

V5P, H100 = HARDWARE["tpu-v5p"], HARDWARE["h100"]
CAL = Calibration(dict(tpu=0.8, gpu=0.5), dict(tpu=1.0, gpu=1.0), dict(tpu=1.0, gpu=1.0))
SMALL = Workload(embed_dim=1024, num_heads=8, kv_heads=8, head_dim=128, mlp_dim=4096, mlp_matrices=3, num_layers=4,
                 vocab=8192, batch=8, seq=1024, mesh={}, remat="none")


def test_one_device_by_hand():
    w, T = SMALL, 8 * 1024
    mm = lambda k, n: 2 * T * k * n / (H100.peak_bf16_flops * 0.5)          # every dimension a multiple of 128
    fwd_mm = mm(1024, 3 * 1024) + mm(1024, 1024) + mm(1024, 2 * 4096) + mm(4096, 1024)
    att = 4 * T * 1024 * 8 * 128 / 2 / (H100.peak_bf16_flops * 0.5 * 0.75)   # causal half, flash at 0.75 of a GEMM
    ew = (8 * 1024 + 3 * 4096 + 2 * 16 * 128) * T * 2 / H100.hbm_bandwidth
    p = step_seconds(w, H100, CAL)
    assert p["matmul_s"] == pytest.approx(4 * 3 * fwd_mm)                    # forward + 2 × backward, no remat
    assert p["attention_s"] == pytest.approx(4 * 3.5 * att)
    assert p["elementwise_s"] == pytest.approx(4 * 3 * ew)
    params = 4 * w.layer_params + 8192 * 1024
    assert p["optimizer_s"] == pytest.approx(28 * params / H100.hbm_bandwidth)
    head = 3 * mm(1024, 8192) + 16 * T * 8192 / H100.hbm_bandwidth
    assert p["head_s"] == pytest.approx(head)
    assert p["tensor_exposed_s"] == p["fsdp_exposed_s"] == p["dcn_exposed_s"] == 0
    assert p["step_s"] == pytest.approx(4 * (3 * fwd_mm + 3.5 * att + 3 * ew) + head + p["optimizer_s"])
    full = step_seconds(dataclasses.replace(w, remat="full"), H100, CAL)     # full remat: one more forward
    assert full["step_s"] - p["step_s"] == pytest.approx(4 * (fwd_mm + att + ew))
    assert elementwise_values(w) == 8 * 1024 + 3 * 4096 + 2 * 16 * 128


def test_matmul_roofline_and_tiles():
    # a thin matmul is HBM-bound: its operands over the bandwidth
    assert matmul_seconds(8, 8192, 8192, H100, 1.0) == pytest.approx(2 * (8 * 8192 * 2 + 8192 ** 2) / H100.hbm_bandwidth)
    # a shape off the tile pays for the padded one: 129 → 256 rows
    assert matmul_seconds(4096, 4096, 129, V5P, 1.0) == pytest.approx(matmul_seconds(4096, 4096, 256, V5P, 1.0))


def test_links_by_topology():
    assert torus_split(V5P, 64) == [4, 4, 4] and torus_split(V5P, 128) == [8, 4, 4]
    assert torus_split(HARDWARE["tpu-v5e"], 256) == [16, 16]
    w = dataclasses.replace(SMALL, mesh=dict(fsdp=16, tensor=4), batch=64)
    links = axis_links(w, V5P)          # tensor on one side of 4, fsdp on the other two: both directions of each
    assert links["tensor"] == 2 * 100e9 and links["fsdp"] == 4 * 100e9
    assert axis_links(dataclasses.replace(SMALL, mesh=dict(fsdp=8)), H100)["fsdp"] == H100.fast_link
    assert axis_links(dataclasses.replace(SMALL, mesh=dict(fsdp=16), batch=16), H100)["fsdp"] == H100.slow_link


def test_tensor_traffic_exposed_forward_hidden_backward_on_tpu():
    w = dataclasses.replace(SMALL, mesh=dict(tensor=4), remat="none")
    T = 8 * 1024
    assert torus_split(V5P, 4) == [2, 2, 1] and axis_links(w, V5P)["tensor"] == 4 * 100e9   # 2 sides of 2
    tp = 2 * 2 * 3 / 4 * T * 1024 * 2 / (4 * 100e9)          # two ring all-reduces of [T, D] a forward
    tpu = step_seconds(w, V5P, CAL)
    gpu = step_seconds(w, dataclasses.replace(V5P, tensor_overlap=False), CAL)
    assert tpu["tensor_exposed_s"] == pytest.approx(4 * tp)        # the backward's run beside weight gradients
    assert gpu["tensor_exposed_s"] == pytest.approx(4 * 2 * tp)    # without that overlap, both exposed


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
    flops = 8 * 2048 * (6 * params + 6 * 32 * 32 * 256 * 2048)     # v5p table: causal attention halved
    assert model_flops(w, causal_attention=True, count_embedding=True) == pytest.approx(flops)
    assert r.measured_step_s == pytest.approx(flops / (0.7147 * 459e12))
    t = runs["torchtitan Llama 3.1 8B, 8 × H100 (FSDP 8, torch.compile)"]
    assert t.measured_step_s == pytest.approx(2 * 8192 / 6667)
    assert measured_step(w, V5P, dict(mfu=0.5, convention=dict(attention="full", embedding="counted"))) > \
        measured_step(w, V5P, dict(mfu=0.5, convention=dict(attention="causal", embedding="counted")))


def test_leave_one_out_over_published_runs():
    """The README's validation table: 47 runs, each predicted with constants fitted without it."""
    runs = load_runs()
    assert len(runs) == 47
    assert calibrate(runs) == CALIBRATED                    # the constants in the code are the fit's
    rows = leave_one_out(runs)
    err = np.abs([r["error"] for r in rows])
    assert np.median(err) == pytest.approx(0.066, abs=0.0005)        # goal: ≤ 10%
    assert np.sum(err > 0.10) == 15 and np.sum(err > 0.20) == 1      # goal: none > 20%; the README names the one
    worst = rows[int(np.argmax(err))]
    assert worst["name"] == "MaxText 128B, 2× v5p-512" and worst["error"] == pytest.approx(0.211, abs=0.0005)


def test_bad_workloads_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match="sequence=2"):
        dataclasses.replace(SMALL, mesh=dict(sequence=2)).check()
    with pytest.raises(ConfigError, match="batch=8: not divisible by the 16"):
        dataclasses.replace(SMALL, mesh=dict(fsdp=16)).check()
    with pytest.raises(ConfigError, match="remat='some'"):
        dataclasses.replace(SMALL, remat="some").check()
    with pytest.raises(ConfigError, match="num_heads=8: not divisible by tensor=16"):
        dataclasses.replace(SMALL, mesh=dict(tensor=16)).check()
    assert math.isfinite(step_seconds(SMALL, HARDWARE["tpu-v6e"], CAL)["step_s"])
