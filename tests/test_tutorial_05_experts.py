"""colab/05_experts.ipynb runs, and what it shows holds: capacity drops exactly the overflow of each
expert's slots, the expert-parallel all-to-all sends the bytes of the formula, expert choice fills every
slot, and dropless equals the dense mixture."""

import math

import pytest
from notebooks import figures, run_tutorial


@pytest.fixture(scope="module")
def k():
    return run_tutorial("05_experts")


def test_figures(k):
    assert figures("05_experts") >= 4


def test_capacity_drops_the_overflow(k):
    """C = max(1, ⌈cf·T·k/E⌉) slots per expert per sequence; an expert sent n assignments in a sequence
    drops max(0, n − C) of them, so the dropped share follows from the per-sequence counts alone."""
    b, t, top, e = k["batch"], k["seq"], k["top_k"], k["experts"]
    for cf, c in k["capacity_slots"].items():
        assert c == max(1, math.ceil(float(cf) * t * top / e))
    skews = sorted(k["counts_per_sequence"], key=float)
    for skew in skews:
        counts = k["counts_per_sequence"][skew]
        assert len(counts) == b and all(sum(row) == t * top and len(row) == e for row in counts)
        column = [sum(row[j] for row in counts) for j in range(e)]
        assert k["hottest_share"][skew] == pytest.approx(max(column) / (b * t * top))
        by_cf = []
        for cf, c in sorted(k["capacity_slots"].items(), key=lambda kv: float(kv[0])):
            want = sum(max(0, n - c) for row in counts for n in row) / (b * t * top)
            got = k["dropped"][f"{float(skew):g}/{float(cf):g}"]
            assert got == pytest.approx(want, abs=1e-7), (skew, cf)  # float32 mean of 0/1 flags
            by_cf.append(got)
        assert by_cf == sorted(by_cf, reverse=True)  # more slots never drop more
    for cf in k["capacity_slots"]:  # hotter experts never drop less
        series = [k["dropped"][f"{float(s):g}/{float(cf):g}"] for s in skews]
        assert series == sorted(series)
    assert k["dropped"]["0/2"] == 0 and k["dropped"]["2/4"] > 0.1  # a 2-nat skew beats cf 4
    assert k["hottest_share"]["2"] > 5 / e


def test_all_to_all_bytes_equal_the_formula(k):
    """Per MoE layer and step, 4 all-to-alls (dispatch, combine and their transposes) each send
    (ep−1)/ep of a device's [groups, E, C, D] buffer: T_dev·k·cf rows of D float32 values."""
    s = k["step_all_to_all"]
    ep, tokens = s["ep"], s["batch"] * s["seq"] // s["devices"]
    slots = s["experts"] * math.ceil(s["capacity_factor"] * s["seq"] * s["top_k"] / s["experts"])
    cf = slots / (s["seq"] * s["top_k"])
    assert s["axes"] == ["expert"] and s["count"] == 4 * s["moe_layers"]
    assert s["sent_bytes"] == s["moe_layers"] * 4 * (ep - 1) / ep * tokens * s["top_k"] * cf * s["embed_dim"] * 4
    layer = k["layer_all_to_all"]
    rows = layer["groups"] // 8 * layer["experts"] * layer["slots"]  # 8 devices share the groups
    for ep, sent in layer["sent_bytes"].items():
        ep = int(ep)
        assert sent == 4 * (ep - 1) / ep * rows * layer["embed_dim"] * 4, ep


def test_expert_choice_balances_token_choice_drops(k):
    tc, ec = k["balance"]["token choice"], k["balance"]["expert choice"]
    assert ec["max_over_mean_demand"] == 1.0 and ec["slots_used"] == 1.0
    # at cf = 1 the E·C slots equal the T·k assignments, so the slots token choice fills are the kept ones
    assert k["capacity_slots"]["1.0"] * k["experts"] == k["seq"] * k["top_k"]
    assert tc["slots_used"] == pytest.approx(1 - k["dropped"]["1/1"], abs=1e-7)
    assert tc["max_over_mean_demand"] > 2
    hist = k["expert_choice_experts_per_token"]  # tokens receiving 0, 1, 2, ... experts
    assert sum(hist) == k["batch"] * k["seq"]
    assert sum(j * n for j, n in enumerate(hist)) == k["batch"] * k["seq"] * k["top_k"]  # every slot filled
    assert ec["tokens_without_expert"] == pytest.approx(hist[0] / sum(hist)) and hist[0] > 0
    assert len(hist) > k["top_k"] + 1  # some tokens get more than k


def test_dropless_is_the_dense_mixture(k):
    assert k["dropless_dropped"] == 0
    assert k["dropless_error"] < 1e-5  # float32 rounding of a 64-wide sum
    assert k["capacity_cf1_dropped"] == k["dropped"]["1/1"] and k["capacity_error"] > 0.1
