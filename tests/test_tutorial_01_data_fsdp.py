"""colab/01_data_fsdp.ipynb runs, and what it shows holds: memory per device and bytes moved under dp,
fsdp and hsdp, against the ZeRO bookkeeping and the ring formulas written out here."""

import pytest
from notebooks import figures, run_tutorial

B_GRAD = 4  # float32 gradients and parameters


@pytest.fixture(scope="module")
def k():
    return run_tutorial("01_data_fsdp")


def small_parts(k):
    """Parameter counts of the notebook's small model from its dimensions (vocab padded to 128)."""
    m = k["small"]
    V, D, L = -(-m["vocab_size"] // 128) * 128, m["embed_dim"], m["num_layers"]
    H, K, hd, F = m["num_heads"], m["num_kv_heads"], m["head_dim"], m["mlp_dim"]
    parts = dict(embed=V * D, head=V * D, norm=L * 2 * D + D, blocks=L * (D * hd * (2 * H + 2 * K) + 3 * D * F))
    return parts, sum(parts.values())


def test_figures_and_model(k):
    assert figures("01_data_fsdp") >= 2
    parts, P = small_parts(k)
    assert k["small_params"] == P and k["devices"] == 8
    assert parts["blocks"] > 0.95 * P  # the parameters sit in the layers


def test_memory_per_device(k):
    """memory_analysis() of the compiled step. Arguments are the state, 12 bytes (parameter + two
    moments) per element a device keeps; the norm scales are replicated under every layout. The few
    hundred bytes over are the token ids and the optimizer's step counters."""
    parts, P = small_parts(k)
    n, norm = k["devices"], parts["norm"]
    mem = k["memory"]
    for name, shards in (("dp", 1), ("fsdp", n), ("hsdp", n // 2)):
        state = 12 * ((P - norm) / shards + norm)
        assert 0 < mem[name]["arguments"] - state <= 1024, (name, mem[name], state)
    # dp: the gradient and one more parameter-sized buffer, plus a few KB of activations (16 tokens)
    assert 8 * P <= mem["dp"]["temporaries"] <= 8 * P * 1.001
    # fsdp: both buffers sharded, plus a floor that does not shrink with n: one layer gathered
    layer = 4 * parts["blocks"] / k["small"]["num_layers"]
    assert 8 * P / n < mem["fsdp"]["temporaries"] <= 8 * P / n + 2 * layer
    # hsdp: 20 bytes per parameter over 4 shards (the sharded buffers are larger than the floor)
    assert mem["hsdp"]["total"] == pytest.approx(20 * P / 4, rel=5e-3)
    assert mem["dp"]["total"] / mem["hsdp"]["total"] == pytest.approx(4, rel=5e-3)
    assert 6 < mem["dp"]["total"] / mem["fsdp"]["total"] < 8


def test_gradient_all_reduce_is_the_ring_formula(k):
    """dp: one all-reduce of every gradient (P·b) plus the loss scalar; a ring sends 2(n−1)/n of it."""
    _, P = small_parts(k)
    n = k["devices"]
    assert k["dp_volumes"] == {"all-reduce@data": P * B_GRAD + 4}
    assert k["dp_sent"] == pytest.approx(2 * (n - 1) / n * (P * B_GRAD + 4), rel=1e-12)


def test_fsdp_gathers_and_reductions(k):
    """fsdp: block weights gathered twice (forward; backward with its recompute), LM head once,
    embedding never (all-to-all of the activation instead), plus the token ids [B, T] int32; every
    gradient but the embedding's reduced, plus at most a few dozen scalars (loss, norm sums)."""
    parts, P = small_parts(k)
    n, B, T = k["devices"], k["batch"], k["seq"]
    f = k["fsdp"]
    assert f["gathered"] == B_GRAD * (2 * parts["blocks"] + parts["head"]) + 4 * B * T
    assert 0 <= f["reduced"] - B_GRAD * (P - parts["embed"]) <= 128
    assert f["sent_reduce_scatter"] == pytest.approx((n - 1) / n * (f["gathered"] + f["reduced"]))
    # XLA:CPU's reduce-scatter is an all-reduce + slice: twice the ring bytes on the reductions
    assert f["sent_as_compiled"] - f["sent_reduce_scatter"] == pytest.approx((n - 1) / n * f["reduced"])
    # 1.5x DP's bytes by formula; a little less as compiled (embedding never gathered, head once)
    ratio = f["sent_reduce_scatter"] / k["dp_sent"]
    assert 1.4 < ratio < 1.5
    # the lab's minimum: every sharded weight 3(n−1)/n·b, the replicated norms all-reduced
    minimum = (n - 1) / n * 3 * B_GRAD * (P - parts["norm"]) + 2 * (n - 1) / n * B_GRAD * parts["norm"]
    assert k["fsdp_minimum"] == pytest.approx(minimum, rel=1e-9)


def test_hsdp_traffic(k):
    """data=2 × fsdp=4: fsdp's gathers inside each group of 4, then each device's gradient quarter
    (norms excluded: they are reduced over all 8 at once) all-reduced across the two groups."""
    parts, P = small_parts(k)
    h = k["hsdp"]
    assert h["gathered"] - B_GRAD * (2 * parts["blocks"] + parts["head"]) in (0, 4 * k["batch"] * k["seq"] // 2)
    assert 0 <= h["reduced"] - B_GRAD * (P - parts["embed"] - parts["norm"]) <= 128
    assert k["hsdp_data_reduced"] == B_GRAD * (P - parts["norm"]) // 4
    assert k["hsdp_sent"] == pytest.approx(3 / 4 * (h["gathered"] + h["reduced"]) + k["hsdp_data_reduced"])


def test_real_size_state_and_zero_stages(k):
    """Llama-3-8B (8,030,261,248 parameters, published): 16 bytes each, whole under dp, over 8 under
    fsdp and over 4 under hsdp, the norm scales (32 layers × 2 + 1 of width 4096) replicated."""
    psi, n = k["llama_params"], k["devices"]
    assert psi == 8_030_261_248
    norm = 65 * 4096
    state = k["llama_state"]
    assert state["dp"] == 16 * psi
    assert state["fsdp"] == 16 * ((psi - norm) // 8 + norm)
    assert state["hsdp"] == 16 * ((psi - norm) // 4 + norm)
    z = k["zero_stages"]
    assert z == pytest.approx(
        {"DP": 16 * psi, "ZeRO-1": 4 * psi + 12 * psi / n, "ZeRO-2": 2 * psi + 14 * psi / n, "ZeRO-3": 2 * psi}
    )
    assert z["ZeRO-3"] < 80e9 < z["DP"]


def test_sweep_across_devices(k):
    """The trade plotted: per device, dp holds 16Ψ and sends 2(N−1)/N·4Ψ; fsdp holds 16Ψ/N and sends
    3(N−1)/N·4Ψ; hsdp (data=2 × fsdp=N/2) holds 16Ψ/(N/2) and sends fsdp's on N/2 plus a DP all-reduce
    of its shard across the 2 groups. Norm scales replicated, their gradients all-reduced over all N."""
    psi, norm = k["llama_params"], 65 * 4096
    w = psi - norm
    for N in (2, 4, 8, 16, 32, 64):
        r = 2 * (N - 1) / N * 4 * norm
        sent, state = k["sweep"]["dp"][str(N)]
        assert sent == pytest.approx(2 * (N - 1) / N * 4 * psi) and state == 16 * psi
        sent, state = k["sweep"]["fsdp"][str(N)]
        assert sent == pytest.approx((N - 1) / N * 12 * w + r) and state == 16 * (w // N + norm)
        if N >= 4:
            m = N // 2
            sent, state = k["sweep"]["hsdp"][str(N)]
            assert sent == pytest.approx((m - 1) / m * 12 * w + 4 * w / m + r) and state == 16 * (w // m + norm)
            assert state < k["sweep"]["dp"][str(N)][1]


def test_tokens_that_hide_the_traffic(k):
    """Compute 6Ψ FLOPs per token at 60 % of 989 TFLOP/s (H100 SXM datasheet) against k·(n−1)/n·4Ψ bytes
    at 450 GB/s (NVLink, each way) or 50 GB/s (400 Gb/s InfiniBand): Ψ cancels."""
    n = k["devices"]
    for name, factor in (("dp", 2), ("fsdp", 3)):
        for link_name, link in (("NVLink", 450e9), ("InfiniBand", 50e9)):
            tokens = factor * (n - 1) / n * 4 * 989e12 * 0.6 / (6 * link)
            assert k["hide_tokens"][f"{name}_{link_name}"] == pytest.approx(tokens)
