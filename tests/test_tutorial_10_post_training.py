"""colab/10_post_training.ipynb runs, and what it shows holds: SFT teaches about half of the reversals;
DPO on adapters starts at log 2 (the adapters-off reference is the policy then) and grows the margin
while the chosen answers lose probability too; GRPO runs its rollouts in the training process; the
notebook shows its curves."""

import math

import pytest
from notebooks import figures, run_tutorial


@pytest.fixture(scope="module")
def k():
    return run_tutorial("10_post_training")


def test_figures(k):
    assert figures("10_post_training") >= 2


def test_dpo_starts_at_log_2_and_moves_the_margin(k):
    assert abs(k["dpo_first_loss"] - math.log(2)) <= 1e-6  # each pair's loss is log 2; their mean rounds
    assert k["dpo_last_margin"] > 0


def test_sft_learns_part_of_the_task_and_dpo_displaces_it(k):
    assert 0.3 <= k["sft_accuracy"] <= 0.9
    assert k["dpo_accuracy"] < k["sft_accuracy"]  # likelihood displacement, as the notebook says


def test_grpo_runs_its_rollouts_in_process(k):
    assert 0 < k["rollout_share"] < 1
    assert 0 <= k["grpo_first_reward"] <= 1 and 0 <= k["grpo_last_reward"] <= 1
