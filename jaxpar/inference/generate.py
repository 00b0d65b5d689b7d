"""Generation: a jitted prefill, a jitted decode step with the cache donated, and the loop between them.

    gen = Generator(model, mesh="decode_tp")              # weights resharded once onto the decode layout
    out = gen.generate([[1, 2, 3], [4, 5]], max_new_tokens=16, sampling=SamplingParams.make(2, top_p=0.9))
    out.tokens, out.time_to_first_token_s, out.decode_tokens_per_s

Shapes are fixed per call so nothing recompiles for a new prompt: the batch's prompts are right-padded
to a bucket (a power of two ≥ 16 positions), the cache has a bucketed number of slots (prompt bucket of
the longest prompt + max new tokens), and every sampling setting is an array. Each (batch, bucket,
slots) is compiled once, ahead of the timed run (``compile_s``), and kept.

Each row keeps its own positions (its prompt's length plus the tokens it generated), so prompts of
different lengths in one batch are exact. A row stops on one of the EOS ids, one of its stop ids (both
kept in its tokens, as Hugging Face does) or its max new tokens; the batch stops when every row has.
Finished rows still run (fixed shapes); their outputs are ignored. Generation never uses a training
storage order (zig-zag), remat, or capacity-limited MoE routing: ``for_generation`` turns them off.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.errors import ConfigError
from jaxpar.execution import ExecutionConfig
from jaxpar.inference.layouts import (
    InferenceLayout,
    build_inference_mesh,
    check_inference_layout,
    generation_execution,
    reshard,
    weight_layout,
)
from jaxpar.inference.sampling import SamplingParams, sample
from jaxpar.inference.unstack import is_unstacked, restack, unstack
from jaxpar.layers.kvcache import map_arrays
from jaxpar.model_api import LanguageModel
from jaxpar.models import build_model
from jaxpar.rules import trace_layout

MIN_BUCKET = 16


def bucket(n: int, /, minimum: int = MIN_BUCKET) -> int:
    """The smallest power of two ≥ max(n, minimum)."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def with_execution(model: LanguageModel, execution: ExecutionConfig, /) -> LanguageModel:
    """``model``'s weights (the same arrays) in a model that runs as ``execution`` says."""
    if is_unstacked(model):
        model = restack(model)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: build_model(model.cfg, execution=execution, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.state(model))


def for_generation(model: LanguageModel, *, sequence_split: bool = False) -> LanguageModel:
    """``model`` rebuilt to run as ``generation_execution`` says, its stacks unstacked into per-layer
    blocks (``jaxpar.inference.unstack``: each layer's weights copied out once; the other arrays shared,
    in variables of their own: placing the result leaves ``model`` where it is)."""
    return unstack(with_execution(model, generation_execution(model.execution, sequence_split=sequence_split)))


