"""The layout lab for serving: what a decode layout holds and moves per device, and the prefill and
decode times it predicts on named hardware.

    jaxpar plan --inference --model llama3-70b --mesh decode_tp --devices 8 --batch 32 --context 8192 --hardware h100

The prefill and decode programs of ``jaxpar.inference.generate`` (the greedy ones: a sampling program
adds a per-row sort of the vocabulary) are compiled ahead of time for the layout on simulated CPU devices
from abstract weights (nothing the size of the model is allocated), and read as the training lab reads
its step:

* **Held per device** (exact, from the shardings the programs take): the weights (bf16 by default, as
  served; ``--set model.param_dtype=float32`` to price f32), and the KV cache of
  ``batch`` sequences of ``context`` positions. KV bytes per token = the cache's bytes ÷ (batch ×
  positions) for the whole model and per device. The largest batch that fits at ``context``: what HBM
  has left after the weights, over one sequence's cache per device, times the ways the batch is split.
* **Moved per decode step** (from the compiled decode program): each collective's bytes per axis
  group, counted at the compute dtype's width (XLA:CPU runs bf16 collectives in f32, as in training).
* **Prefill** (compute-bound): forward FLOPs per device — 2 per weight per token plus causal attention
  (``flops_per_token`` ÷ 3: the training figure counts forward and backward), the LM head at each
  sequence's last position only — at ``efficiency`` × peak,
  plus its collectives over their links, exposed. Time to first token = the prefill of the batch.
* **Decode step** (memory-bound): every weight on the device and the whole cache it attends over (all
  ``context`` positions of its rows) read once from HBM, or the step's FLOPs at ``efficiency`` × peak if
  that is longer, plus the step's collectives over their links, exposed (each sits between dependent
  matmuls), plus their latency. Tokens/s = batch ÷ step.
* **Collective latency** (``links.latency_by_axis``): a decode step's many small all-reduces cost
  microseconds each beyond their bytes. Each collective the compiled program runs costs the chip's
  ``collective_base`` plus a hop per ring step (NCCL's cost model on GPUs, 15 µs for an all-reduce over 8
  NVLink GPUs; 1 µs an ICI hop on TPUs), in prefill and decode alike.

Not modelled: the KV cache's growth during generation (the step is priced at the full context), kernel
launch overheads, and overlap of anything with anything.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from jaxpar.analysis.calibration import CALIBRATED
from jaxpar.analysis.costmodel import measured_bytes
from jaxpar.analysis.hardware import get_hardware
from jaxpar.analysis.hlo import analyze_compiled
from jaxpar.analysis.links import latency_by_axis
from jaxpar.analysis.plan import cpu_compilable, plan_execution
from jaxpar.analysis.prediction import link_of, link_seconds
from jaxpar.errors import JaxparError
from jaxpar.inference.generate import abstract_cache, compile_programs
from jaxpar.inference.layouts import build_inference_mesh, check_inference_layout, generation_execution
from jaxpar.inference.unstack import unstack
from jaxpar.model_api import LanguageModel
from jaxpar.models import build_model, get_model_preset
from jaxpar.parallel.flash import check_kernel


@dataclasses.dataclass(frozen=True)
class InferencePlan:
    model: str
    mesh: dict
    batch: int
    context: int
    hardware: str
    weight_bytes_per_device: float
    kv_bytes_per_token: float  # every layer, the whole model
    kv_bytes_per_token_per_device: float
    kv_bytes_per_device: float  # batch × context positions
    fits: bool
    max_batch: int  # at ``context``, weights + KV within HBM
    prefill_flops_per_device: float
    prefill_s: float
    prefill_bytes_by_axis: dict
    decode_bytes_read_per_device: float
    decode_flops_per_device: float
    decode_bytes_by_axis: dict
    decode_times: dict
    decode_step_s: float
    tokens_per_s: float
    time_to_first_token_s: float
    link_by_axis: dict
    assumptions: dict

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _per_device(tree) -> float:
    """Bytes one device holds of a tree of ``jax.ShapeDtypeStruct`` with shardings (the largest shard)."""
    return float(sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _abstract(cfg, execution, layout) -> tuple[LanguageModel, object]:
    """The model (abstract, unstacked as generation runs it) and its state as ``ShapeDtypeStruct`` placed
    on ``layout``'s decode rules."""
    model = unstack(nnx.eval_shape(lambda: build_model(cfg, execution=execution, rngs=nnx.Rngs(0))))
    with layout.phase("decode").activate():
        state = nnx.state(model)
        shardings = nnx.get_named_sharding(state, layout.mesh)
    return model, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def plan_inference(
    model: str,
    mesh: str,
    *,
    batch: int,
    context: int,
    hardware: str,
    devices: int | None = None,
    efficiency: float | None = None,
    execution: Mapping[str, Any] | None = None,
    **model_overrides,
) -> InferencePlan:
    """Compile and read ``model``'s prefill and decode under ``mesh`` (module doc) and predict them;
    ``efficiency`` defaults to the chip family's calibrated matmul share (``calibration.CALIBRATED``).
    The model: its preset with bfloat16 parameters and ``model_overrides``, run as generation runs
    ``plan_execution(model, execution)`` (``generation_execution``)."""
    hw = get_hardware(hardware)
    efficiency = CALIBRATED.matmul[hw.family] if efficiency is None else efficiency
    cfg = get_model_preset(model, **({"param_dtype": "bfloat16"} | model_overrides))
    name, built = build_inference_mesh(mesh, devices=None if devices is None else jax.devices()[:devices])
    run = generation_execution(plan_execution(model, execution), sequence_split=built.shape["sequence"] > 1)
    check_kernel(run.attention_impl, hw.platform, run.context_parallel)  # a kernel the chip cannot run
    layout = check_inference_layout(cfg, built, name, batch=batch, prompt=context, slots=context, execution=run)
    abstract, state = _abstract(cfg, cpu_compilable(run), layout)
    prefill, decode = compile_programs(abstract, state, layout, batch, context, context)
    shape = {a: int(n) for a, n in built.shape.items()}
    scale = jax.numpy.dtype(run.dtype).itemsize / 4  # XLA:CPU's f32 collectives at bf16 width
    pre_ops, dec_ops = analyze_compiled(prefill, mesh=built).ops, analyze_compiled(decode, mesh=built).ops
    pre_bytes = measured_bytes(pre_ops, activation_scale=scale)
    dec_bytes = measured_bytes(dec_ops, activation_scale=scale)
    latency = (latency_by_axis(pre_ops, shape, hw), latency_by_axis(dec_ops, shape, hw))
    cache = abstract_cache(abstract, layout, batch, context)
    weights, kv_device = _per_device(state), _per_device(cache)
    kv_total = float(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))
    leaf = jax.tree.leaves(cache)[0]  # one layer's [batch, positions, ...]
    rows_per_device = leaf.sharding.shard_shape(leaf.shape)[0]
    per_sequence = kv_device / rows_per_device
    room = hw.hbm_bytes - weights
    max_batch = int(room // per_sequence) * (batch // rows_per_device) if room > 0 else 0
    return _predict(
        model,
        shape,
        batch,
        context,
        hw,
        cfg,
        weights,
        kv_total,
        kv_device,
        max_batch,
        pre_bytes,
        dec_bytes,
        latency,
        efficiency,
        dict(compute_dtype=run.dtype, param_dtype=cfg.param_dtype, layout=name),
    )


def _predict(
    model,
    shape,
    batch,
    context,
    hw,
    cfg,
    weights,
    kv_total,
    kv_device,
    max_batch,
    pre_bytes,
    dec_bytes,
    latency,
    efficiency,
    described: dict,
) -> InferencePlan:
    prefill_flops, prefill_s = _prefill(cfg, shape, batch, context, hw, efficiency, pre_bytes, latency[0])
    read = weights + kv_device
    decode_flops, times, step = _decode(cfg, shape, batch, context, hw, efficiency, read, dec_bytes, latency[1])
    return InferencePlan(
        model=model,
        mesh={a: n for a, n in shape.items() if n > 1},
        batch=batch,
        context=context,
        hardware=hw.name,
        weight_bytes_per_device=weights,
        kv_bytes_per_token=kv_total / (batch * context),
        kv_bytes_per_token_per_device=kv_device / (batch * context),
        kv_bytes_per_device=kv_device,
        fits=weights + kv_device <= hw.hbm_bytes,
        max_batch=max_batch,
        prefill_flops_per_device=prefill_flops,
        prefill_s=prefill_s,
        prefill_bytes_by_axis=pre_bytes,
        decode_bytes_read_per_device=read,
        decode_flops_per_device=decode_flops,
        decode_bytes_by_axis=dec_bytes,
        decode_times=times,
        decode_step_s=step,
        tokens_per_s=batch / step,
        time_to_first_token_s=prefill_s,
        link_by_axis={k: link_of(k, shape, hw)[0] for k in {**pre_bytes, **dec_bytes}},
        assumptions=dict(efficiency=efficiency, **described),
    )


def _prefill(cfg, shape: dict, batch: int, context: int, hw, efficiency: float, measured: dict, latency: dict):
    """(FLOPs per device, seconds) of the prefill of ``batch`` prompts of ``context`` tokens: its compute
    at ``efficiency`` × peak, its collectives' bytes (``measured``) over their links, and their latency."""
    devices = math.prod(shape.values())
    head = 2.0 * cfg.padded_vocab * cfg.embed_dim  # the LM head runs at each row's last position only
    forward = cfg.flops_per_token(context) / 3 - head  # per prompt token, causal attention halved
    flops = (forward * context + head) * batch / devices
    seconds = (
        flops / (hw.peak_bf16_flops * efficiency)
        + sum(link_seconds(measured, shape, hw).values())
        + sum(latency.values())
    )
    return flops, seconds


def _decode(cfg, shape: dict, batch: int, context: int, hw, efficiency: float, read: float, measured, latency):
    """(FLOPs per device, times, seconds) of one decode step that reads ``read`` bytes per device: the
    slower of its memory and compute time, plus its collectives' bytes (``measured``) over their links
    and their latency."""
    devices = math.prod(shape.values())
    flops = cfg.flops_per_token(2 * context) / 3 * batch / devices  # attention over all context positions
    times = dict(
        memory_s=read / hw.hbm_bandwidth,
        compute_s=flops / (hw.peak_bf16_flops * efficiency),
        communication_s=link_seconds(measured, shape, hw),
        latency_s=latency,
    )
    step = (
        max(times["memory_s"], times["compute_s"])
        + sum(times["communication_s"].values())
        + sum(times["latency_s"].values())
    )
    return flops, times, step


def format_inference_plan(p: InferencePlan) -> str:
    gb = 1e9
    mesh = ",".join(f"{a}={n}" for a, n in p.mesh.items()) or "one device"
    lines = [
        f"{p.model} serving on {mesh} ({p.hardware}), batch {p.batch} × context {p.context}",
        f"per device: weights {p.weight_bytes_per_device / gb:.2f} GB, KV cache {p.kv_bytes_per_device / gb:.2f} GB "
        f"({'fits' if p.fits else 'DOES NOT FIT'}); largest batch at this context: {p.max_batch}",
        f"KV per token: {p.kv_bytes_per_token / 1e3:.1f} kB (model), {p.kv_bytes_per_token_per_device / 1e3:.1f} kB "
        f"per device; {65536 * p.kv_bytes_per_token_per_device / gb:.2f} GB per device per 65k tokens",
        "",
        f"{'axis group':<22}{'link':<6}{'prefill MB':>12}{'decode MB/step':>16}",
    ]
    for key in sorted(p.link_by_axis):
        lines.append(
            f"{key:<22}{p.link_by_axis[key]:<6}{p.prefill_bytes_by_axis.get(key, 0) / 1e6:>12.2f}"
            f"{p.decode_bytes_by_axis.get(key, 0) / 1e6:>16.3f}"
        )
    t = p.decode_times
    lines += [
        "",
        f"prefill {p.prefill_s * 1e3:.1f} ms ({p.prefill_flops_per_device:.3e} FLOPs per device at "
        f"{p.assumptions['efficiency']} of peak): time to first token",
        f"decode step {p.decode_step_s * 1e3:.2f} ms = max(HBM {t['memory_s'] * 1e3:.2f} ms for "
        f"{p.decode_bytes_read_per_device / gb:.2f} GB, compute {t['compute_s'] * 1e3:.2f} ms) + collectives "
        f"{sum(t['communication_s'].values()) * 1e3:.2f} ms + their latency "
        f"{sum(t['latency_s'].values()) * 1e3:.2f} ms: {p.tokens_per_s:,.0f} tokens/s "
        f"({p.tokens_per_s / p.batch:,.1f} per sequence)",
    ]
    return "\n".join(lines)


def search_inference(
    model: str,
    devices: int,
    *,
    batch: int,
    context: int,
    hardware: str,
    max_step_s: float | None = None,
    efficiency: float | None = None,
    execution: Mapping[str, Any] | None = None,
    **model_overrides,
):
    """Every split of ``devices`` over data × tensor (× expert for a MoE model), each compiled and read
    by ``plan_inference``. Returns (ranked plans, refused (mesh, reason) pairs): first the layouts that fit
    and meet ``max_step_s`` (the decode step, i.e. the inter-token latency), by tokens/s, best first; then
    the others, by tokens/s."""
    moe = get_model_preset(model).moe is not None
    plans, refused = [], []
    for tensor in [t for t in range(1, devices + 1) if devices % t == 0]:
        rest = devices // tensor
        for expert in [e for e in range(1, rest + 1) if rest % e == 0] if moe else [1]:
            spec = f"data={rest // expert},expert={expert},tensor={tensor}"
            try:
                plans.append(
                    plan_inference(
                        model,
                        spec,
                        batch=batch,
                        context=context,
                        hardware=hardware,
                        devices=devices,
                        efficiency=efficiency,
                        execution=execution,
                        **model_overrides,
                    )
                )
            except JaxparError as err:
                refused.append((spec, str(err)))
    ok = lambda p: p.fits and (max_step_s is None or p.decode_step_s <= max_step_s)
    return sorted(plans, key=lambda p: (not ok(p), -p.tokens_per_s)), refused


def format_search(ranked, refused, *, max_step_s: float | None) -> str:
    bound = f", decode step ≤ {max_step_s * 1e3:g} ms" if max_step_s else ""
    lines = [
        f"{len(ranked)} serving layouts ({len(refused)} cannot divide the model); fitting{bound} first, "
        f"most tokens/s first",
        f"{'rank':>4}  {'mesh':<28}{'weights GB':>11}{'KV GB':>8}{'fits':>6}{'step ms':>9}{'TTFT ms':>10}"
        f"{'tokens/s':>11}{'max batch':>10}",
    ]
    for i, p in enumerate(ranked, 1):
        mesh = ",".join(f"{a}={n}" for a, n in p.mesh.items()) or "one device"
        meets = max_step_s is None or p.decode_step_s <= max_step_s
        lines.append(
            f"{i:>4}  {mesh:<28}{p.weight_bytes_per_device / 1e9:>11.2f}{p.kv_bytes_per_device / 1e9:>8.2f}"
            f"{'yes' if p.fits else 'no':>6}{p.decode_step_s * 1e3:>9.2f}{p.time_to_first_token_s * 1e3:>10.1f}"
            f"{p.tokens_per_s:>11,.0f}{p.max_batch:>10}{'' if meets else '  (too slow)'}"
        )
    lines += [f"refused {m}: {r}" for m, r in refused]
    return "\n".join(lines)


def plot_search(ranked, path: str, *, title: str) -> None:
    """Tokens/s and decode step of each ranked layout, side by side (saved to ``path``)."""
    import matplotlib  # deferred: matplotlib is the optional `plot` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the Agg backend

    labels = [",".join(f"{a[0]}{n}" for a, n in p.mesh.items()) or "1" for p in ranked]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, len(ranked) * 0.9), 4))
    left.bar(labels, [p.tokens_per_s for p in ranked], color=["tab:green" if p.fits else "tab:red" for p in ranked])
    left.set_ylabel("decode tokens/s (all sequences)")
    right.bar(labels, [p.decode_step_s * 1e3 for p in ranked])
    right.set_ylabel("decode step (ms)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
