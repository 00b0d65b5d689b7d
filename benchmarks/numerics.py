"""The numerical tests' robustness: the numerics-sensitive test files run under three XLA configurations,
and every bound they checked is written down with the noise it was set from and the error it met.

    python benchmarks/numerics.py                              # -> benchmarks/results/numerics_cpu.json
    python benchmarks/numerics.py --files tests/test_invariance.py --out /tmp/n.json
    python benchmarks/numerics.py --files tests/test_ring.py --add   # more files into the same JSON

Each configuration is a separate pytest run (``-n 2``) with ``JAXPAR_NUMERICS_LOG`` set: every check in
tests/noise.py appends one JSON line (family, case, the reference's measured noise, the tolerance set
from it, the error the parallel path reached, or for a mutation the factor by which it missed the
bound). The configurations:

* ``suite``: what CI runs (tests/conftest.py: XLA's LLVM optimisation level 0, a compilation cache);
* ``xla-default``: ``JAXPAR_TESTS_PLAIN_XLA=1``, XLA's default optimisation and no cache;
* ``eigen-1-thread``: the suite's settings plus ``--xla_cpu_multi_thread_eigen=false`` (Eigen's matmuls
  and convolutions on one thread: other blockings, other sums).

The JSON holds, per configuration, every record, and a summary per family: the worst error as a share
of its tolerance (tests/test_numerics_record.py checks it stays at most 1/5), and the smallest factor
by which a mutation missed its bound.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from overhead import cpu_name  # benchmarks/, this script's folder

ROOT = Path(__file__).resolve().parents[1]
FILES = [
    "tests/test_invariance.py",
    "tests/test_pipeline.py",
    "tests/test_pipeline_moe.py",
    "tests/test_context_parallel.py",
    "tests/test_moe_models.py",
    "tests/test_five_d.py",
    "tests/test_moe_resume.py",
    "tests/test_generate.py",
    "tests/test_generate_hf.py",
    "tests/test_convert.py",
    "tests/test_convert_cli.py",
    "tests/test_ring.py",
    "tests/test_ulysses.py",
    "tests/test_context_attention.py",
    "tests/test_mla.py",
    "tests/test_expert_parallel.py",
    "tests/test_dropless.py",
    "tests/test_flash.py",
    "tests/test_loss_chunks.py",
]
CONFIGS = {
    "suite": {},
    "xla-default": {"JAXPAR_TESTS_PLAIN_XLA": "1"},
    "eigen-1-thread": {"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"},
}


def run_config(name: str, env: dict, files: list[str]) -> dict:
    """One pytest run under ``env``: its exit status, wall time and the checks it recorded."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as log:
        path = log.name
    full_env = {**os.environ, **env, "JAXPAR_NUMERICS_LOG": path}
    if "XLA_FLAGS" in env and "XLA_FLAGS" in os.environ:
        full_env["XLA_FLAGS"] = f"{os.environ['XLA_FLAGS']} {env['XLA_FLAGS']}"
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-n", "2", *files],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    os.unlink(path)
    print(f"{name}: exit {proc.returncode}, {len(records)} checks, {seconds:.0f} s", file=sys.stderr, flush=True)
    if proc.returncode:
        print(proc.stdout[-4000:], file=sys.stderr)
    return dict(exit_status=proc.returncode, seconds=round(seconds, 1), records=records)


def merged(prior: dict, run: dict) -> dict:
    """``run`` added to the ``prior`` run of the same configuration: a check that ran again (the same
    family and case) replaces its earlier record."""
    new = {(r["family"], r["case"]) for r in run["records"]}
    kept = [r for r in prior["records"] if (r["family"], r["case"]) not in new]
    return dict(
        exit_status=max(run["exit_status"], prior["exit_status"]),
        seconds=round(run["seconds"] + prior["seconds"], 1),
        records=kept + run["records"],
    )


def share(record: dict) -> float:
    """The error as a share of its tolerance: the largest over what the check bounded."""
    return max(record["error"][k] / record["tolerance"][k] for k in record["error"])


def summary(runs: dict) -> dict:
    """Per family: the worst share of its tolerance any case reached in any configuration, and the
    smallest factor by which a mutation missed its bound."""
    out: dict = {}
    for config, run in runs.items():
        for r in run["records"]:
            fam = out.setdefault(r["family"], dict(cases=0, worst_share=0.0, worst_case=None, mutations={}))
            if "factor" in r:
                m = fam["mutations"].setdefault(r["case"], dict(min_factor=float("inf")))
                m["min_factor"] = min(m["min_factor"], r["factor"])
                continue
            fam["cases"] += config == "suite"
            if share(r) > fam["worst_share"]:
                fam.update(worst_share=share(r), worst_case=f"{r['case']} ({config})")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=FILES)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "numerics_cpu.json")
    parser.add_argument("--add", action="store_true", help="add these files' checks to --out's runs")
    args = parser.parse_args(argv)
    runs = {name: run_config(name, CONFIGS[name], args.files) for name in args.configs}
    if args.add:
        old = json.loads(args.out.read_text())
        for name, run in runs.items():
            run.update(merged(old["runs"][name], run))
        args.files = [*old["files"], *(f for f in args.files if f not in old["files"])]
    result = dict(
        benchmark="numerics",
        cpu=cpu_name(),
        cores=os.cpu_count(),
        python=platform.python_version(),
        jax=importlib.metadata.version("jax"),
        files=args.files,
        configs={n: CONFIGS[n] for n in args.configs},
        summary=summary(runs),
        runs=runs,
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return max(run["exit_status"] for run in runs.values())


if __name__ == "__main__":
    sys.exit(main())
