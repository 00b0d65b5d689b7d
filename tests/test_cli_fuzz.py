"""No traceback from any command line. Hypothesis draws flag sets for every ``jaxpar`` subcommand from the
parsers' own option tables (``build_parser``: every option and positional, required or not), mixing
valid and invalid values: wrong types, unknown keys, out-of-range numbers, contradictory layouts,
missing, empty and wrong-kind paths, and ``--set`` items over every config path. Each run must end in
one of two ways:

* exit 0 (or reaching the work itself, see below);
* exit 2 with one error line on stderr, ``jaxpar[ COMMAND]: error: …`` (a refusal that lists what
  differs, e.g. a run that cannot resume, goes on in indented lines), no traceback, and nothing on
  disk changed (the inputs are byte-for-byte and mtime-for-mtime as before; no new file).

The work after argument validation is stubbed (``Reached``), since it compiles: the training run
(``loop._Run``), ``jax.distributed.initialize``, reading weights (``convert._place``,
``convert.store.load_model``), ``plan``'s compile and search, the shardings report and rules report.
``simulate_cpu_devices`` keeps its own check (n ≥ 1) and leaves the suite's 8 devices as they are. The
search is bounded (examples per command, ``derandomize``: CI runs the same examples every time). Crashes
it found are kept as named cases at the end of this file.
"""

from __future__ import annotations

import argparse
import itertools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_bad_input import snapshot
from tiny_hf import write_hf_folder

from jaxpar.analysis.hardware import HARDWARE
from jaxpar.cli import COMMANDS, build_parser, main
from jaxpar.config import Choice
from jaxpar.convert.command import TAKES as CONVERT_TAKES
from jaxpar.errors import MeshError
from jaxpar.inference.command import TAKES as INFERENCE_TAKES
from jaxpar.inference.layouts import PRESETS as DECODE_PRESETS
from jaxpar.meshes import PRESETS as MESH_PRESETS
from jaxpar.models import PRESETS as MODEL_PRESETS
from jaxpar.pipeline.command import TAKES as PIPELINE_TAKES
from jaxpar.rl.command import TAKES as GRPO_TAKES
from jaxpar.settings import field_paths
from jaxpar.shardings import MODEL_TAKES
from jaxpar.train.config import default_config

EXAMPLES = int(__import__("os").environ.get("FUZZ_EXAMPLES", "100"))  # per command


class Reached(BaseException):
    """The command got past its checks to the stubbed work (a BaseException: no ``except`` swallows it)."""


def _reached(*args, **kwargs):
    raise Reached


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


SUBPARSERS = _subparsers()

