"""Pipeline schedules as data (jaxpar.pipeline.schedules): numpy only, no JAX devices.

Expectations come from the closed forms (written out here, not taken from the module) and from a small
independent executor that runs a table with nothing but its slots."""

import dataclasses
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.errors import ConfigError
from jaxpar.pipeline import Op, Schedule, Table, bubble_formula, build, check_pipeline, min_microbatches

GRID = [(p, m) for p in (1, 2, 4, 8) for m in (p, 2 * p, 4 * p)]
CASES = (
    [("gpipe", p, m, 1) for p, m in GRID]
    + [("1f1b", p, m, 1) for p, m in GRID]
    + [("zero_bubble", p, m, 1) for p, m in GRID]
    + [("interleaved", p, m, v) for p, m in GRID for v in (2, 3)]
)


def expected_bubble(schedule, p, m, v=1, t_f=1.0, t_b=None, t_w=None):
    """The papers' closed forms; zero_bubble's is (p-1)(t_f+t_b-t_w) idle per stage (ZB-H1)."""
    if schedule != "zero_bubble":
        return (p - 1) / (v * m + p - 1)
    t_b = t_f if t_b is None else t_b
    t_w = t_f if t_w is None else t_w
    idle = (p - 1) * (t_f + t_b - t_w)
    return idle / (m * (t_f + t_b + t_w) + idle)


# ------------------------------------------------------------------------------ every schedule, valid
@pytest.mark.parametrize("schedule,p,m,v", CASES)
def test_valid_with_the_closed_form_bubble(schedule, p, m, v):
    table = build(schedule, p, m, v)
    table.validate()
    assert table.op.dtype == np.int8 and table.mb.dtype == np.int32 and table.op.shape == (table.ticks, p)
    assert table.split_backward == (schedule == "zero_bubble")
    assert table.bubble_fraction() == pytest.approx(expected_bubble(schedule, p, m, v), abs=1e-12)
    assert bubble_formula(schedule, p, m, v) == pytest.approx(expected_bubble(schedule, p, m, v), abs=1e-12)
    # in unit ticks: 2·v·m ops and 2(p-1) fill/drain ticks per stage (3m and p-1 for zero_bubble)
    ticks = 3 * m + p - 1 if schedule == "zero_bubble" else 2 * v * m + 2 * (p - 1)
    assert table.ticks == ticks
    assert table.act_slots >= table.peak_in_flight.max()  # an activation in flight holds its slot


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("t_f,t_b", [(1, 0.5), (1, 1), (1, 3), (2, 1)])
def test_closed_forms_hold_for_any_forward_and_backward_times(schedule, v, t_f, t_b):
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        table = build(schedule, p, m, v)
        assert table.bubble_fraction(t_f, t_b) == pytest.approx(expected_bubble(schedule, p, m, v), abs=1e-12)


@pytest.mark.parametrize("t_f,t_b,t_w", [(1, 1, 1), (1, 1, 0.5), (1, 2, 1), (2, 1, 1), (3, 2, 2), (1, 1, 0.25)])
def test_zero_bubble_closed_form_for_w_not_above_f_or_b(t_f, t_b, t_w):
    for p, m in [(2, 4), (4, 8), (8, 32)]:
        table = build("zero_bubble", p, m)
        want = expected_bubble("zero_bubble", p, m, 1, t_f, t_b, t_w)
        assert table.bubble_fraction(t_f, t_b, t_w) == pytest.approx(want, abs=1e-12)
        assert bubble_formula("zero_bubble", p, m, t_f=t_f, t_b=t_b, t_w=t_w) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("t_f,t_b,t_w", [(1, 1, 1.5), (1, 0.5, 1), (0.5, 1, 1)])
