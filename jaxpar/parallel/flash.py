"""Pallas splash attention (``execution.attention_impl=splash``): the TPU's flash kernel, behind the
layout of every other attention here (q [B, T, N, H], k/v [B, S, K, H]).

Scores live in VMEM one (block_q × block_kv) tile at a time and never reach HBM; tiles the mask
leaves empty are skipped. What it covers, and how:

    causal             ``CausalMask``
    sliding window w   ``LocalMask`` with (w − 1, 0): the key itself and the w − 1 before it
    GQA / MQA          ``make_splash_mqa`` per kv head: its G = N / K query heads read the one K/V,
                       which is never repeated in HBM (vmapped over kv heads and the batch)
    segments           ``SegmentIds``: a query sees only keys of its own segment (packed documents)
    MLA                q/k of width Hq, v of width Hv: the narrower side is zero-padded to the wider
                       (zero columns add nothing to a score or an output) and the output sliced back
    any length         T is padded to a multiple of the block, the padding in a segment of its own

The 1 / sqrt(Hq) scale is applied to q before the kernel (splash computes q·k as is).

Block sizes (``block_size``): the largest of 512, 256, 128 that divides the padded length, for every
block of the forward and backward kernels. 128 is the TPU's lane width, the smallest tile the kernel
runs; 512 is MaxText's default for long sequences, where the grid's per-step overhead is paid least.

On a TPU the kernel is compiled by Mosaic. On CPU it runs in Pallas' interpret mode: the same kernel
body as an XLA loop over its grid, exact but slow, for tests and simulated-device tutorials. On a GPU it
cannot run, and ``check_kernel`` refuses it by name before any work.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

from jaxpar.errors import ConfigError
from jaxpar.execution import AttentionImpl

LANE = 128  # the smallest block: the TPU's lane width
BLOCKS = (512, 256, 128)
PAD_SEGMENT = -1  # the segment id of the padding (real tokens' ids are ≥ 0)


_FOR_TPU = contextvars.ContextVar("jaxpar_flash_for_tpu", default=False)


@contextlib.contextmanager
def lowered_for_tpu():
    """Inside: the kernels lower for a TPU (Mosaic) whatever the local backend, for exporting a TPU
    program from a host without one (``jax.export.export(f, platforms=["tpu"])``)."""
    token = _FOR_TPU.set(True)
    try:
        yield
    finally:
        _FOR_TPU.reset(token)


def block_size(length: int, /) -> int:
    """The block of every splash kernel for a (padded) length: the largest of ``BLOCKS`` dividing it."""
    return next(b for b in BLOCKS if length % b == 0)


def check_kernel(impl, platform: str, /, context_parallel="none", *, field: str = "execution.attention_impl") -> None:
    """Refuses an attention kernel the platform (jax's name: cpu, gpu, tpu) cannot run, or one the
    context-parallel strategy does not carry (the ring's blocks are XLA's), naming the fields. On CPU
    both run: splash interpreted, cuDNN as the lab compiles it (XLA's attention, priced as cuDNN's)."""
    kernel = None if impl is None else AttentionImpl.parse(str(impl), field=field)
    if kernel == AttentionImpl.CUDNN and platform == "tpu":
        raise ConfigError(f"{field}=cudnn: cuDNN runs on NVIDIA GPUs; on TPUs use {field}=splash (flash) or xla")
    if kernel != AttentionImpl.SPLASH:
        return
    if platform == "gpu":
        raise ConfigError(f"{field}=splash: a TPU kernel (Pallas/Mosaic); on GPUs use {field}=cudnn (flash) or xla")
    if str(context_parallel) == "ring":
        raise ConfigError(
            f"{field}=splash with execution.context_parallel=ring: the ring's blocks run XLA's attention; "
            "Ulysses (execution.context_parallel=ulysses) runs splash on its gathered heads"
        )


@functools.lru_cache(maxsize=64)
def _kernel(length: int, group: int, causal: bool, window: int | None, interpret: bool):
    shape = (length, length)
    if window is not None:
        mask = sm.LocalMask(shape, (window - 1, 0 if causal else None), 0)
    else:
        mask = sm.CausalMask(shape) if causal else sm.FullMask(shape)
    b = block_size(length)
    blocks = sk.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    with jax.ensure_compile_time_eval():  # the mask's block tables: constants, not tracers of one trace
        return sk.make_splash_mqa(
            sm.MultiHeadMask([mask] * group), block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
        )


def _pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def splash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    /,
    *,
    causal: bool = True,
    window: int | None = None,
    segments: jax.Array | None = None,
    scale: float | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Attention of q [B, T, N, Hq] over k [B, T, K, Hq], v [B, T, K, Hv] (N a multiple of K) with the
    splash kernel; ``segments`` int [B, T] (≥ 0; None: one segment). Returns [B, T, N, Hv] in q's
    dtype. ``interpret``: Pallas' interpret mode (default: unless the backend is a TPU or the call is
    inside ``lowered_for_tpu``)."""
    batch, length, n, hq = q.shape
    kv_heads, hv = k.shape[2], v.shape[3]
    if k.shape[1] != length:
        raise ConfigError(
            f"splash attention: {length} queries over {k.shape[1]} keys (it attends a sequence to itself)"
        )
    if interpret is None:
        interpret = not _FOR_TPU.get() and jax.default_backend() != "tpu"
    group, width = n // kv_heads, max(hq, hv)
    padded = -(-length // LANE) * LANE
    if segments is None:
        segments = jnp.zeros((batch, length), jnp.int32)
    segments = _pad_axis(segments.astype(jnp.int32), 1, padded, PAD_SEGMENT)
    q = q * jnp.asarray(hq**-0.5 if scale is None else scale, q.dtype)
    q, k, v = (_pad_axis(_pad_axis(x, 3, width), 1, padded) for x in (q, k, v))
    q = q.reshape(batch, padded, kv_heads, group, width).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, T, H]
    kernel = _kernel(padded, group, causal, window, interpret)

    def one(q, k, v, seg):  # q [G, T, H], k/v [T, H], seg [T]: one kv head of one sequence
        return kernel(q, k, v, segment_ids=sk.SegmentIds(q=seg, kv=seg))

    out = jax.vmap(jax.vmap(one, (0, 0, 0, None)))(q, k, v, segments)  # [B, K, G, T, H]
    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, padded, n, width)
    return out[:, :length, :, :hv]
