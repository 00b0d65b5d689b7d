"""Host memory of a streaming Hugging Face import (prints one JSON object).

Writes a Llama-shaped safetensors folder of a few hundred MB (random weights, several files with an
index), then imports it with ``jaxpar.convert.from_hf`` in a fresh process on 8 simulated CPU devices
under ``fsdp=8`` and on one device, and reports the peak resident memory above the process's baseline
(jax started, devices up) as a multiple of the model's size. On CPU the "devices" are host memory too,
so the finished model itself counts: a peak of 1.0× would be the model and nothing else.

    python benchmarks/convert_memory.py > benchmarks/results/convert_memory_cpu8.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32_000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=10_000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)

CHILD = """
import json, resource, sys
from jaxpar.mesh import simulate_cpu_devices
simulate_cpu_devices(8)
import jax, numpy as np
jax.block_until_ready(jax.numpy.ones(8))                     # backend up before the baseline

def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024

from jaxpar.convert import from_hf
base = rss()
model = from_hf(sys.argv[1], mesh=None if sys.argv[2] == "none" else sys.argv[2])
jax.block_until_ready(jax.tree.leaves(model))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(baseline_rss=base, peak_rss=peak, final_rss=rss())))
"""


def write_folder(folder: Path, dtype: str, layers: int) -> int:
    """The Llama-shaped folder, tensor by tensor through ``ShardWriter``; returns its bytes."""
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.convert.files import ShardWriter

    c = dict(CONFIG, num_hidden_layers=layers)
    d, f, h, n, k, v = (
        c["hidden_size"],
        c["intermediate_size"],
        c["head_dim"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["vocab_size"],
    )
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (n * h, d),
            p + "self_attn.k_proj.weight": (k * h, d),
            p + "self_attn.v_proj.weight": (k * h, d),
            p + "self_attn.o_proj.weight": (d, n * h),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
    writer = ShardWriter(folder, max_shard_bytes=100 << 20)
    for name, shape in shapes.items():
        writer.add(name, (rng.standard_normal(shape, np.float32) * 0.02).astype(jnp.dtype(dtype)))
    writer.commit(dict(c, torch_dtype=dtype))
    return writer.total


def measure(folder: Path, mesh: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), mesh], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    """Two depths of the same model: the peak's growth between them over the model's growth is the
    host memory each model byte costs, free of the fixed costs (tracing, compiled programs)."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            for layers in (12, 24):
                folder = Path(tmp) / f"{dtype}-{layers}"
                disk = write_folder(folder, dtype, layers)
                for mesh in ("fsdp=8", "none"):
                    m = measure(folder, mesh)
                    model_bytes = disk * (2 if dtype == "bfloat16" else 1)  # imported as float32
                    extra = m["peak_rss"] - m["baseline_rss"]
                    rows.append(
                        dict(
                            checkpoint_dtype=dtype,
                            layers=layers,
                            files=len(list(folder.glob("*.safetensors"))),
                            checkpoint_bytes=disk,
                            mesh=mesh,
                            model_bytes_float32=model_bytes,
                            peak_above_baseline=extra,
                            peak_over_model=round(extra / model_bytes, 3),
                            final_over_model=round((m["final_rss"] - m["baseline_rss"]) / model_bytes, 3),
                        )
                    )
                shutil.rmtree(folder)
    marginal = []
    for dtype in ("float32", "bfloat16"):
        for mesh in ("fsdp=8", "none"):
            small, big = (r for r in rows if r["checkpoint_dtype"] == dtype and r["mesh"] == mesh)
            marginal.append(
                dict(
                    checkpoint_dtype=dtype,
                    mesh=mesh,
                    peak_growth_over_model_growth=round(
                        (big["peak_above_baseline"] - small["peak_above_baseline"])
                        / (big["model_bytes_float32"] - small["model_bytes_float32"]),
                        3,
                    ),
                )
            )
    print(json.dumps(dict(benchmark="convert_memory", config=CONFIG, rows=rows, marginal=marginal), indent=1))


if __name__ == "__main__":
    main()
