"""colab/06_combining.ipynb runs, and what it shows holds: the 5D layout's shards and its expert
all-to-all, the size of the layout search, and the bottleneck cases, against formulas written out here."""

import math

import pytest
from notebooks import figures, run_tutorial

GB = 1e9
PARAMS = {"llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "mixtral-8x7b": 46_702_792_704}  # published
NVLINK, INFINIBAND = 450e9, 50e9  # the h100 profile's bytes/s per direction inside / across 8-GPU nodes


@pytest.fixture(scope="module")
def k():
    return run_tutorial("06_combining")


def test_five_axes_shards(k):
    assert k["devices"] == 32 and figures("06_combining") >= 3
    mesh = k["mesh"]
    assert all(mesh[a] == 2 for a in ("data", "fsdp", "tensor", "expert", "sequence"))
    for p in k["params"]:
        for size, entry, shard in zip(p["shape"], p["spec"], p["shard"]):
            axes = [] if entry is None else [entry] if isinstance(entry, str) else entry
            assert shard * math.prod(mesh[a] for a in axes) == size, p
    shares = {p["path"].split("/")[-1]: math.prod(p["shard"]) / math.prod(p["shape"]) for p in k["params"]}
    assert shares["gate_up"] == shares["down"] == 1 / 8  # expert × fsdp × tensor
    assert shares["q"] == 1 / 4 and shares["scale"] == 1  # fsdp × tensor; norms whole


def test_each_axis_signature_and_the_expert_all_to_all(k):
    c = k["collectives"]
    assert "all-gather" in c["fsdp"] and "all-reduce" in c["tensor"]
    assert c["sequence"]["collective-permute"]["runs"] >= 2 * k["a2a"]["moe_layers"]  # the ring, every layer
    assert {g for g, kinds in c.items() if "all-to-all" in kinds} == {"expert", "tensor"}
    assert c["tensor"]["all-to-all"]["sent"] < c["expert"]["all-to-all"]["sent"] / 10  # a small reshard
    # the dispatch buffer: B/(data·fsdp·expert) sequences × E × C slots × D float32, not split by sequence
    # or tensor; 4 all-to-alls per MoE layer, each sending (ep−1)/ep of it
    a = k["a2a"]
    t = k["seq"]
    c_slots = math.ceil(a["capacity_factor"] * t * a["top_k"] / a["experts"])
    buffer = k["batch"] // 8 * a["experts"] * c_slots * a["embed_dim"] * 4
    assert a["sent"] == c["expert"]["all-to-all"]["sent"] == a["moe_layers"] * 4 * (1 / 2) * buffer
    assert a["runs"] == 4 * a["moe_layers"] == c["expert"]["all-to-all"]["runs"]


def test_search(k):
    s = k["search"]
    # 64 = 2^6 over 6 axes (stage, data, fsdp, expert, sequence, tensor): C(6 + 5, 5) factorizations
    assert s["estimated"] + s["refused"] == math.comb(11, 5) == 462
    assert 0 < s["fitting"] < s["estimated"] and s["best_memory"] <= 80 * GB
    assert s["best"].get("expert", 1) > 1
    assert s["data_only_memory"] >= 16 * PARAMS["mixtral-8x7b"]  # weights, gradients, 2 Adam moments


def test_bottleneck_cases(k):
    cases = k["cases"]
    p70 = PARAMS["llama3-70b"]
    mem = cases["weights + optimizer don't fit"]
    assert not mem["before"]["fits"] and mem["before"]["memory_bytes"] >= 16 * p70
    assert mem["after"]["fits"] and 16 * p70 / 64 <= mem["after"]["memory_bytes"] <= 80 * GB

    fsdp = cases["FSDP over 8 nodes"]
    t = fsdp["before_times"]  # fsdp=64 spans 8 nodes: InfiniBand
    assert t["communication_s"]["fsdp"] == pytest.approx(fsdp["before_bytes"]["fsdp"] / INFINIBAND)
    assert t["exposed_communication_s"] > t["compute_s"] and fsdp["after"]["predicted_step_s"] < t["step_s"] / 2

    tp = cases["TP across nodes"]  # llama3-70b: 80 layers, D = 8192, bf16 activations
    for side, t_ways, link in (("before", 16, INFINIBAND), ("after", 8, NVLINK)):
        fsdp_ways = 64 // t_ways
        tokens = tp["batch"] * tp["seq"] / fsdp_ways
        want = (4 * 80 + 2) * 2 * (t_ways - 1) / t_ways * tokens * 8192 * 2
        assert tp[f"{side}_bytes"]["tensor"] == pytest.approx(want)
        assert tp[f"{side}_times"]["communication_s"]["tensor"] == pytest.approx(want / link)
    assert tp["before"]["predicted_step_s"] > 3 * tp["after"]["predicted_step_s"]

    long = cases["long context (64k tokens)"]
    assert not long["before"]["fits"] and long["after"]["fits"] and long["best"].get("sequence", 1) > 1
    assert all(v["fits"] for v in k["long_context"].values())
    # XLA's attention holds one layer's scores: 8·65,536/(fsdp·sequence) queries × 32/t heads × 65,536 keys
    # × (8 + 2) B: 172 GB under either layout
    for mesh, v in k["long_context_xla"].items():
        queries, heads = (8 * 65536 / 64, 32) if "sequence" in mesh else (8 * 65536 / 8, 32 / 8)
        assert not v["fits"] and v["memory"] > queries * heads * 65536 * 10 > 80 * GB

    moe = cases["MoE experts"]
    assert moe["best"].get("expert", 1) > 1 and moe["after"]["predicted_step_s"] < moe["before"]["predicted_step_s"]

    dp = cases["throughput (one node)"]
    assert dp["before_times"]["exposed_communication_s"] == 0  # compute-bound on one node
    assert 1 < dp["before"]["predicted_step_s"] / dp["after"]["predicted_step_s"] < 8  # 8× the devices


def test_fsdp_sends_more_than_data_parallelism(k):
    """data=8: every float32 gradient all-reduced, 2·(7/8)·4 B a parameter; fsdp=8: weights gathered twice
    and gradients reduce-scattered, (7/8)·(2·4 + 4) B for the sharded ones (norms are all-reduced)."""
    sync, p8 = k["sync_bytes"], PARAMS["llama3-8b"]
    assert sync["data"] == pytest.approx(2 * 7 / 8 * 4 * p8)
    assert 1.49 < sync["fsdp"] / sync["data"] <= 1.5