# ------------------------------------------------------------------------------------------- values
# Each option draws a valid value 9 times in 10, so that most command lines get past the parser and
# into the commands' own checks, where an invalid value, or a valid one that contradicts another, is
# the interesting case. (valid, invalid) pools by the option's dest, then by its type.
SMALL_MODELS = [m for m in MODEL_PRESETS if m.startswith("tiny")]
MESHES = ["data=2", "fsdp=-1", "data=2,tensor=4", "stage=2,data=4", "sequence=2", "tensor=8", "expert=2,data=4"]
BAD_MESHES = ["data=3", "data=0", "bogus", "", "data=2,data=2", "dcn.data=2", "stage=16", "tensor=5"]
INTS, BAD_INTS = ["1", "2", "4", "8"], ["0", "-1", "-7", "x", "1.5", "", " 2", "100000", "٣", "3"]
FLOATS, BAD_FLOATS = ["0", "0.5", "1", "0.01"], ["2", "-1", "nan", "inf", "x", ""]
JUNK = ["", " ", "x", "1", "-1", "a,b", "=", "none", "../..", "\x00"]
PATHS = ["<ckpt>", "<hf>", "<text>", "<tokenizer>", "<tokens>", "<empty>", "<missing>", "<new>", "<ckpt>/config.json"]
PATHS += ["<binary>", "<hf>/model.safetensors"]  # bytes that are no text, JSON or UTF-8
POOLS = {
    "model": (SMALL_MODELS * 4 + list(MODEL_PRESETS), ["bogus", "", "Tiny"]),
    "mesh": ([*MESH_PRESETS, *DECODE_PRESETS, *MESHES], BAD_MESHES),
    "rules": ([*MESH_PRESETS, *MESHES], BAD_MESHES),
    "hardware": (list(HARDWARE), ["bogus", ""]),
    "source": (["<ckpt>", "<hf>"], PATHS),
    "init_from": (["<ckpt>"], PATHS),
    "to_hf": (["<ckpt>"], PATHS),
    "from_hf": (["<hf>"], PATHS),
    "draft": (["<ckpt>"], PATHS),
    "tokenizer": (["<tokenizer>"], PATHS),
    "out": (["<new>", "<new>.bin", "<new>.npy"], PATHS),
    "inputs": (["<text>"], PATHS),
    "chat_template": (["<text>"], PATHS),
    "compile_cache": (["<new>"], PATHS),
    "plot": (["<new>.png"], PATHS),
    "prompt": (["hello", "hello world", "a b a"], ["", "ünïcode", "x" * 300, "zzz"]),
    "prompt_ids": (["1,2,3", "5", "7,8"], ["", "a", "-1", "63", "64", "1,,2", "99999999999999999999"]),
    "stop_ids": (["5", "1,2"], ["", "a", "-3", "70000"]),
    "times": (["1,2", "1,1,1", "1,1,0.5"], ["0,0", "-1,2", "a,b", "1", "1,2,3,4", "nan,1", "inf,1", ""]),
    "profile_steps": (["1:2"], ["2:1", "a:b", "", "3", "0:0"]),
    "host": (["127.0.0.1", "::1", "localhost"], ["0.0.0.0", "bogus host", ""]),
    "api_key": (["k"], ["", " "]),
    "memory_budget": (["1GiB", "10MiB"], ["0", "1KB", "x", "1e3"]),
    "coordinator": (["10.0.0.1:1234"], ["10.0.0.1", ":", "h:99999", ""]),
    "family": (["llama"], ["qwen2", "bogus"]),
    "dtype": (["float32", "bfloat16"], ["int8", "bogus"]),
    "eos_token": (["</s>"], ["b", "", "nope"]),
    "model_name": (["m"], [""]),
    "port": (["0"], ["-1", "70000", "x"]),
    "max_new_tokens": (["1", "4"], BAD_INTS + ["60", "100000"]),
    ("prepare", "out"): (["<new>.bin", "<new>.npy"], [*PATHS, "<new>"]),
    "prompts": (["<prompts>"], [*PATHS, "<binary>"]),
    "reward": (["<reward>:score"], ["score", "", "<text>:f", "<missing>.py:f", "os:nothing", "..:f", "<reward>:"]),
}


def _members(tp) -> list[str]:
    """The values of the ``Choice`` enums in a field's type (``X | None`` included)."""
    return [str(m.value) for a in (getattr(tp, "__args__", None) or (tp,)) if _is_choice(a) for m in a]


def _is_choice(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, Choice)


# The paths each command's --set takes (the modules' own tables): most items draw from these.
TAKES = {"train": ("",), "prepare": ("",), "pipeline": PIPELINE_TAKES, "generate": INFERENCE_TAKES}
TAKES |= {"serve": INFERENCE_TAKES, "plan": MODEL_TAKES, "shardings": MODEL_TAKES, "convert": CONVERT_TAKES}
TAKES |= {"grpo": GRPO_TAKES}


def _set_items(command: str) -> tuple[st.SearchStrategy[str], st.SearchStrategy[str]]:
    """(valid-looking, invalid) ``PATH=VALUE`` items over the config paths ``command`` takes (of a dense
    and an MoE model), values by the field's type; the invalid ones include every other path."""
    every = field_paths(default_config("tiny")) | field_paths(default_config("tiny-moe"))
    paths = {p: tp for p, tp in every.items() if p.startswith(TAKES[command])}
    by_type = {int: (INTS, BAD_INTS), float: (FLOATS, BAD_FLOATS), bool: (["true", "false"], ["maybe", ""])}

    def pools(tp) -> tuple[list[str], list[str]]:
        if _members(tp):
            return _members(tp), ["bogus", "", "none"]
        return by_type.get(tp, (["x", "none"], JUNK))

    def item(valid: bool, paths: dict):
        return st.sampled_from(sorted(paths)).flatmap(
            lambda p: st.sampled_from(pools(paths[p])[0 if valid else 1]).map(lambda v: f"{p}={v}")
        )

    junk_paths = ["bogus", "model.bogus", "model", "execution", "model.moe.top_k.x", "", "num_layers", "steps."]
    junk = st.tuples(st.sampled_from(junk_paths), st.sampled_from(["=", "", "=="]), st.sampled_from(JUNK))
    return item(True, paths), item(False, paths) | item(True, every) | junk.map("".join) | st.text(max_size=12)


SET_ITEMS = {command: _set_items(command) for command in COMMANDS}


