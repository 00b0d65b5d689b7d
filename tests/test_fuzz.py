"""Property-based fuzzing of the two text parsers every run starts with: the mesh spec (``--mesh``) and
``--set path=value``. Whatever the text, each either returns a valid object or raises the library's own
error (a ``jaxpar.errors.JaxparError``: ``MeshError``, ``LayoutError``, ``ConfigError``, ...), never a bare
ValueError, TypeError, KeyError,
ZeroDivisionError, ... that would reach the user as a traceback.

Each test gets a fixed budget of examples and ``derandomize=True``, so CI runs the same examples every
time; no example database is kept.
"""

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpar.mesh import AXES, MeshConfig, MeshError
from jaxpar.meshes import PRESETS, MeshPreset, resolve_mesh_arg
from jaxpar.rules import LayoutError
from jaxpar.train.config import ConfigError, TrainConfig, apply_overrides, default_config, field_paths

DEVICES = 8


def fuzz(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


# --------------------------------------------------------------------------------------------- mesh specs
JUNK_AXES = ("pipe", "Data", "dcn.", "dcn.pipe", "dcn.dcn.data", "", " ", "tensor ", "=", "data.fsdp")
AXIS_KEYS = st.sampled_from([*AXES, *(f"dcn.{a}" for a in AXES), *JUNK_AXES]) | st.text(max_size=6)
SIZES = (
    st.integers(-3, 12).map(str)
    | st.sampled_from(["-1", "0", "", " 2 ", "+4", "1_0", "2.0", "1e3", "two", "0x8", "٣", "9" * 5000, str(2**64)])
    | st.text(max_size=4)
)


@st.composite
def mesh_specs(draw):
    """Near-valid specs: ``axis=size`` items over the real axes (and junk), joined by commas."""
    items = draw(st.lists(st.tuples(AXIS_KEYS, st.sampled_from(["=", "=", "=", "", "==", ":"]), SIZES), max_size=7))
    sep = draw(st.sampled_from([",", ", ", ",,", " ,"]))
    return sep.join(f"{k}{eq}{v}" for k, eq, v in items)


def check_mesh_spec(spec: str) -> None:
    try:
        config = MeshConfig.parse(spec)
    except MeshError:
        config = None
    if config is not None:
        assert MeshConfig.parse(str(config)) == config  # the string form round-trips
        try:
            resolved = config.resolve(DEVICES)
        except MeshError:
            pass
        else:
            assert math.prod(resolved.shape().values()) == DEVICES
            assert all(n >= 1 for n in resolved.shape().values())
    try:
        preset = resolve_mesh_arg(spec)
    except (MeshError, LayoutError):
        return
    assert isinstance(preset, MeshPreset)
    assert "=" in spec or spec in PRESETS


@fuzz(300)
@given(st.text(max_size=40))
def test_mesh_parser_on_arbitrary_text(spec):
    check_mesh_spec(spec)


@fuzz(300)
@given(st.text(alphabet="datfspqunceixrg.=-,0123456789 ", max_size=40))
def test_mesh_parser_on_spec_alphabet(spec):
    check_mesh_spec(spec)


@fuzz(250)
@given(mesh_specs())
def test_mesh_parser_on_near_valid_specs(spec):
    check_mesh_spec(spec)


# ------------------------------------------------------------------------------------------ --set values
CONFIGS = {name: default_config(name) for name in ("tiny", "tiny-moe", "tiny-deepseek")}
PATH_TYPES = {p: tp for cfg in CONFIGS.values() for p, tp in field_paths(cfg).items()}
PATHS = sorted(PATH_TYPES)
JUNK_PATHS = (
    "model",
    "model.",
    ".steps",
    "steps.",
    "model.moe",
    "optimizer..schedule",
    "model.rope_scaling",
    "STEPS",
    "log.eval_every.x",
    "",
)
VALUES = (
    st.integers().map(str)
    | st.integers(-2, 3).map(str)
    | st.floats().map(str)
    | st.sampled_from(
        [
            "none",
            "null",
            "None",
            "true",
            "false",
            "yes",
            "",
            " ",
            "-0",
            "0",
            "1e999",
            "nan",
            "-inf",
            "1_000",
            "0x10",
            "2.5",
            "cosine",
            "wsd",
            "cosin",
            "files",
            "markov",
            "dots",
            "ring",
            "ulysses",
            "zigzag",
            "bfloat16",
            "float8",
            "9" * 5000,
            "=",
            "a=b",
        ]
    )
    | st.text(max_size=8)
)


def typed_values(tp) -> st.SearchStrategy[str]:
    """Values near the edge for a field of type ``tp``: small and huge ints, special floats, words."""
    text = repr(tp)
    if "int" in text:
        return st.integers(-2, 9).map(str) | st.sampled_from(["1_0", "+3", " 4 ", "2.0", "99999999999999999999"])
    if "float" in text:
        return st.floats().map(str) | st.sampled_from(["0", "-0.0", "1e-320", "1e999", "-inf", "nan", "1_0.5"])
    if "bool" in text:
        return st.sampled_from(["true", "false", "TRUE", "on", "0", "1", "2", "maybe"])
    return st.sampled_from(
        [
            "none",
            "",
            "full",
            "dots",
            "ring",
            "ulysses",
            "zigzag",
            "contiguous",
            "bfloat16",
            "float16",
            "files",
            "markov",
            "cosine",
            "wsd",
            "3d",
            "data=2",
            "uint32",
        ]
    )


@st.composite
def set_items(draw):
    """``path=value`` with real field paths (of the dense, MoE and MLA presets) and junk; the value is
    drawn for the path's type half of the time."""
    path = draw(st.sampled_from(PATHS) | st.sampled_from(JUNK_PATHS) | st.text(max_size=12))
    eq = draw(st.sampled_from(["=", "=", "=", " = ", "", "=="]))
    values = typed_values(PATH_TYPES[path]) if path in PATH_TYPES else VALUES
    return f"{path}{eq}{draw(values | VALUES)}"


def check_overrides(cfg: TrainConfig, items: list[str], *, layout: bool = False) -> None:
    """``items`` applied to ``cfg``: a config or ``ConfigError``; then ``validate``: the config or a
    ``ConfigError``; with ``layout``, also the layout checks ``jaxpar train`` runs before writing
    anything (mesh, divisibility, microbatches): a layout or a library error (``JaxparError``)."""
    from jaxpar.errors import JaxparError
    from jaxpar.train.loop import plan_layout

    try:
        out = apply_overrides(cfg, items)
    except ConfigError:
        return
    assert isinstance(out, TrainConfig)
    try:
        out.validate()
    except ConfigError:
        return
    if layout:
        try:
            plan_layout(out)
        except JaxparError:
            pass


@fuzz(200)
@given(st.text(max_size=40))
def test_set_parser_on_arbitrary_text(text):
    check_overrides(CONFIGS["tiny"], [text])


@fuzz(250)
@given(st.sampled_from(sorted(CONFIGS)), st.lists(set_items(), min_size=1, max_size=3))
def test_set_parser_on_real_paths(preset, items):
    check_overrides(CONFIGS[preset], items)


HOSTILE = ["0", "-1", "none", "", "nan", "inf", "1e999", "x", str(2**70), "9" * 5000]


@pytest.mark.parametrize("path", PATHS)
def test_each_field_with_hostile_values_and_values_of_its_type(path):
    """Per path: a fixed list of hostile values (a deterministic floor), then a few random values of the
    field's own type, which hit edges like ``model.num_kv_heads=0`` that a search over all paths at once
    rarely reaches."""
    cfg = next(c for c in CONFIGS.values() if path in field_paths(c))
    cfg = dataclasses.replace(cfg, batch=8, seq=16)
    for value in HOSTILE:
        check_overrides(cfg, [f"{path}={value}"], layout=True)

    @fuzz(6)
    @given(typed_values(PATH_TYPES[path]))
    def typed(value):
        check_overrides(cfg, [f"{path}={value}"], layout=True)

    typed()


@fuzz(100)
@given(
    st.sampled_from(sorted(CONFIGS)),
    st.lists(set_items(), min_size=1, max_size=3),
    st.sampled_from(["3d", "dp", "fsdp", "tp", "cp", "data=2,expert=4", "data=2,fsdp=-1", "tensor=3"]),
)
def test_checks_before_any_write_raise_only_library_errors(preset, items, mesh):
    """Past the parser, on whatever config the overrides produce: the checks ``jaxpar train`` runs
    before writing anything."""
    check_overrides(dataclasses.replace(CONFIGS[preset], mesh=mesh, batch=8, seq=16), items, layout=True)