def test_zero_bubble_slower_w_leaves_more_bubble_than_the_form(t_f, t_b, t_w):
    table = build("zero_bubble", 4, 8)
    assert table.bubble_fraction(t_f, t_b, t_w) > expected_bubble("zero_bubble", 4, 8, 1, t_f, t_b, t_w) + 1e-3
    with pytest.raises(ConfigError, match=r"t_w=.* above min\(t_f=.*, t_b=.*\)"):
        bubble_formula("zero_bubble", 4, 8, t_f=t_f, t_b=t_b, t_w=t_w)


def test_gpipe_with_fewer_microbatches_than_stages():
    for m in (1, 3):
        assert build("gpipe", 4, m).bubble_fraction() == pytest.approx(3 / (m + 3), abs=1e-12)


@pytest.mark.parametrize("p,m", GRID)
def test_gpipe_and_1f1b_same_bubble_1f1b_less_memory(p, m):
    gpipe, one = build("gpipe", p, m), build("1f1b", p, m)
    assert gpipe.bubble_fraction() == pytest.approx(one.bubble_fraction(), abs=1e-12)
    assert list(one.peak_in_flight) == [min(p - s, m) for s in range(p)]
    assert list(gpipe.peak_in_flight) == [m] * p
    assert gpipe.act_slots == m


def test_1f1b_follows_pipedream_flush():
    """Stage s: min(p-s-1, m) warm-up forwards, then F and B alternate, then the backwards drain."""
    p, m = 4, 8
    for s, order in enumerate(build("1f1b", p, m).orders()):
        warm = p - s - 1
        kinds = "".join(op.name for op, _, _ in order)
        assert kinds == "F" * warm + "FB" * (m - warm) + "B" * warm
        assert [i for op, i, _ in order if op == Op.F] == list(range(m))


@pytest.mark.parametrize("p,m", [(p, m) for p, m in GRID if p > 1])
def test_zero_bubble_memory_of_1f1b_and_smaller_bubble(p, m):
    zb, one = build("zero_bubble", p, m), build("1f1b", p, m)
    assert zb.peak_in_flight.max() <= p and zb.peak_in_flight[0] == p
    assert zb.bubble_fraction() < one.bubble_fraction()  # same work: B+W = 1+1 = 2
    assert zb.bubble_fraction(1, 1, 1) < one.bubble_fraction(1, 1, 1)  # the same times spelled out
    for s, order in enumerate(zb.orders()):  # ZB-H1: W(k-s) right after B(k)
        after_b = [order[n + 1] for n, (op, i, _) in enumerate(order[:-1]) if op == Op.B and i >= s]
        assert after_b == [(Op.W, i - s, 0) for i in range(s, m)]


@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_holds_no_more_than_1f1b_on_stage_0(v):
    for p in (2, 4, 8):
        table = build("interleaved", p, 2 * p, v)
        assert table.peak_in_flight[0] <= v * p  # v·p chunk activations of 1/v stage each = p


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2), ("interleaved", 3)])
def test_buffers_do_not_grow_with_microbatches(schedule, v):
    for p in (2, 4, 8):
        tables = [build(schedule, p, k * p, v) for k in (2, 4, 8)]
        assert len({t.act_slots for t in tables}) == 1 and len({t.grad_slots for t in tables}) == 1
        assert tables[0].act_slots <= (v + 1) * p and tables[0].grad_slots <= p
        if v == 1:
            assert tables[0].act_slots == p


def test_gpipe_buffers_grow_with_microbatches():
    assert [build("gpipe", 4, m).act_slots for m in (1, 4, 8, 16)] == [1, 4, 8, 16]


def test_lockstep_bubbles():
    for p, m in [(2, 4), (4, 8), (8, 16)]:
        one, gpipe, zb = build("1f1b", p, m), build("gpipe", p, m), build("zero_bubble", p, m)
        assert one.lockstep_bubble_fraction() == pytest.approx(1 - 3 * m / (4 * m + 3 * p - 4), abs=1e-12)
        assert gpipe.lockstep_bubble_fraction() == pytest.approx(gpipe.bubble_fraction(), abs=1e-12)
        assert zb.lockstep_bubble_fraction() == pytest.approx(zb.bubble_fraction(), abs=1e-12)
        for table in (one, gpipe, zb, build("interleaved", p, m, 2)):
            assert table.lockstep_bubble_fraction() >= table.bubble_fraction() - 1e-12