def check_request(cfg, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> None:
    """Refuses, from the config alone, what cannot be generated; names the field and the numbers."""
    if not prompts:
        raise ConfigError("prompts: none given")
    if len(max_new_tokens) != len(prompts):
        raise ConfigError(f"max_new_tokens: {len(max_new_tokens)} values for {len(prompts)} prompts")
    for i, (p, n) in enumerate(zip(prompts, max_new_tokens)):
        if len(p) == 0:
            raise ConfigError(f"prompt {i}: empty (a prompt needs at least one token)")
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ConfigError(
                f"prompt {i}: token id {bad[0]} is outside the vocabulary [0, model.vocab_size={cfg.vocab_size})"
            )
        if n < 1:
            raise ConfigError(f"max_new_tokens (--max-new-tokens) = {n} for prompt {i} must be ≥ 1")
        if len(p) + n > cfg.max_seq_len:
            raise ConfigError(
                f"prompt {i}: {len(p)} tokens + max_new_tokens (--max-new-tokens) {n} = {len(p) + n} "
                f"exceeds model.max_seq_len={cfg.max_seq_len}"
            )


def shapes(prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> tuple[int, int]:
    """(prompt bucket, cache slots) of a request: what it compiles for."""
    longest = max(map(len, prompts))
    return bucket(longest), bucket(longest + max(max_new_tokens))


def check_fit(cfg, mesh, name: str, prompts, max_new_tokens) -> InferenceLayout:
    """``check_request``, then the decode layout on ``mesh`` checked for this request's shapes (from the
    config alone: nothing loaded or compiled). Raises ``ConfigError`` / ``LayoutError``."""
    check_request(cfg, prompts, max_new_tokens)
    prompt, slots = shapes(prompts, max_new_tokens)
    return check_inference_layout(cfg, mesh, name, batch=len(prompts), prompt=prompt, slots=slots)


@dataclasses.dataclass
class GenerationResult:
    """One ``Generator.generate`` call. Times in seconds, measured after compilation."""

    tokens: list[list[int]]  # the generated tokens of each prompt (a final EOS/stop id included)
    finish_reasons: list[str]  # "eos", "stop" or "length" per prompt
    prefill_s: float  # the prefill call (all prompts, first tokens sampled)
    time_to_first_token_s: float  # from the call to the first tokens on the host
    decode_s: float  # every decode step after the first token
    decode_tokens_per_s: float  # tokens of unfinished rows generated per second of decode
    step_s: list[float]  # each decode step (inter-token latency)
    compile_s: float  # compilation this call needed (0 when every shape was seen)
    logits: list[np.ndarray] | None = None  # per prompt [generated, V] float32, when asked for

    def to_json(self) -> dict:
        keys = (
            "tokens",
            "finish_reasons",
            "prefill_s",
            "time_to_first_token_s",
            "decode_s",
            "decode_tokens_per_s",
            "compile_s",
        )
        out = {k: getattr(self, k) for k in keys}
        if self.step_s:
            out["inter_token_s_p50"], out["inter_token_s_p99"] = (
                float(np.percentile(self.step_s, q)) for q in (50, 99)
            )
        return out


def abstract_cache(model: LanguageModel, layout: InferenceLayout, batch: int, slots: int) -> dict:
    """The cache's shapes and dtypes ({stack: [each layer's cache]}), each placed by its logical names
    under ``layout``."""

    placed = lambda x, names: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=layout.sharding(names))
    cache = jax.eval_shape(lambda: model.empty_cache(batch, slots))
    return {name: [map_arrays(c, placed) for c in layers] for name, layers in cache.items()}


def compile_programs(
    model: LanguageModel, state, layout: InferenceLayout, batch: int, prompt: int, slots: int, *, draws: bool = False
):
    """(prefill, decode) of ``model`` compiled for ``layout`` from ``state``, a tree of
    ``jax.ShapeDtypeStruct`` with shardings (``model`` may be abstract: ``nnx.eval_shape``; nothing the
    size of the model is allocated). ``draws``: whether they can sample (``sample``; else greedy)."""
    pre, dec = lower_programs(model, state, layout, batch, prompt, slots, draws=draws)
    return pre.compile(), dec.compile()


def lower_programs(
    model: LanguageModel, state, layout: InferenceLayout, batch: int, prompt: int, slots: int, *, draws: bool = False
):
    """(prefill, decode) of ``model`` lowered for ``layout`` (``compile_programs``' arguments), not yet
    compiled. Decode donates its cache (argument 1): XLA writes each layer's new entries in place."""
    graphdef, mesh = nnx.graphdef(model), layout.mesh
    cache = abstract_cache(model, layout, batch, slots)
    cache_sh = jax.tree.map(lambda c: c.sharding, cache)
    rows = layout.sharding(("batch",))
    params_sh = jax.tree.map(lambda _: rows, SamplingParams.greedy(batch))

    def prefill(state, ids, lengths, params):
        with trace_layout(mesh, layout.prefill):
            model = nnx.merge(graphdef, state)
            logits, cache = model.prefill(ids, lengths, model.empty_cache(batch, slots))
        return sample(logits, params, lengths, draws=draws), logits, cache

    def decode(state, cache, tokens, positions, params):
        with trace_layout(mesh, layout.decode):
            logits, cache = nnx.merge(graphdef, state).decode(tokens[:, None], positions[:, None], cache)
        return sample(logits[:, 0], params, positions + 1, draws=draws), logits[:, 0], cache

    i32 = lambda *s: jax.ShapeDtypeStruct(
        s, jnp.int32, sharding=rows if len(s) == 1 else layout.sharding(("batch", None))
    )
    params = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), SamplingParams.greedy(batch), params_sh
    )
    out = (rows, rows, cache_sh)
    pre = jax.jit(prefill, out_shardings=out).lower(state, i32(batch, prompt), i32(batch), params)
    dec = jax.jit(decode, donate_argnums=(1,), out_shardings=out).lower(state, cache, i32(batch), i32(batch), params)
    return pre, dec