def _pools(command: str, action: argparse.Action) -> tuple[list[str], list[str]]:
    if (command, action.dest) in POOLS:
        return POOLS[command, action.dest]
    if action.dest in POOLS:
        return POOLS[action.dest]
    if action.choices:
        return [*map(str, action.choices)], ["bogus", ""]
    if action.type is float:
        return FLOATS, BAD_FLOATS
    if action.type is not None:  # int and the positive-integer types
        return INTS, BAD_INTS
    return JUNK, JUNK


@st.composite
def _values(draw, command: str, action: argparse.Action) -> list[str]:
    """One option's value(s): a list of strings (several for a repeatable or multi-value option)."""
    many = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
    out = []
    for _ in range(draw(st.integers(1, 3)) if many else 1):
        valid = draw(st.integers(0, 9)) > 0
        if action.dest == "overrides":
            out.append(draw(SET_ITEMS[command][0 if valid else 1]))
        else:
            good, bad = _pools(command, action)
            out.append(draw(st.sampled_from(good if valid else bad) | (st.nothing() if valid else st.text(max_size=6))))
    return out


@st.composite
def command_lines(draw, command: str) -> list[str]:
    """A flag set for ``command``: one option of each mutually exclusive group (now and then two, or
    none), required options 19 times in 20, the others 1 in 3."""
    parser = SUBPARSERS[command]
    grouped = {a: g for g in parser._mutually_exclusive_groups for a in g._group_actions}
    chosen = set()
    for group in parser._mutually_exclusive_groups:
        k = draw(st.sampled_from([1] * 8 + [0, 2]))
        chosen.update(draw(st.permutations(group._group_actions))[:k])
    argv = [command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.dest.startswith("_"):
            continue
        if action in grouped:
            given = action in chosen
        else:
            given = draw(st.integers(0, 19)) > 0 if action.required else draw(st.integers(0, 2)) == 0
        if not given:
            continue
        if action.nargs == 0:  # a switch
            argv.append(action.option_strings[0])
            continue
        values = draw(_values(command, action))
        if not action.option_strings:  # a positional
            argv += values
        else:
            for value in values:
                argv += [draw(st.sampled_from(action.option_strings)), value]
    return argv


# --------------------------------------------------------------------------------------- the inputs
@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Path:
    """The files the paths stand for: a tiny Llama folder, its model checkpoint, a tokenizer, text and
    tokens, an empty folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("pool")
    write_hf_folder(root / "hf")
    assert main(["convert", "--from-hf", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    words = ["</s>", "<unk>", "hello", "world", "a", "b"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "text.txt").write_text("hello world\na b\n")
    np.save(root / "tokens.npy", (np.arange(4000) % 50).astype(np.uint16))
    (root / "empty").mkdir()
    shutil.copy(root / "tokenizer.json", root / "ckpt")  # --from's tokenizer, as a served model has
    (root / "broken.jinja").write_text("{% if %}")
    (root / "prompts.jsonl").write_text('{"prompt": "hello world"}\n{"prompt_ids": [1, 2, 3]}\n')
    (root / "reward.py").write_text("def score(prompt, completion):\n    return float(len(completion))\n")
    (root / "binary").write_bytes(bytes(range(256)) * 4)
    (root / "badtok").mkdir()
    shutil.copy(root / "tokenizer.json", root / "badtok")
    (root / "badtok" / "tokenizer_config.json").write_text("[1, 2]")  # JSON, but not an object
    return root


NAMES = {"<ckpt>": "ckpt", "<hf>": "hf", "<text>": "text.txt", "<tokenizer>": "tokenizer.json"}
NAMES |= {
    "<broken.jinja>": "broken.jinja",
    "<badtok>": "badtok",
    "<tokens>": "tokens.npy",
    "<empty>": "empty",
    "<missing>": "missing/deeper",
    "<new>": "new",
    "<binary>": "binary",
    "<prompts>": "prompts.jsonl",
    "<reward>": "reward.py",
}


def _fill(arg: str, root: Path) -> str:
    for token, name in NAMES.items():
        arg = arg.replace(token, str(root / name))
    return arg


@pytest.fixture
def stubbed(monkeypatch):
    """The work after the checks, stubbed with ``Reached``; the device count left at the suite's 8."""
    import jax

    import jaxpar.analysis.plan
    import jaxpar.analysis.plan_command
    import jaxpar.convert
    import jaxpar.convert.store
    import jaxpar.rl.run_folder
    import jaxpar.shardings
    import jaxpar.train.loop

    def devices(n: int) -> None:
        if n < 1:
            raise MeshError(f"--cpu-devices={n}: must be a positive integer")

    for module_name in COMMANDS.values():
        module = __import__(module_name, fromlist=["_"])
        if hasattr(module, "simulate_cpu_devices"):
            monkeypatch.setattr(module, "simulate_cpu_devices", devices)
    for owner, name in [
        (jaxpar.train.loop, "_Run"),
        (jax.distributed, "initialize"),
        (jaxpar.convert, "_place"),
        (jaxpar.convert.store, "load_model"),
        (jaxpar.analysis.plan, "plan"),
        (jaxpar.analysis.plan_command, "_search"),
        (jaxpar.analysis.plan_command, "_inference"),
        (jaxpar.shardings, "param_shardings"),
        (jaxpar.shardings, "rules_report"),
        (jaxpar.rl.run_folder, "RunFolder"),
    ]:
        monkeypatch.setattr(owner, name, _reached)


COUNTER = itertools.count()


def check_command_line(argv: list[str], pool: Path, scratch: Path, capsys) -> str:
    """Run ``argv`` on a fresh copy of the pool; exit 0, Reached, or a one-line refusal that wrote nothing.
    Returns stderr, the paths of the copy shown as the pool's stand-ins (``<ckpt>``, ...)."""
    root = scratch / f"case{next(COUNTER)}"
    shutil.copytree(pool, root)
    argv = [_fill(arg, root) for arg in argv]
    before = snapshot(root)
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exit_:  # the parser's own: usage errors (2) and --help (0)
        code = exit_.code
    except Reached:
        code = 0
    except Exception as err:  # a crash: name the command line (hypothesis shows the traceback too)
        raise AssertionError(f"{argv}: {type(err).__name__}: {err}") from err
    err = capsys.readouterr().err
    assert code in (0, 2), f"{argv}: exit {code}\n{err}"
    if code == 2:
        lines = err.strip().splitlines()
        assert re.match(r"jaxpar( [a-z]+)?: error: \S", lines[0]), f"{argv}:\n{err}"
        assert "Traceback" not in err and sum("error:" in line for line in lines) == 1, f"{argv}:\n{err}"
        assert snapshot(root) == before, f"{argv} wrote to disk before refusing:\n{err}"
    shutil.rmtree(root, ignore_errors=True)
    for token, name in NAMES.items():
        err = err.replace(str(root / name), token)
    return err


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_line_crashes(command, pool, stubbed, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path lands here

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=__import__("os").environ.get("FUZZ_RANDOM") is None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(argv=command_lines(command))
    def run(argv):
        check_command_line(argv, pool, tmp_path, capsys)

    run()


# ------------------------------------------------------------------- the crashes the search found
REGRESSIONS = {
    # a NUL byte reached os.stat (ValueError: embedded null byte); no shell passes one, main() can
    "nul-in-a-path": (
        ["generate", "--from", "<ckpt>\x00", "--prompt", "a", "--max-new-tokens", "1"],
        r"jaxpar: error: '<ckpt>\\x00': a NUL character",
    ),
    # an empty --from-hf was taken for "no --from-hf", and --to-hf None reached Path()
    "convert-empty-from-hf": (
        ["convert", "--from-hf", "", "--out", "<new>"],
        r"jaxpar: error: --from-hf: an empty path",
    ),
    # --chat-template of a folder: IsADirectoryError
    "chat-template-is-a-folder": (
        ["serve", "--from", "<ckpt>", "--chat-template", "<empty>"],
        r"jaxpar: error: --chat-template <empty>: cannot be read \(Is a directory\)",
    ),
    # a template Jinja cannot parse: TemplateSyntaxError at the server's start
    "chat-template-not-jinja": (
        ["serve", "--from", "<ckpt>", "--chat-template", "<broken.jinja>"],
        r"jaxpar: error: --chat-template <broken.jinja>: not a Jinja template \(line 1: ",
    ),
    # tokenizer_config.json holding a list: AttributeError on .get
    "tokenizer-config-not-an-object": (
        ["serve", "--from", "<ckpt>", "--tokenizer", "<badtok>/tokenizer.json"],
        r"jaxpar: error: <badtok>/tokenizer_config\.json: expected a JSON object, got list",
    ),
}


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_the_crashes_found_are_refusals(name, pool, stubbed, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv, message = REGRESSIONS[name]
    err = check_command_line(argv, pool, tmp_path, capsys)
    assert re.match(message, err), err