def test_makespan_by_hand():
    """gpipe, 2 stages, 1 microbatch: F on stage 0 [0,1], stage 1 [1,2], B on stage 1 [2,4], stage 0 [4,6]."""
    table = build("gpipe", 2, 1)
    assert table.makespan() == 6 and table.makespan(1, 1) == 4 and table.bubble_fraction() == 0.5
    assert table.in_flight()[:, 0].tolist() == [1, 1, 1, 0] and table.in_flight()[:, 1].tolist() == [0, 1, 0, 0]


# --------------------------------------------------------------- an executor that sees only the slots
def execute(table: Table) -> None:
    """Runs ``table`` the way an SPMD executor would, with scalars: chunk g maps x to 3x + g, the loss is
    the last output, so the cotangent into chunk g's output is 3**(G-1-g). Every backward op must see
    its own stage input and cotangent, found through the slots alone."""
    p, G = table.stages, table.stages * table.virtual_stages
    act = np.full((p, table.act_slots), np.nan)
    grad = np.full((p, table.grad_slots), np.nan)
    seen = {}
    for t in range(table.ticks):
        sent_fwd, sent_bwd = {}, {}
        for s in range(p):
            o, i, j = table.op[t, s], table.mb[t, s], table.chunk[t, s]
            g = j * p + s
            if o == Op.F and g == 0:
                act[s, table.act_slot[t, s]] = i + 1.0  # the embedded input
            if o == Op.IDLE:
                continue
            x = act[s, table.act_slot[t, s]]
            dy = 1.0 if g == G - 1 else grad[s, table.grad_slot[t, s]] if o != Op.F else None
            if o == Op.F and g < G - 1:
                sent_fwd[(s + 1) % p] = 3 * x + g
            if o == Op.B and g > 0:
                sent_bwd[(s - 1) % p] = 3 * dy
            if o != Op.F:
                seen[(Op(o), int(i), int(g))] = (x, dy)
        for r, y in sent_fwd.items():
            if table.fwd_recv_slot[t, r] >= 0:
                act[r, table.fwd_recv_slot[t, r]] = y
        for r, dx in sent_bwd.items():
            if table.bwd_recv_slot[t, r] >= 0:
                grad[r, table.bwd_recv_slot[t, r]] = dx
    for i in range(table.microbatches):
        x = i + 1.0
        for g in range(G):
            for o in (Op.B, Op.W) if table.split_backward else (Op.B,):
                assert seen[(o, i, g)] == (x, 3.0 ** (G - 1 - g)), (o, i, g)
            x = 3 * x + g


@pytest.mark.parametrize("schedule,p,m,v", [c for c in CASES if c[1] in (1, 4) or c[2] == 8])
def test_an_executor_finds_every_input_and_cotangent_in_its_slot(schedule, p, m, v):
    execute(build(schedule, p, m, v))


# ---------------------------------------------------------------------------- broken tables refused
def broken(table: Table, **cells) -> Table:
    """A copy of ``table`` with ``cells = {array name: [(tick, stage, value), ...]}`` changed."""
    arrays = {name: getattr(table, name).copy() for name in cells}
    for name, changes in cells.items():
        for t, s, value in changes:
            arrays[name][t, s] = value
    return dataclasses.replace(table, **arrays)


def tick_of(table, op, mb, stage, chunk=0):
    return int(
        np.nonzero((table.op[:, stage] == op) & (table.mb[:, stage] == mb) & (table.chunk[:, stage] == chunk))[0][0]
    )


def swapped(table, stage, t1, t2):
    names = ("op", "mb", "chunk", "act_slot", "grad_slot")
    return broken(
        table,
        **{n: [(t1, stage, getattr(table, n)[t2, stage]), (t2, stage, getattr(table, n)[t1, stage])] for n in names},
    )


