"""colab/02_tensor_sequence.ipynb runs, and what it shows holds: the Megatron MLP equals the unsharded
one, the collectives per layer with and without sequence parallelism, and the layout lab's TP share of
step time for Llama-3 70B against formulas and datasheet numbers written out here."""

import pytest
from notebooks import figures, run_tutorial

# Llama-3.1 70B (published config) and the prompt the notebook prices
L, D, H, K, HD, F, V = 80, 8192, 64, 8, 128, 28_672, 128_256
SEQ = 4096
# datasheets: dense bf16 FLOP/s, HBM bytes/s, link bytes/s each way (NVLink 900 GB/s both ways; PCIe Gen5
# x16 128 GB/s both ways; PCIe Gen4 x16 64 GB/s both ways)
HW = {"h100": (989e12, 3.35e12, 450e9), "h100-pcie": (756e12, 2.0e12, 64e9), "l40s": (362.05e12, 864e9, 32e9)}
EFFICIENCY = 0.6  # the lab's default share of peak


@pytest.fixture(scope="module")
def k():
    return run_tutorial("02_tensor_sequence")


def test_megatron_mlp_equals_the_unsharded_one(k):
    B, T, D_, _ = k["mlp"]
    assert figures("02_tensor_sequence") >= 1
    assert k["hand_error"] < 1e-5  # float32 sums in another order
    runs = k["mlp_runs"]
    assert runs["tp without SP"]["collectives"] == [["all-reduce", [[B, T, D_]]]]
    # with SP: gather the T-split input, reduce(-scatter) the partial sums (all-reduce + slice on CPU)
    assert runs["tp"]["collectives"] == [["all-gather", [[B, T, D_]]], ["all-reduce", [[B, T, D_]]]]
    assert all(r["error"] < 1e-5 for r in runs.values())


def test_collectives_per_layer(k):
    """Megatron: 2 reductions forward (attention out, MLP down), backward the input gradients of the
    column-parallel matmuls: 1 for the fused gate_up, 3 for q, k, v (reduced one by one). With SP each
    becomes a reduce-scatter and 4 all-gathers appear (2 forward, their 2 transposes backward), plus the
    two norm-scale gradients [D] all-reduced."""
    c = k["layer_counts"]
    assert c["tp without SP"] == {"all-reduce activation": 6}
    assert c["tp"] == {
        "all-gather activation": 4,
        "all-reduce activation": 6,
        f"all-reduce [{k['layer']['embed_dim']}]": 2,
    }
    lay = k["layer"]
    A, n = lay["batch"] * lay["seq"] * lay["embed_dim"] * 4, 8
    assert k["bytes_no_sp"] == pytest.approx(6 * 2 * (n - 1) / n * A)
    assert k["bytes_sp"] == pytest.approx((4 + 6) * (n - 1) / n * A)
    assert k["bytes_sp"] < k["bytes_no_sp"]
    # activations between blocks split along T: the step's temporaries shrink by more than a fifth
    assert k["layer_memory"]["tp"] < 0.8 * k["layer_memory"]["tp without SP"]


def test_70b_weights_per_device_at_tp4(k):
    """The claim: 140 GB of 16-bit weights, 35 GB per GPU at TP = 4. Every matrix splits 4 ways (8 kv
    heads, the vocabulary 128,256 = 4 × 32,064); the norm scales (2 per layer + 1) are replicated."""
    params = L * (D * HD * (2 * H + 2 * K) + 3 * D * F + 2 * D) + 2 * V * D + D
    assert k["llama70b_params"] == params == 70_553_706_496
    norms = (2 * L + 1) * D
    assert k["weights_tp4"] == 2 * ((params - norms) // 4 + norms)
    assert k["weights_tp4"] == pytest.approx(35e9, rel=0.01)


def _shares(t, hw):
    peak, hbm, link = HW[hw]
    params = L * (D * HD * (2 * H + 2 * K) + 3 * D * F + 2 * D) + 2 * V * D + D
    train_flops = (6 * (L * (D * HD * (2 * H + 2 * K) + 3 * D * F) + V * D) + 6 * L * H * HD * SEQ) * SEQ / t
    ring = 2 * (t - 1) / t * SEQ * D * 2  # one bf16 [SEQ, D] all-reduce, bytes sent
    fwd_comm, fwd_compute = (2 * L + 1) * ring / link, train_flops / 3 / (peak * EFFICIENCY)
    assert 2 * params / t / hbm < fwd_compute  # compute-bound: the roofline takes compute
    train_comm, train_compute = (4 * L + 2) * ring / link, train_flops / (peak * EFFICIENCY)
    return fwd_comm / (fwd_comm + fwd_compute), train_comm / (train_comm + train_compute)


@pytest.mark.parametrize("hw", sorted(HW))
def test_tp_share_of_step_time(k, hw):
    """TP traffic fully exposed over the fast link, compute at 60 % of peak: share = comm / (compute +
    comm), for the forward pass (2L + 1 all-reduces) and for training (4L + 2; compute 3× the forward)."""
    for t in (2, 4, 8):
        prefill, training = _shares(t, hw)
        got = k["share"][f"{hw}/{t}"]
        assert got["prefill"] == pytest.approx(prefill, rel=1e-6)
        assert got["training"] == pytest.approx(training, rel=1e-6)


def test_what_the_notebook_says_about_the_claim(k):
    s = {key: v for key, v in k["share"].items()}
    pct = lambda key, kind: round(100 * s[key][kind], 1)  # as the notebook's text quotes them
    claim_pcie = {2: 0.08, 4: 0.25, 8: 0.38}
    # the lab's PCIe shares are above the claim's at every degree
    assert [pct(f"h100-pcie/{t}", "prefill") for t in (2, 4, 8)] == [20.6, 43.7, 64.5]
    assert [pct(f"h100-pcie/{t}", "training") for t in (2, 4, 8)] == [14.7, 34.1, 54.7]
    assert all(s[f"h100-pcie/{t}"][kind] > claim_pcie[t] for t in (2, 4, 8) for kind in ("prefill", "training"))
    # NVLink: 12.6 % at TP = 4 and 25.2 % at TP = 8 (prefill), above 9 %; training in 2-9 % up to TP = 4
    assert (pct("h100/4", "prefill"), pct("h100/8", "prefill")) == (12.6, 25.2)
    assert all(0.02 <= s[f"h100/{t}"]["training"] <= 0.09 for t in (2, 4)) and s["h100/8"]["training"] > 0.09
    assert 0.02 <= s["h100/2"]["prefill"] <= 0.09
    # the L40S lands on the H100 PCIe's curve: compute over link bandwidth is nearly the same
    assert all(abs(s[f"l40s/{t}"]["prefill"] - s[f"h100-pcie/{t}"]["prefill"]) < 0.02 for t in (2, 4, 8))
    # the claim's PCIe numbers follow a ring's (t − 1) scaling from its 8 % at TP = 2
    r = 0.08 / 0.92
    assert k["claim_scaled"] == pytest.approx({str(t): r * (t - 1) / (1 + r * (t - 1)) for t in (2, 4, 8)})
    assert abs(k["claim_scaled"]["8"] - claim_pcie[8]) < 0.005 and abs(k["claim_scaled"]["4"] - claim_pcie[4]) < 0.05
    # decode in bandwidth terms: a small share (the lab has no latency term)
    assert max(k["decode"].values()) < 0.07
