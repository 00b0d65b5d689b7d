# %% [markdown]
# # 09 · Serving: paged attention and continuous batching
#
# A server does not see one batch of prompts; it sees requests arrive, each with its own prompt and its
# own number of tokens to generate. Two ideas make an engine good at that. **Paged attention** keeps
# the KV cache in fixed-size pages handed out as sequences grow, as an operating system hands out
# memory pages, instead of reserving the longest possible sequence for every slot. **Continuous
# batching** lets a new request take a slot the moment another one finishes, instead of waiting for a
# whole batch to end. This notebook measures both with jaxpar's engine (`jaxpar.inference.engine`), on a
# tiny random model on the CPU, and reads the memory side from a real model's cache shapes.

# %%
from jaxpar.mesh import simulate_cpu_devices

simulate_cpu_devices(1)
import dataclasses

import matplotlib.pyplot as plt
import numpy as np
from flax import nnx

from jaxpar.inference.engine import Engine
from jaxpar.inference.placement import page_bytes
from jaxpar.inference.scheduler import Request
from jaxpar.models import ExecutionConfig, build_model, get_model_preset

tiny = build_model(get_model_preset("tiny"), rngs=nnx.Rngs(0))
key_numbers = {}

# %% [markdown]
# ## 1. Why pages: what a memory budget holds
#
# A dense cache gives every slot room for `max_length` positions, whatever the sequence really uses. A
# paged cache gives a sequence ⌈length / page⌉ pages. Below, Llama-3-8B's page size in bytes is read from
# its own page pools (`page_bytes`, computed on shapes only, bf16), and 40 GB of cache memory (what an
# 80 GB H100 has left after 16 GB of weights, with room to spare) is filled with requests whose
# lengths are drawn between 100 and 4,096 positions, in arrival order, both ways.