def test_validate_catches_a_swap_that_breaks_a_dependency():
    table = build("1f1b", 2, 2)
    bad = swapped(table, 1, tick_of(table, Op.F, 0, 1), tick_of(table, Op.B, 0, 1))
    with pytest.raises(
        ConfigError, match=re.escape("B(mb 0, chunk 0) needs F(mb 0, model chunk 1) on stage 1 at an earlier tick")
    ):
        bad.validate()


def test_validate_catches_an_op_in_the_same_tick_as_its_input():
    table = build("1f1b", 4, 8)  # stage 1 idles in tick 0, while stage 0 runs F0
    t = tick_of(table, Op.F, 0, 1)
    names = ("op", "mb", "chunk", "act_slot")
    bad = broken(
        table,
        **{n: [(0, 1, getattr(table, n)[t, 1]), (t, 1, table.op.dtype.type(0) if n == "op" else -1)] for n in names},
    )
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "stage 1, tick 0: F(mb 0, chunk 0) needs F(mb 0, model chunk 0) "
            "on stage 0 at an earlier tick; it runs at tick 0"
        ),
    ):
        bad.validate()


def test_validate_catches_a_duplicate_forward():
    table = build("1f1b", 4, 8)
    idle = int(np.nonzero(table.op[:, 3] == Op.IDLE)[0][-1])
    t = tick_of(table, Op.F, 2, 3)
    bad = broken(table, **{n: [(idle, 3, getattr(table, n)[t, 3])] for n in ("op", "mb", "chunk", "act_slot")})
    with pytest.raises(ConfigError, match=r"stage 3 has 2 F ops of \(mb 2, chunk 0\) \(ticks \[\d+, \d+\]\)"):
        bad.validate()


def test_validate_catches_a_dropped_w():
    table = build("zero_bubble", 4, 8)
    t = tick_of(table, Op.W, 5, 2)
    bad = broken(
        table, op=[(t, 2, 0)], mb=[(t, 2, -1)], chunk=[(t, 2, -1)], act_slot=[(t, 2, -1)], grad_slot=[(t, 2, -1)]
    )
    with pytest.raises(ConfigError, match=r"stage 2 has 0 W ops of \(mb 5, chunk 0\)"):
        bad.validate()


def test_validate_catches_a_corrupt_act_slot():
    table = build("1f1b", 4, 8)
    t = tick_of(table, Op.B, 5, 1)
    wrong = (table.act_slot[t, 1] + 1) % table.act_slots
    with pytest.raises(
        ConfigError,
        match=rf"stage 1, tick {t}: B\(mb 5, chunk 0\) reads act slot {wrong}, "
        r"which holds .*, not \(mb 5, chunk 0\)",
    ):
        broken(table, act_slot=[(t, 1, wrong)]).validate()


def test_validate_catches_an_overwritten_slot():
    table = build("1f1b", 4, 8)  # stage 0's F0 and F1 arrive at ticks 0, 1
    bad = broken(table, fwd_recv_slot=[(1, 1, table.fwd_recv_slot[0, 1])])
    with pytest.raises(
        ConfigError,
        match=r"stage 1, tick 1: the act of \(mb 1, chunk 0\) from F\(mb 1, chunk 0\) "
        r"on stage 0 overwrites act slot \d, which holds \(mb 0, chunk 0\)",
    ):
        bad.validate()


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda t: dict(fwd_recv_slot=[(0, 1, -1)]),
            r"F\(mb 0, chunk 0\) on stage 0 sends the act of \(mb 0, chunk 0\) "
            r"but fwd_recv_slot is -1: it would be lost",
        ),
        (lambda t: dict(fwd_recv_slot=[(0, 2, 0)]), r"stage 2, tick 0: fwd_recv_slot is 0, but stage 1 sends nothing"),
        (
            lambda t: dict(op=[(0, 3, Op.W)], mb=[(0, 3, 0)], chunk=[(0, 3, 0)], act_slot=[(0, 3, 0)]),
            r"stage 3, tick 0: a W op, but 1f1b has no split backward",
        ),
        (lambda t: dict(mb=[(0, 3, 1)]), r"stage 3, tick 0: an idle cell with mb 1"),
        (lambda t: dict(mb=[(0, 0, 8)]), r"stage 0, tick 0: mb 8 outside 0\.\.7"),
        (
            lambda t: dict(grad_slot=[(tick_of(t, Op.B, 0, 3), 3, 0)]),
            r"grad_slot 0 on an op with no incoming cotangent",
        ),
        (lambda t: dict(op=[(0, 0, 7)]), r"op 7 is not an Op"),
    ],
)
def test_validate_catches_bad_cells_and_arrivals(change, message):
    table = build("1f1b", 4, 8)
    with pytest.raises(ConfigError, match=message):
        broken(table, **change(table)).validate()


