"""colab/04_context.ipynb runs, and what it shows holds."""

import pytest
from notebooks import figures, run_tutorial

from jaxpar.models import get_model_preset

TINY = get_model_preset("tiny")
N, K, H, LAYERS = TINY.num_heads, TINY.num_kv_heads, TINY.head_dim, TINY.num_layers


@pytest.fixture(scope="module")
def k():
    return run_tutorial("04_context")


def test_figures(k):
    assert figures("04_context") >= 3  # the ring grids, work per device, memory against L


def test_the_ring_hops(k):
    n = k["n"]
    assert n == 8  # cp takes every one of the 8 simulated devices
    assert sorted(map(tuple, k["ring_pairs"])) == [(i, (i + 1) % n) for i in range(n)]
    # After s hops device d holds the block that started on device d - s.
    assert k["held"] == [[(d - s) % n for d in range(n)] for s in range(n)]


def test_work_per_device(k):
    n, length = k["n"], k["L"]
    c, h = length // n, length // (2 * n)  # a device's block; a chunk (half a block)
    # Contiguous: device d's queries d·c .. d·c + c - 1 each see every key up to themselves.
    assert k["unmasked_entries"]["contiguous"] == [c * c * d + c * (c + 1) // 2 for d in range(n)]
    # Zig-zag: chunks d and 2n-1-d, together (2n - 1) full chunk-by-chunk tiles and two diagonals.
    assert k["unmasked_entries"]["zig-zag"] == [h * h * (2 * n - 1) + h * (h + 1)] * n
    for order in ("contiguous", "zig-zag"):
        assert sum(k["unmasked_entries"][order]) == length * (length + 1) // 2
    # The kernel's half-pairs: live iff the kv chunk is not after the q chunk.
    assert k["pairs_computed"]["contiguous"] == [4 * d + 3 for d in range(n)]
    assert k["pairs_computed"]["zig-zag"] == [2 * n + 1] * n
    con = k["pairs_computed"]["contiguous"]
    assert max(con) / (sum(con) / n) == pytest.approx((4 * n - 1) / (2 * n + 1))


def test_memory_against_length(k):
    n, temp = k["n"], k["temp_bytes"]
    for length in (1024, 2048, 4096):
        one, ring = temp[f"one device/L={length}"], temp[f"cp ring/L={length}"]
        assert one >= N * length * length * 4, length  # at least one fp32 [N, L, L] score matrix
        if length >= 2048:
            # The ring's scores are (L/2n)² tiles, 1/4n² of the matrix; the O(L/n) rest is small here.
            assert one >= n * n * ring, (length, one, ring)
    # One device grows as L² (x4 per doubling, 5% slack for the O(L) terms).
    assert temp["one device/L=4096"] >= 3.8 * temp["one device/L=2048"]
    # Per device the ring holds a few score tiles of one (q-half, kv-half) pair at a time: scores,
    # probabilities and their gradients, fewer than 8 tiles. (The train step before ring.py's barrier
    # kept every ring step's masks: 192 MB at L = 4096, 92 tiles.)
    tile = N * (4096 // (2 * n)) ** 2 * 4
    assert temp["cp ring/L=4096"] <= 8 * tile, temp["cp ring/L=4096"] / tile


def test_collectives_are_the_formulas(k):
    n, b, length = k["n"], 2, k["L"]
    assert k["L"] == 256 and k["ulysses"]["batch"] == b
    # Ring forward: per layer n - 1 hops of the K and V blocks (fp32) and the int32 token indices.
    kv = 2 * b * (length // n) * K * H * 4
    assert k["ring_permute_bytes"] == LAYERS * (n - 1) * (kv + b * (length // n) * 4)
    # Ulysses, tiny with 4 kv heads on sequence=4: Q, K, V in, output out; each all-to-all leaves a
    # device as many bytes as it sent.
    u = k["ulysses"]
    assert (u["n"], u["heads"], u["kv_heads"], u["head_dim"], u["layers"]) == (4, N, 4, H, LAYERS)
    assert u["all_to_all_count"] == 4 * LAYERS
    assert u["all_to_all_bytes"] == LAYERS * b * (length // 4) * H * 4 * (2 * N + 2 * 4)


def test_ring_equals_dense(k):
    # fp32, online softmax against one softmax: rounding only (test_ring.py's tolerance).
    for what, err in k["ring_vs_dense_max_error"].items():
        assert err <= 1e-5, (what, err)
