"""colab/07_inference.ipynb runs, and its cache, intensity and layout numbers hold."""
import math

from notebooks import figures, run_tutorial

# (layers, kv heads, head width) of the presets, from their published configs; bf16 = 2 bytes
GQA = {"llama3-8b": (32, 8, 128), "mistral-7b": (32, 8, 128), "qwen3-8b": (36, 8, 128), "llama3-70b": (80, 8, 128),
       "mixtral-8x7b": (32, 8, 128)}
LLAMA3_8B_PARAMS = 8_030_261_248


def test_inference_notebook():
    k = run_tutorial("07_inference")
    assert figures("07_inference") >= 2
    for name, (layers, kv, width) in GQA.items():
        assert k["kv_bytes_per_token"][name] == 2 * layers * kv * width * 2, name
    assert k["kv_bytes_per_token"]["deepseek-v3"] == (512 + 64) * 61 * 2        # MLA: latent + rope key
    # The claim: 65,536 more tokens of 70B under 8-way TP: 2.7 GB per GPU (~2 GB in the texts' rounding).
    assert k["per_device_65k_70b"] == 65536 * 2 * 80 * 8 * 128 * 2 // 8
    assert 2e9 < k["per_device_65k_70b"] < 3e9
    # Intensity: 2·P·tokens FLOPs over 2·P weight bytes + the cache.
    assert k["params_8b"] == LLAMA3_8B_PARAMS
    assert math.isclose(k["ridge_h100"], 989e12 / 3.35e12)
    kv8 = 2 * 32 * 8 * 128 * 2
    for b, pre, dec in zip(k["batches"], k["prefill_intensity"], k["decode_intensity"]):
        assert math.isclose(pre, 2 * LLAMA3_8B_PARAMS * b * 512 / (2 * LLAMA3_8B_PARAMS + b * 512 * kv8))
        assert math.isclose(dec, 2 * LLAMA3_8B_PARAMS * b / (2 * LLAMA3_8B_PARAMS + b * 4096 * kv8))
        assert pre > k["ridge_h100"] and dec < k["ridge_h100"] / 10
    assert k["prefill_tok_s"] > k["decode_tok_s"]
    tp, dp = k["layouts"]["decode_tp"], k["layouts"]["decode_dp"]
    assert dp["weight_bytes_per_device"] == 102_720 * 4                          # tiny, float32, whole
    assert tp["weight_bytes_per_device"] < dp["weight_bytes_per_device"] / 4
    assert dp["collective_bytes"] == {"all-reduce": 1} and sum(tp["collective_bytes"].values()) > 1000
    assert k["first_token_matches_forward"] and k["final_loss"] < math.log(256) - 2
