"""Generation: KV cache, prefill/decode, samplers."""
