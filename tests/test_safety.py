"""No input path can run code: the package never unpickles, never evals or execs, and reads ``.npy``
files with ``allow_pickle=False``. Checked on the syntax tree of every module of the package."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxpar", "models", "meshes", "train")
BANNED_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "joblib", "cloudpickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
LOADERS = {
    ("torch", "load"),
    ("yaml", "load"),
    ("yaml", "unsafe_load"),
    ("pd", "read_pickle"),
    ("pandas", "read_pickle"),
}


def findings(source: str, where: str) -> list[str]:
    """Each way ``source`` could execute data as code, as ``where:line: what``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [
                f"{where}:{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            out.append(f"{where}:{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in BANNED_CALLS:
                out.append(f"{where}:{node.lineno}: {f.id}()")
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                pair = (f.value.id, f.attr)
                if pair in LOADERS:
                    out.append(f"{where}:{node.lineno}: {f.value.id}.{f.attr}()")
                elif f.attr == "load" and f.value.id in ("np", "numpy"):
                    safe = any(
                        k.arg == "allow_pickle" and isinstance(k.value, ast.Constant) and k.value.value is False
                        for k in node.keywords
                    )
                    if not safe:
                        out.append(f"{where}:{node.lineno}: {f.value.id}.load() without allow_pickle=False")
    return out


def test_the_package_never_runs_data_as_code():
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 40
    problems = [f for p in files for f in findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "from pickle import loads",
        "eval(text)",
        "exec(code)",
        "torch.load(path)",
        "yaml.load(stream)",
        "np.load(path)",
        "np.load(path, allow_pickle=True)",
        "import dill.settings",
    ],
)
def test_the_scanner_catches(snippet):
    assert findings(snippet, "x.py"), snippet


def test_the_scanner_allows_safe_reads():
    assert not findings("np.load(path, mmap_mode='r', allow_pickle=False)\njson.loads(t)\nre.compile('a')", "x.py")
