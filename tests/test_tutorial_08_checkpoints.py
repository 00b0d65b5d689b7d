"""colab/08_checkpoints.ipynb runs: HF import, fine-tune with an interruption, HF export, generate."""

import math

from notebooks import figures, run_tutorial


def test_checkpoints_notebook():
    k = run_tutorial("08_checkpoints")
    assert figures("08_checkpoints") >= 1
    # A random model starts near ln V; the grammar's sentences are learnable: well below it after 70 steps,
    # on held-out text too.
    assert abs(k["first_loss"] - math.log(k["vocab_size"])) < 0.3
    assert k["last_loss"] < 1.5 and k["eval_loss"] < 1.5
    # Stopped after step 50 with checkpoints every 20: resumed from 40, and 41-50 repeated bit for bit.
    assert (k["stopped_at"], k["resumed_from"], k["identical_after_resume"]) == (50, 40, True)
    assert k["max_logit_diff"] < 1e-4  # transformers on the export vs jaxpar, float32
    # Greedy continuations of "the old fox" and "my sister paints" follow the grammar the text was made
    # from (subject verb object.): a verb comes next, then an object.
    fox, sister = k["generated"]
    assert fox.split()[0] in ("sees", "follows", "likes", "paints", "finds", "calls"), fox
    assert sister.lstrip().startswith(
        ("the river", "a red ball", "the garden", "an open door", "the moon", "a quiet town")
    ), sister
