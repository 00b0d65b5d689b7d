"""colab/09_serving.ipynb runs, and its paging, batching, prefix and preemption numbers hold."""

import math

import numpy as np
from notebooks import figures, run_tutorial

PAGE, MAX_LEN, BUDGET = 16, 4096, 40e9
PAGE_8B = 2 * 32 * 8 * 128 * 2 * PAGE  # K and V · layers · kv heads · head width · bf16 · positions


def test_serving_notebook():
    k = run_tutorial("09_serving")
    assert figures("09_serving") >= 3

    # 1. A budget holds budget / (max_length of pages) dense sequences, and as many requests as their
    #    own pages fit, in arrival order.
    assert k["bytes_per_page_8b"] == PAGE_8B
    assert k["dense_fit"] == math.floor(BUDGET / (MAX_LEN // PAGE * PAGE_8B)) == 74
    lengths = np.random.default_rng(0).integers(100, MAX_LEN + 1, 2000)
    pages = np.cumsum([math.ceil(n / PAGE) for n in lengths])
    assert k["paged_fit"] == int((pages <= BUDGET // PAGE_8B).sum())
    assert k["paged_fit"] > 1.8 * k["dense_fit"]  # the mean length is about half of 4096

    # 2. A 40-token system prompt is two full pages; the two later requests each find both.
    assert k["shared_pages"] == 40 // PAGE == 2 and k["prefix_hits"] == 2 * 2 and k["pages_left_used"] == 0

    # 3. Static batching takes the longest request of each batch of 4; continuous at least Σ/4 steps.
    want = k["want"]
    assert k["steps_static"] == sum(max(want[i : i + 4]) for i in range(0, 16, 4))
    assert math.ceil(sum(want) / 4) <= k["steps_continuous"] < k["steps_static"]
    assert k["same_tokens"] is True

    # 4. Eight prompts of 48 + (2 + i) tokens; seven find the three system pages.
    assert k["prefill_without"] == sum(48 + 2 + i for i in range(8))
    assert k["prefix_pages_found"] == 7 * 3
    assert k["prefill_with"] == k["prefill_without"] - 7 * 3 * PAGE

    # 5. Four sequences growing to 70 positions (5 pages each) in 12 pages: someone is preempted.
    assert k["preemptions"] >= 1 and k["peak_pages"] == 12
    assert k["equal_alone"] >= 3  # the margin rule, see the notebook's last note
