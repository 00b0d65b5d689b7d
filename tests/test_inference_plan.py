"""``jaxpar plan --inference``: what a serving layout holds and moves, against numbers worked by hand."""

import json
import math
from pathlib import Path

import pytest

from jaxpar.analysis.calibration import CALIBRATED
from jaxpar.analysis.hardware import HARDWARE
from jaxpar.analysis.inference_plan import format_inference_plan, plan_inference
from jaxpar.cli import main
from jaxpar.models import get_model_preset

H100 = HARDWARE["h100"]


def test_one_device_by_hand():
    """Llama-3-8B, bf16, batch 2 × 1024 positions on one H100."""
    p = plan_inference("llama3-8b", "decode_dp", batch=2, context=1024, hardware="h100", devices=1)
    c = get_model_preset("llama3-8b")
    L, d, n, k, h, f, v = c.num_layers, c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim, c.padded_vocab
    weights = 2 * (L * (d * h * (2 * n + 2 * k) + 3 * d * f + 2 * d) + 2 * v * d + d)  # bf16, untied head
    assert p.weight_bytes_per_device == weights
    kv = 2 * L * k * h * 2  # K and V, bf16
    assert p.kv_bytes_per_token == p.kv_bytes_per_token_per_device == kv == 131072
    assert p.kv_bytes_per_device == 2 * 1024 * kv
    assert p.max_batch == int((80e9 - weights) // (1024 * kv))
    matmul = L * (d * h * (2 * n + 2 * k) + 3 * d * f)
    prefill = 2 * (1024 * (2 * matmul + 2 * L * n * h * 1024) + 2 * v * d)  # head at the last token
    assert p.prefill_flops_per_device == pytest.approx(prefill, rel=1e-12)
    eta = CALIBRATED.matmul["gpu"]  # the calibrated matmul share of the chip's family
    assert p.assumptions["efficiency"] == eta
    assert p.prefill_s == pytest.approx(prefill / (eta * H100.peak_bf16_flops))
    read = weights + 2 * 1024 * kv
    assert p.decode_times["memory_s"] == pytest.approx(read / H100.hbm_bandwidth)
    assert p.decode_bytes_by_axis == {} and p.decode_step_s == pytest.approx(read / H100.hbm_bandwidth)
    assert p.tokens_per_s == pytest.approx(2 / p.decode_step_s)


def test_tensor_parallel_70b_and_the_texts_claims():
    """Llama-3-70B on decode_tp: 141 GB of bf16 weights are 17.6 GB per GPU over 8 and 35 GB over 4
    (the texts: "TP=4 on a 70B model needs about 35 GB per GPU"); every 65k tokens of context costs
    65536 × 2·80·(8 kv heads / 8)·128·2 bytes = 2.68 GB per GPU even with GQA (the texts: "about 2 GB")."""
    p = plan_inference("llama3-70b", "decode_tp", batch=8, context=512, hardware="h100", devices=8)
    c = get_model_preset("llama3-70b")
    assert p.weight_bytes_per_device == pytest.approx(2 * c.num_params(padded=True) / 8, rel=0.01)
    assert 65536 * p.kv_bytes_per_token_per_device == 2 * 80 * 1 * 128 * 2 * 65536 == pytest.approx(2.68e9, rel=0.01)
    tp4 = plan_inference("llama3-70b", "decode_tp", batch=4, context=512, hardware="h100", devices=4)
    assert tp4.weight_bytes_per_device == pytest.approx(35e9, rel=0.02)  # "about 35 GB"
    # The decode step's tensor traffic: at least two ring all-reduces of [batch, d] bf16 per layer.
    ring = 2 * 7 / 8 * 8 * c.embed_dim * 2
    floor = 2 * c.num_layers * ring
    assert floor <= p.decode_bytes_by_axis["tensor"] <= 1.25 * floor
    assert p.link_by_axis == {"tensor": "fast"}
    # plus each collective's latency: at least the two all-reduces a layer, 15 µs each over 8 NVLink GPUs
    latency = p.decode_times["latency_s"]["tensor"]
    assert 2 * c.num_layers * 15e-6 <= latency <= 1.25 * 2 * c.num_layers * 15e-6
    assert p.decode_step_s == pytest.approx(
        max(p.decode_times["memory_s"], p.decode_times["compute_s"])
        + p.decode_bytes_by_axis["tensor"] / H100.fast_link
        + latency
    )


def test_collective_latency_by_hand():
    """NCCL's ring model: 6.6 µs + 0.6 µs a step over NVLink (2.7 µs a step between nodes, 1.0 over PCIe).
    An all-reduce over 8 GPUs of a node: 6.6 + 14 × 0.6 = 15 µs; over 16 in 2 nodes: 2 of its 30 steps cross
    the network, 6.6 + 28 × 0.6 + 2 × 2.7 = 28.8 µs; an all-gather over 8 PCIe cards 6.6 + 7 × 1.0 = 13.6 µs.
    A TPU collective pays 1 µs an ICI hop and nothing to launch: 16 chips, 30 µs."""
    from jaxpar.analysis.links import collective_latency

    assert collective_latency("all-reduce", 8, 1, H100) == pytest.approx(15.0e-6)
    assert collective_latency("all-reduce", 16, 2, H100) == pytest.approx(28.8e-6)
    assert collective_latency("all-gather", 8, 1, HARDWARE["h100-pcie"]) == pytest.approx(13.6e-6)
    assert collective_latency("all-reduce", 16, 1, HARDWARE["tpu-v5p"]) == pytest.approx(30e-6)
    assert collective_latency("all-reduce", 1, 1, H100) == 0


def test_each_layer_adds_its_two_all_reduces_latency():
    """tiny on decode_tp over 2 GPUs: two more layers add 2 × 2 all-reduces (attention and MLP outputs) to the
    decode program, 4 × (6.6 + 2 × 0.6) µs of latency; the rest of the program (embedding, head, sampler)
    stays as it was."""
    two, four = (
        plan_inference("tiny", "decode_tp", batch=2, context=64, hardware="h100", devices=2, num_layers=n)
        for n in (2, 4)
    )
    extra = four.decode_times["latency_s"]["tensor"] - two.decode_times["latency_s"]["tensor"]
    assert extra == pytest.approx(4 * 7.8e-6)
    # cuDNN attention (prefill) compiles on CPU as XLA's: the same programs, the same plan
    cudnn = plan_inference(
        "tiny",
        "decode_tp",
        batch=2,
        context=64,
        hardware="h100",
        devices=2,
        num_layers=2,
        execution=dict(attention_impl="cudnn"),
    )
    assert (cudnn.decode_step_s, cudnn.prefill_s, cudnn.decode_bytes_by_axis) == (
        two.decode_step_s,
        two.prefill_s,
        two.decode_bytes_by_axis,
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--inference", "--mesh", "decode_tp", "--batch", "2"], "--inference needs --context"),
        (["--mesh", "dp", "--batch", "2"], "--seq ≥ 1 is required"),
        (["--inference", "--mesh", "decode_tq", "--context", "64", "--batch", "2"], "did you mean 'decode_tp'"),
    ],
)
def test_bad_input(argv, message, capsys):
    assert main(["plan", "--model", "tiny", "--hardware", "h100", "--devices", "8", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_command_prints_json(capsys):
    assert (
        main(
            [
                "plan",
                "--inference",
                "--model",
                "tiny",
                "--mesh",
                "decode_tp",
                "--devices",
                "8",
                "--batch",
                "8",
                "--context",
                "64",
                "--hardware",
                "l40s",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["mesh"] == {"tensor": 8} and out["kv_bytes_per_token"] == 2 * 2 * 2 * 8 * 2  # K,V·layers·kv·h·bf16
    assert out["tokens_per_s"] == pytest.approx(8 / out["decode_step_s"]) and math.isfinite(out["prefill_s"])


SEARCH_JSON = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "serve_plan_llama3-70b_h100x8.json"


def _stored_search() -> list[dict]:
    """The candidates of ``jaxpar plan --inference --search --json`` as stored for docs/layout-lab.md."""
    return json.loads(SEARCH_JSON.read_text())["candidates"]


def test_search_ranks_serving_layouts_under_a_latency_bound(tmp_path, capsys):
    """Llama-3-70B on 8 H100s, batch 32 × 8192: only tensor ≥ 4 holds the 141 GB of weights with the
    cache; the bound on the decode step then decides between the rest."""
    from jaxpar.analysis.inference_plan import search_inference

    ranked, refused = search_inference("llama3-70b", 8, batch=32, context=8192, hardware="h100", max_step_s=0.012)
    assert refused == [] and [p.mesh.get("tensor", 1) for p in ranked] == [8, 4, 2, 1]
    assert [p.fits for p in ranked] == [True, True, False, False]
    assert ranked[0].decode_step_s <= 0.012 < ranked[1].decode_step_s
    # the stored search the docs render (its table and its best layout's plan) is this search, field by field
    stored = _stored_search()
    assert [c["mesh"] for c in stored] == [p.mesh for p in ranked]
    for c, p in zip(stored, ranked):
        for key in ("weight_bytes_per_device", "kv_bytes_per_device", "fits", "max_batch", "decode_bytes_by_axis"):
            assert c[key] == getattr(p, key), (p.mesh, key)
        for key in ("decode_step_s", "time_to_first_token_s", "tokens_per_s", "prefill_s"):
            assert c[key] == pytest.approx(getattr(p, key), rel=1e-9), (p.mesh, key)
    from rendered import render

    assert format_inference_plan(ranked[0]) in render.serve_plan_example()
    assert ranked[1].weight_bytes_per_device == pytest.approx(2 * ranked[0].weight_bytes_per_device, rel=1e-3)
    assert [p.tokens_per_s for p in ranked[1:]] == sorted((p.tokens_per_s for p in ranked[1:]), reverse=True)
    assert (
        main(
            [
                "plan",
                "--inference",
                "--search",
                "--model",
                "tiny",
                "--devices",
                "8",
                "--batch",
                "8",
                "--context",
                "64",
                "--hardware",
                "h100",
                "--plot",
                str(tmp_path / "rank.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "4 serving layouts" in out and (tmp_path / "rank.png").stat().st_size > 0
