"""Build the tutorial notebooks: colab/src/NAME.py (jupytext "percent" cells) -> colab/NAME.ipynb, run.

    python colab/build.py                 # every notebook
    python colab/build.py 03_pipeline     # some of them

Each notebook is its source with one install cell put first (the same for all, kept here once), executed
top to bottom in a fresh kernel from colab/ (nbclient), and written with its outputs and figures, so a
reader on a code host sees them without running anything. The wall time of the run is kept in the
notebook's metadata (``jaxpar.seconds``); the index table of colab/README.md (between its ``<!-- notebooks -->``
markers) is rendered from that metadata and ``SUMMARIES`` after every build:

    python colab/build.py --index         # only re-render the index table

tests/test_tutorial_*.py execute the committed notebooks again (the same way) and assert their key
numbers: every notebook leaves a dict ``key_numbers`` in its namespace.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = HERE / "src"

# The one place that says where a Colab runtime installs jaxpar from. Change it to your fork.
INSTALL_CELL = """\
# Install jaxpar. On Colab it comes from JAXPAR_SOURCE; from a checkout (this notebook in colab/), the
# checkout itself is installed. Skipped when jaxpar is already importable.
JAXPAR_SOURCE = "git+https://github.com/jaxpar/jaxpar.git"
import importlib.util, pathlib, subprocess, sys
if importlib.util.find_spec("jaxpar") is None:
    checkout = pathlib.Path("..", "pyproject.toml").exists()
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                           *(["-e", "..[plot]"] if checkout else [f"jaxpar[plot] @ {JAXPAR_SOURCE}"])])"""

# One line per notebook for the index table: what it shows.
SUMMARIES = {
    "00_start": "devices, a mesh, logical axes → rules → what each device holds for Llama-3-8B; one step gives "
    "the same loss on 1 and 8 devices",
    "01_data_fsdp": "16Ψ bytes per parameter and the ZeRO stages; memory per device of dp / fsdp / hsdp from the "
    "compiled step; the gradient all-reduce against 2(n−1)/n·P·b; when FSDP pays",
    "02_tensor_sequence": "column- then row-parallel matmuls; the collectives of one layer with and without "
    "sequence parallelism; the texts' TP-on-PCIe claim against the layout lab for a 70B model",
    "03_pipeline": "GPipe, 1F1B, interleaved and zero-bubble schedule tables as Gantt charts; the bubble against m, "
    'counted and by formula; activation memory against m from the compiled step; "PP=4 with 4 microbatches '
    'wastes 43%"',
    "04_context": "ring attention hop by hop; zig-zag vs contiguous work per device; memory per device against L; "
    "Ulysses' all-to-alls; ring = dense",
    "05_experts": "routing; capacity factor against dropped tokens with hot experts; all-to-all bytes against the "
    "formula; token choice vs expert choice; dropless = dense",
    "06_combining": "five axes at once on 32 devices and the collectives of each; `jaxpar plan --search` for "
    "Mixtral-8x7B on 64 H100s; the texts' \"what is your bottleneck?\" list answered from the lab's numbers",
    "07_inference": "KV bytes per token of real models from jaxpar's cache; \"65k more tokens at 70B cost ~2 GB per "
    'GPU" checked; prefill vs decode intensity against the ridge point; decode_tp vs decode_dp from the '
    "compiled decode step; generation from a freshly trained model",
    "08_checkpoints": "a local Hugging Face checkpoint and tokenizer → `jaxpar convert` → fine-tune on a text file, "
    "interrupted and resumed bit for bit → export → `transformers` gives the same logits → generate",
    "09_serving": "what a memory budget holds with a dense vs a paged cache (Llama-3-8B pages); page tables with the "
    "null page and shared prefix pages; continuous vs static batching as slot timelines, same tokens; prompt "
    "tokens the prefix cache saves; preemption when pages run out",
    "10_post_training": "SFT on demonstrations, then LoRA adapters trained by DPO on preference pairs (the first "
    "loss log 2), then GRPO with the serving engine's rollouts in the training process; the curves and the "
    "held-out accuracy after each",
}
INDEX = HERE / "README.md"
INDEX_MARKERS = ("<!-- notebooks -->", "<!-- /notebooks -->")

# What the test appends to read the notebook's key numbers back.
READ_KEY_NUMBERS = "import json as _json; print(_json.dumps(key_numbers, sort_keys=True))"


def names() -> list[str]:
    return sorted(p.stem for p in SOURCES.glob("[0-9][0-9]_*.py"))


def source_notebook(name: str):
    """The notebook as built from its source: the install cell, then the source's cells (no outputs)."""
    import jupytext
    import nbformat

    nb = jupytext.read(SOURCES / f"{name}.py", fmt="py:percent")
    nb.cells.insert(0, nbformat.v4.new_code_cell(INSTALL_CELL))
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    }
    for i, cell in enumerate(nb.cells):
        cell.metadata, cell.id = {}, f"cell-{i:02d}"  # stable ids: a rebuild diffs only in outputs
    return nb


def cell_sources(nb) -> list[tuple[str, str]]:
    return [(c.cell_type, c.source) for c in nb.cells]


def execute(nb, *, timeout: int = 900):
    """Run every cell in a fresh kernel with colab/ as the working directory; raises on the first error."""
    from nbclient import NotebookClient

    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", record_timing=False, resources={"metadata": {"path": str(HERE)}}
    ).execute()
    return nb


def key_numbers(nb) -> dict:
    """Execute ``nb`` with one more cell that prints ``key_numbers`` as JSON, and return that dict."""
    import nbformat

    nb.cells.append(nbformat.v4.new_code_cell(READ_KEY_NUMBERS))
    execute(nb)
    out = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.output_type == "stream")
    return json.loads(out.strip().splitlines()[-1])


def index_rows() -> list[tuple[str, str, float]]:
    """(name, what it shows, recorded seconds) of every notebook, the seconds from its metadata."""
    rows = []
    for name in names():
        metadata = json.loads((HERE / f"{name}.ipynb").read_text())["metadata"]
        rows.append((name, SUMMARIES[name], metadata["jaxpar"]["seconds"]))
    return rows


def index_table() -> str:
    """The index table of colab/README.md: each notebook, what it shows, and its recorded run time."""
    lines = ["| notebook | what it shows | run time |", "|---|---|---:|"]
    lines += [f"| [`{name}`]({name}.ipynb) | {shows} | {seconds} s |" for name, shows, seconds in index_rows()]
    return "\n".join(lines)


def write_index() -> None:
    """Replace the table between the index markers of colab/README.md with ``index_table()``."""
    start, end = INDEX_MARKERS
    text = INDEX.read_text()
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    INDEX.write_text(f"{before}{start}\n{index_table()}\n{end}{after}")


def build(name: str) -> float:
    import nbformat

    nb = source_notebook(name)
    start = time.perf_counter()
    execute(nb)
    seconds = round(time.perf_counter() - start, 1)
    nb.metadata["jaxpar"] = {"seconds": seconds}
    nbformat.write(nb, HERE / f"{name}.ipynb")
    return seconds


def main(argv: list[str]) -> int:
    if argv == ["--index"]:
        write_index()
        return 0
    wanted = argv or names()
    unknown = sorted(set(wanted) - set(names()))
    if unknown:
        print(f"no source for {unknown} in {SOURCES}; have {names()}", file=sys.stderr)
        return 2
    for name in wanted:
        print(f"{name}: {build(name)} s", flush=True)
    write_index()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