def test_validate_catches_wrong_shapes():
    table = build("1f1b", 2, 2)
    with pytest.raises(ConfigError, match=r"mb is \(3, 2\), expected integers of shape \[ticks, stages\]"):
        dataclasses.replace(table, mb=table.mb[:3]).validate()


# ----------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "schedule,p,m,v,message",
    [
        ("1fb", 4, 8, 1, "pipeline.schedule='1fb': choose one of gpipe, 1f1b, interleaved, zero_bubble"),
        ("1f1b", 0, 8, 1, "mesh stage=0: a pipeline needs at least 1 stage"),
        ("1f1b", 2.5, 8, 1, "mesh stage=2.5: must be an integer"),
        ("gpipe", 4, 0, 1, "pipeline.microbatches=0: pipeline.schedule=gpipe on mesh stage=4 needs at least 1"),
        ("1f1b", 4, 3, 1, "pipeline.microbatches=3: pipeline.schedule=1f1b on mesh stage=4 needs at least 4"),
        (
            "zero_bubble",
            8,
            7,
            1,
            "pipeline.microbatches=7: pipeline.schedule=zero_bubble on mesh stage=8 needs at least 8",
        ),
        (
            "interleaved",
            4,
            2,
            2,
            "pipeline.microbatches=2: pipeline.schedule=interleaved on mesh stage=4 needs at least 4",
        ),
        (
            "interleaved",
            4,
            6,
            2,
            "pipeline.microbatches=6: pipeline.schedule=interleaved needs a multiple of mesh stage=4",
        ),
        ("1f1b", 4, 8, 0, "pipeline.virtual_stages=0: each stage needs at least 1 model chunk"),
        ("1f1b", 4, 8, 2, "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved"),
        ("gpipe", 4, 8, 3, "pipeline.virtual_stages=3 needs pipeline.schedule=interleaved"),
        ("interleaved", 4, 8, 1, "pipeline.schedule=interleaved needs pipeline.virtual_stages >= 2 (got 1)"),
    ],
)
def test_refusals(schedule, p, m, v, message):
    for refuse in (check_pipeline, build, bubble_formula):
        with pytest.raises(ConfigError, match=re.escape(message)):
            refuse(schedule, p, m, v)


def test_min_microbatches():
    assert [
        min_microbatches(s, 4, v) for s, v in [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2)]
    ] == [1, 4, 4, 4]
    assert Schedule.parse("1f1b", field="pipeline.schedule") is Schedule.ONE_F_ONE_B


def test_bad_times_refused():
    with pytest.raises(ConfigError, match=r"pipeline times: t_b=-1 must be a positive number"):
        build("1f1b", 2, 2).makespan(1, -1)


