"""colab/07_inference.ipynb runs, and its cache, FLOP, intensity and decode-layout numbers hold."""

import math

from notebooks import figures, run_tutorial

# (layers, kv heads, head width) from the published configs; the 70B variants change only the kv heads
SHAPES = {
    "llama2-7b": (32, 32, 128),
    "llama3-8b": (32, 8, 128),
    "mistral-7b": (32, 8, 128),
    "qwen3-8b": (36, 8, 128),
    "mixtral-8x7b": (32, 8, 128),
    "llama3-70b": (80, 8, 128),
    "70b MHA (K=64)": (80, 64, 128),
    "70b MQA (K=1)": (80, 1, 128),
}
BF16 = 2
LLAMA3_8B = dict(params=8_030_261_248, vocab=128_256, embed=4096, layers=32, heads=32, head_dim=128)
KV_8B = 2 * 32 * 8 * 128 * BF16


def flops_8b(batch: int, tokens: int, slots: int, decode: bool) -> float:
    """2 FLOPs per weight and token, plus attention (QKᵀ and PV: 4·n·N·H per layer and token over n
    keys: every cache slot in decode, the whole padded prompt in prefill, masked but computed); prefill
    runs the LM head for the last token of each prompt only. Norms, RoPE and softmax are left out: the
    compiled count is within 1% of this."""
    m = LLAMA3_8B
    emb = m["vocab"] * m["embed"]
    body = m["params"] - 2 * emb  # every weight but the embedding and the LM head
    attention = lambda keys: 4 * keys * m["heads"] * m["head_dim"] * m["layers"]
    if decode:
        return batch * (2 * (body + emb) + attention(slots))
    return batch * (tokens * (2 * body + attention(tokens)) + 2 * emb)


def test_inference_notebook():
    k = run_tutorial("07_inference")
    assert figures("07_inference") >= 3

    # 1. KV bytes per token: 2·L·K·H·b, and MLA's (kv_lora + rope)·L·b
    for name, (layers, kv, width) in SHAPES.items():
        assert k["kv_bytes_per_token"][name] == 2 * layers * kv * width * BF16, name
    assert k["kv_bytes_per_token"]["deepseek-v3"] == (512 + 64) * 61 * BF16

    # 2. The claim: 65,536 tokens of 70B, kv heads split over `tensor`: total / t per GPU
    total = 65536 * 2 * 80 * 8 * 128 * BF16
    assert k["total_65k_70b"] == total
    assert sorted(k["per_device_65k_70b"]) == ["1", "2", "4", "8"]
    for t, per_device in k["per_device_65k_70b"].items():
        assert per_device == total // int(t), t
    assert 2e9 < k["per_device_65k_70b"]["8"] < 3e9  # "~2 GB/GPU" holds at tensor=8, bf16
    assert k["batch32_65k_tp8"] == 32 * total // 8
    assert k["mha_65k_tp8"] == 8 * total // 8

    # 3. FLOPs from the compiled programs against the formula. 1%: XLA also counts the elementwise ops.
    assert k["params_8b"] == LLAMA3_8B["params"]
    assert math.isclose(k["ridge_h100"], 989e12 / 3.35e12)
    for i, b in enumerate(k["batches"]):
        pre = flops_8b(b, k["prompt"], k["context"], decode=False)
        dec = flops_8b(b, 1, k["context"], decode=True)
        assert math.isclose(k["compiled_flops"]["prefill"][i], pre, rel_tol=0.01), (b, pre)
        assert math.isclose(k["compiled_flops"]["decode"][i], dec, rel_tol=0.01), (b, dec)
        # intensity over the bytes a step must move: weights + cache read (decode) or written (prefill)
        pre_i = k["compiled_flops"]["prefill"][i] / (BF16 * LLAMA3_8B["params"] + b * k["prompt"] * KV_8B)
        dec_i = k["compiled_flops"]["decode"][i] / (BF16 * LLAMA3_8B["params"] + b * k["context"] * KV_8B)
        assert math.isclose(k["intensity"]["prefill"][i], pre_i) and math.isclose(k["intensity"]["decode"][i], dec_i)
        assert pre_i > k["ridge_h100"] and dec_i < k["ridge_h100"] / 10
        # XLA:CPU counts every op's operands and outputs in float32: more bytes than the minimum
        assert k["xla_intensity"]["prefill"][i] < pre_i and k["xla_intensity"]["decode"][i] < dec_i
    # decode levels off below FLOPs per token / cache bytes per sequence
    ceiling = flops_8b(1, 1, k["context"], decode=True) / (k["context"] * KV_8B)
    assert k["intensity"]["decode"] == sorted(k["intensity"]["decode"]) and k["intensity"]["decode"][-1] < ceiling
    # the unrolled 32-layer program counts every layer: the composed count
    assert math.isclose(k["whole_program_flops"], k["compiled_flops"]["decode"][0], rel_tol=0.01)
    assert k["prefill_tok_s"] > k["decode_tok_s"]

    # 4. Decode layouts (tiny: 102,720 float32 parameters, 2 layers, 2 kv heads of 8, D = 64; batch 8,
    # 64 slots, 8 devices)
    tp, dp = k["layouts"]["decode_tp"], k["layouts"]["decode_dp"]
    assert dp["weight_bytes_per_device"] == 102_720 * 4  # whole on every device
    assert tp["weight_bytes_per_device"] < dp["weight_bytes_per_device"] / 4
    cache = 2 * 2 * 2 * 8 * 4 * 64 * 8  # K and V · L · K · H · b · S · B
    assert tp["cache_bytes_per_device"] == dp["cache_bytes_per_device"] == cache // 8
    assert dp["collective_bytes_per_step"] == 0 and dp["per_layer"] == {}  # each device its own rows
    assert tp["per_layer"]["all-reduce"] == [2, 2 * 8 * 1 * 64 * 4]  # attention out + MLP down
    assert tp["collective_bytes_per_step"] > 2 * 2 * 8 * 64 * 4

    # 5. Trained and generated
    assert k["first_token_matches_forward"]
    assert abs(k["first_loss"] - math.log(256)) < 0.3
    assert k["entropy_rate"] - 0.1 < k["final_loss"] < k["entropy_rate"] + 1.0