class Generator:
    """Generation from ``model`` on ``mesh`` (a decode layout name, a training preset, an axis spec; None:
    one device). The weights are moved onto the decode layout with one reshard."""

    def __init__(self, model: LanguageModel, mesh: str | None = None, *, devices=None, eos_ids: Sequence[int] = ()):
        if mesh is None:  # one device
            devices = list(jax.devices() if devices is None else devices)[:1]
        self.mesh_name, self.mesh = build_inference_mesh(mesh or "decode_dp", devices=devices)
        self.model = for_generation(model, sequence_split=self.mesh.shape["sequence"] > 1)
        self.cfg = self.model.cfg
        reshard(self.model, weight_layout(self.cfg, self.mesh, self.mesh_name))
        self.graphdef, self.state = nnx.split(self.model)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self._compiled: dict[tuple, Callable] = {}

    # ------------------------------------------------------------------------------------- programs
    def layout(self, batch: int, prompt: int, slots: int) -> InferenceLayout:
        return check_inference_layout(
            self.cfg,
            self.mesh,
            self.mesh_name,
            batch=batch,
            prompt=prompt,
            slots=slots,
            execution=self.model.execution,
        )

    def programs(self, batch: int, prompt: int, slots: int, draws: bool = False):
        """(prefill, decode) compiled for this shape, greedy or able to sample (compiled once, then kept)."""
        key = (batch, prompt, slots, draws)
        if key not in self._compiled:
            state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
            self._compiled[key] = compile_programs(
                self.model, state, self.layout(batch, prompt, slots), batch, prompt, slots, draws=draws
            )
        return self._compiled[key]

    # ------------------------------------------------------------------------------------ generation
    def check(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int]) -> None:
        """``check_request`` for this generator's model."""
        check_request(self.cfg, prompts, max_new_tokens)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        sampling: SamplingParams | None = None,
        stop_ids: Sequence[Sequence[int]] | None = None,
        return_logits: bool = False,
        on_tokens: Callable | None = None,
    ) -> GenerationResult:
        """Generates for every prompt (token id lists). ``on_tokens(step, tokens [B], done [B])`` is called
        with each new token of every row as soon as it is on the host (streaming)."""
        b = len(prompts)
        limit = [max_new_tokens] * b if isinstance(max_new_tokens, int) else [int(n) for n in max_new_tokens]
        self.check(prompts, limit)
        if stop_ids is not None and len(stop_ids) != b:
            raise ConfigError(f"stop_ids: {len(stop_ids)} lists for {b} prompts (one per prompt)")
        sampling = SamplingParams.greedy(b) if sampling is None else sampling
        if sampling.temperature.shape != (b,):
            raise ConfigError(f"sampling: made for a batch of {sampling.temperature.shape[0]}, given {b} prompts")
        stops = [frozenset(self.eos_ids)] * b if stop_ids is None else [self.eos_ids | set(s) for s in stop_ids]
        lengths = np.array([len(p) for p in prompts], np.int32)
        prompt, slots = shapes(prompts, limit)
        t0 = time.perf_counter()
        prefill, decode = self.programs(b, prompt, slots, sampling.draws)
        compile_s = time.perf_counter() - t0
        ids = np.zeros((b, prompt), np.int32)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p
        return self._run(prefill, decode, ids, lengths, limit, stops, sampling, return_logits, on_tokens, compile_s)

    def _run(self, prefill, decode, ids, lengths, limit, stops, sampling, return_logits, on_tokens, compile_s):
        """The loop. Each decode step is dispatched before the host looks at the tokens of the step before
        (it reads them on the device), so the device never waits for the host: a step is dispatched
        whenever some row may still need a token after the current one (one more than needed when every
        row ends on a stop token; its results are dropped). Each step's tokens start their copy to the
        host as soon as the step is dispatched, ahead of the step after it."""
        b = len(lengths)
        out, reasons, logits = [[] for _ in range(b)], [None] * b, [[] for _ in range(b)]
        start = time.perf_counter()
        token_dev, last, cache = prefill(self.state, ids, lengths, sampling)
        jax.block_until_ready(token_dev)
        prefill_s = time.perf_counter() - start
        token = np.asarray(token_dev)
        ttft = arrived = time.perf_counter()
        steps, positions, produced = [], lengths.copy(), 0
        while True:
            if any(r is None and len(o) + 1 < n for r, o, n in zip(reasons, out, limit)):
                ahead = decode(self.state, cache, token_dev, positions, sampling)
                ahead[0].copy_to_host_async()  # queued now, so it does not wait behind the next step
                positions = positions + 1
            done = np.array([r is not None for r in reasons])
            last_host = np.asarray(last) if return_logits else None
            for i in np.flatnonzero(~done):
                out[i].append(int(token[i]))
                if return_logits:
                    logits[i].append(last_host[i])
                reasons[i] = (
                    "eos"
                    if token[i] in self.eos_ids
                    else "stop"
                    if token[i] in stops[i]
                    else "length"
                    if len(out[i]) >= limit[i]
                    else None
                )
            if on_tokens is not None:
                on_tokens(len(steps), token, done)
            if all(r is not None for r in reasons):
                break
            token_dev, last, cache = ahead
            token = np.asarray(token_dev)
            now = time.perf_counter()
            steps.append(now - arrived)
            arrived = now
            produced += sum(r is None for r in reasons)
        decode_s = float(sum(steps))
        return GenerationResult(
            tokens=out,
            finish_reasons=reasons,
            prefill_s=prefill_s,
            time_to_first_token_s=ttft - start,
            decode_s=decode_s,
            decode_tokens_per_s=produced / decode_s if decode_s else 0.0,
            step_s=steps,
            compile_s=compile_s,
            logits=[np.stack(l) for l in logits] if return_logits else None,
        )
