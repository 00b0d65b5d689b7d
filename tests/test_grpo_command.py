"""``jaxpar grpo`` (jaxpar.rl.command): a run stopped after two iterations and run again continues as an
uninterrupted run does (the same rewards and losses, and the same final weights, bit for bit); what a
user can get wrong (the reward, the prompts, the settings, another run's folder) is refused by name
before anything is written."""

import json

import numpy as np
import pytest

from jaxpar.checkpoint import latest
from jaxpar.cli import main

REWARD = """def digits(prompt, completion):
    return sum(48 <= t <= 57 for t in completion) / max(len(completion), 1)
"""
SETS = ["grpo.prompts=4", "grpo.group_size=2", "grpo.max_new_tokens=4", "optimizer.learning_rate=3e-3"]
TIMES = ("sync_s", "rollout_s", "update_s", "rollout_tokens_per_s")


def _files(tmp_path, lines=None):
    (tmp_path / "rewards.py").write_text(REWARD)
    rng = np.random.default_rng(0)
    lines = lines or [json.dumps({"prompt_ids": list(f"{a}+{b}=".encode())}) for a, b in rng.integers(10, 50, (8, 2))]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")


def _args(tmp_path, out: str, *extra: str) -> list[str]:
    args = ["grpo", "--prompts", str(tmp_path / "prompts.jsonl"), "--reward", f"{tmp_path / 'rewards.py'}:digits"]
    args += ["--out", str(tmp_path / out), "--model", "tiny", "--iterations", "3", "--save-every", "1"]
    args += ["--stop-ids", "255", *extra]
    return args + [x for s in SETS for x in ("--set", s)]


def _records(folder) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMES} for line in lines]


def _weights(folder) -> list[np.ndarray]:
    import jax
    import orbax.checkpoint as ocp

    step = latest(folder / "checkpoints").step
    with ocp.CheckpointManager(folder / "checkpoints", item_names=("state",)) as manager:
        state = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
    return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_a_stopped_run_resumes_as_an_uninterrupted_one(tmp_path, capsys):
    _files(tmp_path)
    assert main(_args(tmp_path, "whole")) == 0
    assert main(_args(tmp_path, "split", "--stop-after", "2")) == 0
    assert [r["iteration"] for r in _records(tmp_path / "split")] == [1, 2]
    assert main(_args(tmp_path, "split")) == 0
    whole, split = _records(tmp_path / "whole"), _records(tmp_path / "split")
    assert [r["iteration"] for r in whole] == [1, 2, 3] and split == whole
    assert all(np.array_equal(a, b) for a, b in zip(_weights(tmp_path / "whole"), _weights(tmp_path / "split")))
    before = (tmp_path / "split" / "metrics.jsonl").read_text()
    assert main(_args(tmp_path, "split", "--seed", "1")) == 2  # another run's folder: refused, left as it was
    assert "a run with seed=0, not 1" in capsys.readouterr().err
    assert (tmp_path / "split" / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    "change, words",
    [
        (["--reward", "nowhere_module_xyz:f"], "--reward 'nowhere_module_xyz:f': cannot import"),
        (["--reward", "REWARDS:nothing"], "has no function nothing"),
        (["--reward", "digits"], "give MODULE:FUNCTION"),
        (["--set", "model.num_layers=4"], "model.num_layers"),
        (["--set", "grpo.group_size=1"], "grpo.group_size=1"),
        (["--stop-ids", "999"], "--stop-ids: 999 is outside the vocabulary"),
        (["--mesh", "fsdp=8", "--set", "grpo.prompts=2"], "--mesh fsdp=8 with 4 rollouts a batch"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(tmp_path, capsys, change, words):
    _files(tmp_path)
    args = [a.replace("REWARDS", str(tmp_path / "rewards.py")) for a in _args(tmp_path, "run") + change]
    assert main(args) == 2
    assert words in capsys.readouterr().err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "line, words",
    [
        ('{"prompt": "2+2="}', '"prompt" is text, and the run has no tokenizer'),
        ('{"prompt_ids": []}', "an empty prompt"),
        ('{"text": "x"}', 'a record holds "prompt" (text) or "prompt_ids"'),
        ("not json", "not a JSON record"),
    ],
)
def test_bad_prompt_records_are_refused_with_their_line(tmp_path, capsys, line, words):
    _files(tmp_path, ['{"prompt_ids": [1, 2]}', line])
    assert main(_args(tmp_path, "run")) == 2
    assert f"prompts.jsonl:2: {words}" in capsys.readouterr().err and not (tmp_path / "run").exists()