# %%
cfg8b = dataclasses.replace(get_model_preset("llama3-8b"), param_dtype="bfloat16")
bf16 = ExecutionConfig(dtype="bfloat16")  # computed (and cached) in bf16
abstract8b = nnx.eval_shape(lambda: build_model(cfg8b, execution=bf16, rngs=nnx.Rngs(0)))
PAGE, MAX_LEN, BUDGET = 16, 4096, 40e9
per_page = page_bytes(abstract8b, PAGE)
lengths = np.random.default_rng(0).integers(100, MAX_LEN + 1, 2000)
dense_fit = int(BUDGET // (MAX_LEN // PAGE * per_page))
pages_needed = np.cumsum(-(-lengths // PAGE))
paged_fit = int((pages_needed <= BUDGET // per_page).sum())
print(f"one page of {PAGE} positions: {per_page / 2**20:.1f} MiB in all 32 layers")
print(f"dense cache: {dense_fit} sequences of room for {MAX_LEN}; paged: {paged_fit} of these requests")
key_numbers.update(
    bytes_per_page_8b=per_page, dense_fit=dense_fit, paged_fit=paged_fit, mean_length=float(lengths[:paged_fit].mean())
)

# %% [markdown]
# The paged cache holds about MAX_LEN / mean length times as many sequences: the memory a dense cache
# reserves but never writes is the gap. A page is the unit of waste instead: at most one partly filled
# page per sequence.
#
# ## 2. Page tables, the null page and a shared prefix
#
# The engine keeps, for every sequence, a table of page ids; attention gathers those pages and runs
# the same masked attention as the dense cache (bit for bit: `tests/test_paged.py`). Page 0 is the
# **null page**: all zeros, and every unused table entry points at it. Full pages are named by a hash
# of all the tokens up to their end, so a request whose prompt begins like an earlier one **shares**
# those pages instead of computing them again. Three requests below share a 40-token system prompt
# (two full pages of 16); the first runs until its prompt is in the cache, then the other two arrive.


# %%
def small_engine(**kw):
    return Engine(tiny, **({"max_slots": 4, "page_size": 16, "max_length": 128, "chunk": 32} | kw))


system = list(range(100, 140))
engine = small_engine()
reqs = [Request(i, system + [i + 1] * (3 + 5 * i), max_new_tokens=20) for i in range(3)]
engine.submit(reqs[0])
while reqs[0].generated == 0:
    engine.step()
for r in reqs[1:]:
    engine.submit(r)
while min(r.generated for r in reqs) == 0:
    engine.step()
tables = np.stack([engine.pages.table(r.id, engine.width) for r in reqs])
shared = sorted(set(tables[0]) & set(tables[1]) & set(tables[2]) - {0})

fig, ax = plt.subplots(figsize=(7, 2.2))
colors = np.where(tables == 0, 0, np.where(np.isin(tables, shared), 2, 1))
ax.imshow(colors, cmap=plt.matplotlib.colors.ListedColormap(["#dddddd", "#9ecae1", "#fd8d3c"]), aspect="auto")
for (i, j), page in np.ndenumerate(tables):
    ax.text(j, i, str(page), ha="center", va="center", fontsize=9)
ax.set_yticks(range(3), [f"request {r.id} ({len(r.tokens)} tokens)" for r in reqs])
ax.set_xlabel("page of the sequence (16 positions each); number = physical page id")
ax.set_title("page tables: orange = shared prefix pages, grey = the null page 0")
plt.show()
print("shared pages", shared, "| prefix pages found:", engine.pages.hits, "of", engine.pages.lookups, "looked up")
while not engine.idle:
    engine.step()
key_numbers.update(shared_pages=len(shared), prefix_hits=engine.pages.hits, pages_left_used=engine.pages.used)

# %% [markdown]
# A prompt shares at most (length − 1) // 16 pages, so its last token is always computed (its logits
# start the generation) and a shared page is never written: every write lands in a page the writer
# alone holds. When the three finish, their named pages stay cached (evictable) for later prompts.
#
# ## 3. Continuous against static batching
#
# Sixteen requests wait at once for 4 slots, each wanting between 2 and 40 tokens. **Static batching**
# runs four together until the longest of them ends, then the next four. **Continuous batching** gives
# a freed slot to the next request in the next step. Every step, each running sequence makes one
# token (its prompt of 4 tokens takes one step, which also samples its first token).

# %%
want = np.random.default_rng(3).integers(2, 41, 16).tolist()


def run(static: bool):
    engine = small_engine(token_budget=4 * 32)
    todo = [Request(i, [7, 8, 9, i], max_new_tokens=n) for i, n in enumerate(want)]
    done, timeline = list(todo), []
    while todo or not engine.idle:
        if not static or engine.idle:
            for r in todo[: 4 if static else None]:
                engine.submit(r)
            todo = todo[4:] if static else []
        engine.step()
        row = [-1] * 4
        for r in engine.scheduler.running:
            row[r.slot] = r.id
        timeline.append(row)
    return np.array(timeline), {r.id: r.tokens for r in done}


timelines, outputs = {}, {}
for name in ("static", "continuous"):
    timelines[name], outputs[name] = run(name == "static")
fig, axes = plt.subplots(2, 1, figsize=(9, 3.6), sharex=True)
for ax, (name, t) in zip(axes, timelines.items()):
    ax.imshow(np.ma.masked_less(t.T, 0), cmap="tab20", aspect="auto", interpolation="nearest")
    ax.set_ylabel("slot")
    ax.set_title(f"{name}: {len(t)} steps for {sum(want)} tokens ({sum(want) / len(t):.2f} tokens per step)")
axes[-1].set_xlabel("step (colour = request)")
plt.tight_layout()
plt.show()
key_numbers.update(
    want=want,
    steps_static=len(timelines["static"]),
    steps_continuous=len(timelines["continuous"]),
    same_tokens=outputs["static"] == outputs["continuous"],
)
print(
    key_numbers["steps_static"],
    "steps static,",
    key_numbers["steps_continuous"],
    "continuous; same tokens:",
    key_numbers["same_tokens"],
)

# %% [markdown]
# The white holes in the static timeline are slots idle while a batch waits for its longest request.
# The tokens are identical: each request computes in the same shapes whatever else runs (one decode
# call of [slots, 1] and one call per prompt-chunk size per step), so batching changes when a request
# runs, never what it computes.
#
# ## 4. What the prefix cache saves
#
# Eight requests share a 48-token system prompt (three full pages), each with its own question. With
# the prefix cache the first computes the system prompt and the other seven find its pages; without it,
# each computes it again.


# %%
def prefix_run(cached: bool):
    engine = small_engine(prefix_cache=cached)
    rs = [Request(i, list(range(50, 98)) + [i + 1] * (2 + i), max_new_tokens=4) for i in range(8)]
    engine.submit(rs[0])
    while rs[0].generated == 0:
        engine.step()
    engine.run(rs[1:])
    return engine.totals.prefilled, engine.pages.hits


(with_cache, hits), (without_cache, _) = prefix_run(True), prefix_run(False)
print(f"prompt tokens computed: {without_cache} without the prefix cache, {with_cache} with it ({hits} pages found)")
key_numbers.update(prefill_without=without_cache, prefill_with=with_cache, prefix_pages_found=hits)

# %% [markdown]
# ## 5. Preemption when the pages run out
#
# Now the pool is too small: 12 usable pages of 16 positions, and four requests of 20 prompt tokens that
# each grow to 70 positions (5 pages). When a running sequence needs a page and none is free, the
# engine **preempts** the youngest sequence: its pages go back, and it returns to the head of the queue
# to be recomputed later (its prompt and the tokens it made become its new prompt).

# %%
engine = small_engine(num_pages=13, record_logits=True)
rs = [Request(i, list(range(i, i + 20)), max_new_tokens=50) for i in range(4)]
for r in rs:
    engine.submit(r)
used, events = [], []
while not engine.idle:
    engine.step()
    used.append(engine.pages.used)
    events.append(engine.log[-1].preempted)
fig, ax = plt.subplots(figsize=(8, 2.6))
ax.plot(used, label="pages in use")
ax.axhline(12, color="grey", ls="--", label="usable pages")
for s in np.flatnonzero(events):
    ax.axvline(s, color="tab:red", alpha=0.5)
ax.set_xlabel("step (red: a preemption)")
ax.legend(loc="lower right")
plt.show()
alone = []
for r in rs:
    single = Request(r.id, r.prompt, 50)
    small_engine().run([single])
    alone.append(single.tokens == r.tokens)
print("preemptions:", sum(r.preemptions for r in rs), "| requests equal to running alone:", sum(alone), "of 4")
key_numbers.update(preemptions=sum(r.preemptions for r in rs), peak_pages=max(used), equal_alone=sum(alone))
key_numbers

# %% [markdown]
# A preempted request's recomputation runs its tokens through prompt chunks rather than one decode step
# at a time, so its later logits can differ in the last bits from running alone; the engine's tests
# compare such requests under the margin rule (`tests/test_engine.py`). The server built on this engine,
# `jaxpar serve`, adds the OpenAI API, replicas and metrics: see docs/serving.md, and
# `benchmarks/serve.py` for the same comparisons under a Poisson load in wall time.