# ---------------------------------------------------------------------------------------- gantt, CLI
def test_gantt_rows_and_cells():
    table = build("interleaved", 4, 8, 2)
    lines = table.gantt().splitlines()
    assert lines[0].startswith("tick") and [ln.split()[:2] for ln in lines[1:]] == [["stage", str(s)] for s in range(4)]
    cells = [ln.split()[2:] for ln in lines[1:]]
    assert all(len(row) <= table.ticks for row in cells) and cells[0][:5] == ["F0a", "F1a", "F2a", "F3a", "F0b"]
    assert cells[3][:4] == [".", ".", ".", "F0a"]
    assert build("1f1b", 4, 8).cells()[3][:5] == [".", ".", ".", "F0", "B0"]


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)])
def test_cli_json(capsys, schedule, v):
    assert (
        main(
            [
                "pipeline",
                "--stages",
                "4",
                "--microbatches",
                "8",
                "--schedule",
                schedule,
                "--virtual-stages",
                str(v),
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    for key in (
        "bubble_fraction",
        "lockstep_bubble_fraction",
        "formula_bubble_fraction",
        "peak_in_flight",
        "ticks",
        "stages",
        "microbatches",
        "virtual_stages",
        "schedule",
        "act_slots",
        "grad_slots",
        "table",
    ):
        assert key in report, key
    assert report["bubble_fraction"] == pytest.approx(expected_bubble(schedule, 4, 8, v), abs=1e-12)
    assert report["formula_bubble_fraction"] == pytest.approx(expected_bubble(schedule, 4, 8, v), abs=1e-12)
    assert report["schedule"] == schedule and report["stages"] == 4 and len(report["peak_in_flight"]) == 4
    assert len(report["table"]) == 4 and all(len(row) == report["ticks"] for row in report["table"])


def test_cli_times_and_text(capsys):
    assert (
        main(
            [
                "pipeline",
                "--stages",
                "4",
                "--microbatches",
                "8",
                "--schedule",
                "zero_bubble",
                "--times",
                "1,1,0.5",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert report["bubble_fraction"] == pytest.approx(expected_bubble("zero_bubble", 4, 8, 1, 1, 1, 0.5), abs=1e-12)
    assert main(["pipeline", "--stages", "4", "--microbatches", "8", "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert "stage 3  .  .  .  F0 B0 F1" in out and "bubble: 27.27% ideal" in out and "40.00% lockstep" in out
    assert "closed form: 27.27%" in out and "per stage: 4 3 2 1" in out


def test_cli_set_is_the_flags(capsys):
    """``--set pipeline.…`` (train's paths) and the flags give the same table; --set comes after the
    flags; interleaved takes 2 chunks unless a chunk count is given."""
    reports = []
    for argv in (
        ["--microbatches", "8", "--schedule", "interleaved"],
        ["--set", "pipeline.schedule=interleaved", "--set", "pipeline.microbatches=8"],
        ["--schedule", "1f1b", "--set", "pipeline.schedule=interleaved", "--virtual-stages", "2"],
    ):
        assert main(["pipeline", "--stages", "4", "--json", *argv]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0] == reports[1] == reports[2] and reports[0]["virtual_stages"] == 2


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--schedule", "1fb"], "pipeline.schedule='1fb': choose one of"),
        (["--schedule", "1f1b", "--microbatches", "3"], "pipeline.microbatches=3"),
        (["--schedule", "1f1b", "--times", "1"], "--times '1': expected F,B or F,B,W"),
        (
            ["--schedule", "1f1b", "--virtual-stages", "2"],
            "pipeline.virtual_stages=2 needs pipeline.schedule=interleaved",
        ),
    ],
)
def test_cli_bad_input_exits_2(capsys, argv, message):
    base = {"--stages": "4", "--microbatches": "8"}
    for flag, value in zip(argv[::2], argv[1::2]):
        base[flag] = value
    assert main(["pipeline", *[x for kv in base.items() for x in kv]]) == 2
    assert message in capsys.readouterr().err


def test_no_jax_at_import():
    """The command module and a run of it, without the other commands (whose modules may import jax)."""
    code = (
        "import argparse, sys; from jaxpar.pipeline import command; parser = argparse.ArgumentParser(); "
        "command.add_arguments(parser); "
        "command.run(parser.parse_args(['--stages', '2', '--microbatches', '2', '--schedule', 'zero_bubble'])); "
        "print('jax' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False" and "bubble:" in out
