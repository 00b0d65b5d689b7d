"""Models are born sharded: the init program's per-device output is the device's shard of params and
AdamW moments, and its scratch memory stays well below one full copy of the parameters.

Compiled for llama-100m on 8 simulated devices; nothing is allocated (``lower().compile()`` only).
"""

import functools

import pytest

from jaxpar.layout import make_layout
from jaxpar.meshes import get_mesh_preset
from jaxpar.models import build_model, get_model_preset
from jaxpar.train.optim import OptimizerConfig, make_optimizer
from jaxpar.train.step import init_program

CFG = get_model_preset("llama-100m")
P = CFG.num_params(padded=True)


def _memory(preset):
    layout = make_layout(CFG, get_mesh_preset(preset), batch=8, seq=64)
    make_tx = functools.partial(make_optimizer, OptimizerConfig())
    program = init_program(lambda rngs: build_model(CFG, rngs=rngs), make_tx, layout)
    with layout.activate():
        return program.create.lower().compile().memory_analysis()


@pytest.mark.parametrize("preset, ways", [("fsdp", 8), ("3d", 4)])
def test_init_writes_only_the_local_shard(preset, ways):
    mem = _memory(preset)
    # params + two fp32 moments (12 bytes per parameter), split `ways` ways; the replicated norm
    # scales and step counter add a little
    assert mem.output_size_in_bytes == pytest.approx(12 * P / ways, rel=0.01)
    # Scratch: an init that built the model whole and then sliced it would need at least one full
    # fp32 copy (4·P bytes); a sharded one needs about a local shard's worth of random bits.
    assert mem.temp_size_in_bytes < 4 * P / 2
    assert mem.temp_size_in_bytes <= mem.output_size_in_bytes
