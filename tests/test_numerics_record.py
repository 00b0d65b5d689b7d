"""The recorded robustness run (benchmarks/results/numerics_cpu.json, written by benchmarks/numerics.py):
every numerical test file ran under three XLA configurations, no error came within 5× of its tolerance
in any of them, and every family's mutations missed their bounds."""

import ast
import json
from pathlib import Path

import pytest
from noise import MUTATION_GAP
from test_invariance import BF16_GAP

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "benchmarks" / "results" / "numerics_cpu.json").read_text())
FAMILIES = (
    "invariance",
    "bf16",
    "pipeline",
    "context",
    "experts",
    "5d",
    "resume",
    "generation",
    "paged",
    "grad_reduce",
    "flash",
    "loss-chunks",
    "packing",
    "lora",
    "dpo",
    "grpo",
)


def _files_that_check_noise() -> set[str]:
    """The test files that import tests/noise.py (directly or through invariance/pipeline_cases/hf_models)."""
    helpers = {"noise", "invariance", "pipeline_cases", "hf_models"}
    out = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        if names & helpers and path.name != Path(__file__).name:
            out.add(f"tests/{path.name}")
    return out


def test_every_numerical_file_ran_under_every_configuration():
    assert set(RECORD["configs"]) == {"suite", "xla-default", "eigen-1-thread"}
    missing = _files_that_check_noise() - set(RECORD["files"])
    assert not missing, f"run python benchmarks/numerics.py --files {' '.join(sorted(missing))} --add"
    assert all(run["exit_status"] == 0 and run["records"] for run in RECORD["runs"].values())


@pytest.mark.parametrize("family", FAMILIES)
def test_no_error_came_within_5x_of_its_tolerance(family):
    summary = RECORD["summary"][family]
    assert summary["cases"] > 0
    assert summary["worst_share"] <= 1 / 5, summary["worst_case"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_mutation_missed_its_bound(family):
    mutations = RECORD["summary"][family]["mutations"]
    assert mutations, f"{family} has no mutation"
    gap = BF16_GAP if family == "bf16" else MUTATION_GAP
    assert all(m["min_factor"] >= gap for m in mutations.values()), mutations
