"""A chunk's backward cut in two for the split schedules (zero bubble): ``B`` the input gradient,
``W`` the weight gradient from what B hands it (``WeightCut``).

Each weight's gradient contracts a residual (the input of the op the weight multiplies) with the
cotangent of that op's output, and those cotangents are the links of the input gradient's chain. Run
for the weight gradient alone, the whole pullback would compute that chain again. Instead its jaxpr is
cut by data dependence:

- B runs the equations the input gradient needs, and hands W the values it computed that W reads (each
  weight op's output cotangent); nothing else.
- W runs the rest from the residuals, the seeds and the handoff. Equations that do not depend on the
  seeds (a remat region's recomputed forward, a residual's transpose) run in W again rather than be
  handed over, so W never holds a forward activation B did not already have to keep.
- A layer scan is cut inside its body: B's scan hands its part over stacked over the layers, W's scan
  reads it back layer by layer. A ``cond`` (a pipeline's padding rows skipped as a branch) is cut in
  each branch: B's ``cond`` hands over every branch's slots (zeros but the taken one's), W's reads the
  taken one's. ``jit`` and remat regions are inlined first, so their parts are cut too.

Any other equation that computes both runs whole in B; where a weight gradient itself would then be
handed over, the cut saves nothing and ``WeightCut.clean`` is False (the caller runs the whole pullback
for W instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from jax._src import core  # no public API evaluates a jaxpr equation by equation

_INLINED = frozenset({"jit", "pjit", "remat2", "checkpoint"})
_B, _W, _BOTH = "B", "W", "BW"  # runs in B; in W; in both (it does not depend on the seeds)


def _inner(eqn) -> tuple[core.Jaxpr, list]:
    j = eqn.params["jaxpr"]
    return (j.jaxpr, list(j.consts)) if isinstance(j, core.ClosedJaxpr) else (j, [])


def _bind(eqn, values):
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return out if eqn.primitive.multiple_results else [out]


def _scan_parts(eqn, values):
    c, k = eqn.params["num_consts"], eqn.params["num_carry"]
    return values[:c], values[c : c + k], values[c + k :]


def _run_scan(eqn, step: Callable, carry, xs):
    p = eqn.params
    return jax.lax.scan(step, carry, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])


def _inlined(jaxpr: core.Jaxpr, consts, args) -> list:
    """``jaxpr`` evaluated with its ``jit`` and remat regions inlined (also inside scan bodies and
    branches)."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        if eqn.primitive.name in _INLINED:
            out = _inlined(*_inner(eqn), values)
        elif eqn.primitive.name == "scan":
            body, body_consts = _inner(eqn)
            consts_, carry, xs = _scan_parts(eqn, values)
            k = len(carry)

            def step(carry, x, body=body, body_consts=body_consts, consts_=consts_, k=k):
                outs = _inlined(body, body_consts, [*consts_, *carry, *x])
                return outs[:k], outs[k:]

            carry, ys = _run_scan(eqn, step, carry, xs)
            out = [*carry, *ys]
        elif eqn.primitive.name == "cond":
            inlined = lambda b: lambda *ops: _inlined(b.jaxpr, b.consts, ops)
            out = jax.lax.switch(values[0], [inlined(b) for b in eqn.params["branches"]], *values[1:])
        else:
            out = _bind(eqn, values)
        env.update(zip(eqn.outvars, out))
    return [read(v) for v in jaxpr.outvars]


def _placed(n: int, at: list[int], values) -> list:
    """A list of ``n`` with ``values`` at the positions ``at`` and None elsewhere."""
    out = [None] * n
    for j, x in zip(at, values):
        out[j] = x
    return out


def _vars(atoms) -> list:
    return [v for v in atoms if isinstance(v, core.Var)]


def _seeded(jaxpr: core.Jaxpr, seeded_in: Sequence[bool]) -> set:
    """The variables of ``jaxpr`` that depend on the inputs marked in ``seeded_in``."""
    seeded = {v for v, s in zip(jaxpr.invars, seeded_in) if s}
    for eqn in jaxpr.eqns:
        ins = [isinstance(v, core.Var) and v in seeded for v in eqn.invars]
        if eqn.primitive.name == "scan":
            outs = _ScanCut.seeded(eqn, ins)[1]
        elif eqn.primitive.name == "cond":
            outs = _CondCut.seeded(eqn, ins)
        else:
            outs = [any(ins)] * len(eqn.outvars)
        seeded |= {v for v, s in zip(eqn.outvars, outs) if s}
    return seeded


@dataclasses.dataclass
class _Plan:
    """Where each equation of a jaxpr runs, and what B hands W (``handoff``)."""

    jaxpr: core.Jaxpr
    roles: list  # per equation: _B, _W, _BOTH, a _Cut, or None (needed by neither)
    handoff: list  # the variables B computes (or reads) that W reads
    need_b: set
    need_w: set
    clean: bool


def _plan(jaxpr: core.Jaxpr, b_outs: Sequence[bool], seeded_in: Sequence[bool], for_w: set) -> _Plan:
    """Cuts ``jaxpr``, whose outputs marked in ``b_outs`` are B's. ``seeded_in``: the inputs that depend
    on the seeds; ``for_w``: the inputs W is given (the others, if W reads them, are handed over)."""
    seeded = _seeded(jaxpr, seeded_in)
    need_b = set(_vars(v for v, b in zip(jaxpr.outvars, b_outs) if b))
    need_w = set(_vars(v for v, b in zip(jaxpr.outvars, b_outs) if not b))
    roles: list = [None] * len(jaxpr.eqns)
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        ob, ow = [v in need_b for v in eqn.outvars], [v in need_w for v in eqn.outvars]
        ins = set(_vars(eqn.invars))
        if not any(ob) and not any(ow):
            continue
        unseeded = not any(v in seeded for v in ins)
        if not any(ob) or (unseeded and any(ow)):
            roles[i] = _W if not any(ob) else _BOTH
            need_w |= ins
            need_b |= ins if any(ob) else set()
        elif eqn.primitive.name in _CUTS and any(w and not b for b, w in zip(ob, ow)):
            roles[i] = cut = _CUTS[eqn.primitive.name].of(eqn, ob, [v in seeded for v in eqn.invars])
            need_b |= _reads(eqn, cut.b_reads)
            need_w |= _reads(eqn, cut.w_reads)
        else:
            roles[i] = _B
            need_b |= ins
    in_b = set()
    for eqn, r in zip(jaxpr.eqns, roles):
        marks = r.b_outs if isinstance(r, _Cut) else [r == _B] * len(eqn.outvars)
        in_b |= {v for v, b in zip(eqn.outvars, marks) if b}
    handoff = [v for v in [*jaxpr.invars, *[o for e in jaxpr.eqns for o in e.outvars]] if v in need_w]
    handoff = [v for v in handoff if v in in_b or (v in set(jaxpr.invars) and v not in for_w)]
    w_outs = set(_vars(v for v, b in zip(jaxpr.outvars, b_outs) if not b))
    clean = not w_outs & set(handoff) and all(r.clean for r in roles if isinstance(r, _Cut))
    return _Plan(jaxpr, roles, handoff, need_b, need_w, clean)


def _reads(eqn, marks: list[bool]) -> set:
    return set(_vars(v for v, m in zip(eqn.invars, marks) if m))


class _Cut:
    """An equation both parts need, cut inside (``_ScanCut``, ``_CondCut``)."""


@dataclasses.dataclass
class _ScanCut(_Cut):
    """A scan whose outputs both parts need, cut inside its body: B's scan runs the body's B part on the
    carries B needs (``b_carry``) and hands the body's handoff over stacked; W's scan runs the rest."""

    body: _Plan
    body_consts: list
    b_carry: list[bool]
    b_outs: list[bool]  # per scan output: B's scan computes it
    b_reads: list[bool]  # per scan input: B's scan reads it
    w_reads: list[bool]

    @staticmethod
    def seeded(eqn, seeded_in: list[bool]) -> tuple[list[bool], list[bool]]:
        """(the body's inputs, the scan's outputs) that depend on the seeds, given its inputs'."""
        body, _ = _inner(eqn)
        c, k = eqn.params["num_consts"], eqn.params["num_carry"]
        carry = list(seeded_in[c : c + k])
        while True:
            ins = [*seeded_in[:c], *carry, *seeded_in[c + k :]]
            s = _seeded(body, ins)
            out = [isinstance(v, core.Var) and v in s for v in body.outvars]
            grown = [a or b for a, b in zip(carry, out[:k])]
            if grown == carry:
                return ins, out
            carry = grown

    @classmethod
    def of(cls, eqn, outs_b: list[bool], seeded_in: list[bool]) -> _ScanCut:
        body, body_consts = _inner(eqn)
        c, k = eqn.params["num_consts"], eqn.params["num_carry"]
        b_carry = list(outs_b[:k])
        seeded_body = cls.seeded(eqn, seeded_in)[0]
        while True:
            carry_in = body.invars[c : c + k]
            for_w = {v for j, v in enumerate(carry_in) if not b_carry[j]} | set(body.invars[:c] + body.invars[c + k :])
            plan = _plan(body, [*b_carry, *outs_b[k:]], seeded_body, for_w)
            grown = [b or v in plan.need_b for b, v in zip(b_carry, carry_in)]
            if grown == b_carry:
                break
            b_carry = grown
        in_b = lambda j, v: v in plan.need_b if not c <= j < c + k else b_carry[j - c]
        in_w = lambda j, v: v in plan.need_w if not c <= j < c + k else not b_carry[j - c]
        b_reads = [in_b(j, v) for j, v in enumerate(body.invars)]
        w_reads = [in_w(j, v) for j, v in enumerate(body.invars)]
        return cls(plan, body_consts, b_carry, [*b_carry, *outs_b[k:]], b_reads, w_reads)

    @property
    def clean(self) -> bool:
        return self.body.clean

    def nested(self, flat) -> list:
        return _nested(self.body, flat)

    def run_b(self, eqn, values) -> tuple[list, list]:
        """(the scan's outputs B computes, in order, None for W's; the body's handoff, stacked)."""
        consts, carry, xs = _scan_parts(eqn, values)
        k = len(carry)
        mine = [j for j in range(k) if self.b_carry[j]]

        def step(bc, x):
            outs, handoff = _run(self.body, self.body_consts, [*consts, *_placed(k, mine, bc), *x], None)
            return [outs[j] for j in mine], (outs[k:], handoff)

        bc, (ys, handoff) = _run_scan(eqn, step, [carry[j] for j in mine], xs)
        return [*_placed(k, mine, bc), *ys], handoff

    def run_w(self, eqn, values, handoff) -> list:
        """The scan's outputs W computes (None for B's), from the stacked ``handoff``."""
        consts, carry, xs = _scan_parts(eqn, values)
        c, k = len(consts), len(carry)
        used = [j for j in range(len(xs)) if self.w_reads[c + k + j]]
        mine = [j for j in range(k) if not self.b_carry[j]]

        def step(wc, inputs):
            x_used, h = inputs
            full = [*consts, *_placed(k, mine, wc), *_placed(len(xs), used, x_used)]
            outs = _run(self.body, self.body_consts, full, h)
            return [outs[j] for j in mine], outs[k:]

        wc, ys = _run_scan(eqn, step, [carry[j] for j in mine], ([xs[j] for j in used], handoff))
        return [*_placed(k, mine, wc), *ys]


@dataclasses.dataclass
class _CondCut(_Cut):
    """A ``cond`` whose outputs both parts need, cut in each branch: B's ``cond`` returns every branch's
    handoff slots (the taken branch's filled, the others zeros), W's reads the taken branch's."""

    plans: list  # per branch: its _Plan
    consts: list  # per branch: its jaxpr's consts
    b_outs: list[bool]
    b_reads: list[bool]  # per input (the branch index first)
    w_reads: list[bool]

    @staticmethod
    def seeded(eqn, seeded_in: list[bool]) -> list[bool]:
        outs = [seeded_in[0]] * len(eqn.outvars)
        for branch in eqn.params["branches"]:
            s = _seeded(branch.jaxpr, seeded_in[1:])
            outs = [o or (isinstance(v, core.Var) and v in s) for o, v in zip(outs, branch.jaxpr.outvars)]
        return outs

    @classmethod
    def of(cls, eqn, outs_b: list[bool], seeded_in: list[bool]) -> _CondCut:
        branches = eqn.params["branches"]
        plans = [_plan(b.jaxpr, outs_b, seeded_in[1:], set(b.jaxpr.invars)) for b in branches]
        reads = lambda need: (
            [True] + [any(p.jaxpr.invars[j] in getattr(p, need) for p in plans) for j in range(len(eqn.invars) - 1)]
        )
        consts = [list(b.consts) for b in branches]
        return cls(plans, consts, list(outs_b), reads("need_b"), reads("need_w"))

    @property
    def clean(self) -> bool:
        return all(p.clean for p in self.plans)

    def nested(self, flat) -> list:
        return [_nested(p, flat) for p in self.plans]

    def run_b(self, eqn, values) -> tuple[list, list]:
        """(the outputs B computes, None for W's; every branch's handoff slots)."""
        index, ops = values[0], values[1:]
        avals = [v.aval for v in self.plans[0].jaxpr.invars]
        shapes = [
            jax.eval_shape(lambda *xs, p=p, c=c: _run(p, c, xs, None)[1], *avals)
            for p, c in zip(self.plans, self.consts)
        ]
        zeros = [jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), h) for h in shapes]

        def branch(k):
            def run(ops):
                outs, handoff = _run(self.plans[k], self.consts[k], ops, None)
                return outs, [handoff if j == k else z for j, z in enumerate(zeros)]

            return run

        return jax.lax.switch(index, [branch(k) for k in range(len(self.plans))], ops)

    def run_w(self, eqn, values, handoff) -> list:
        """The outputs W computes (None for B's), from the taken branch's ``handoff`` slots."""
        index, ops = values[0], values[1:]

        def branch(k):
            return lambda ops, handoff: _run(self.plans[k], self.consts[k], ops, handoff[k])

        return jax.lax.switch(index, [branch(k) for k in range(len(self.plans))], ops, handoff)


def _run(plan: _Plan, consts, args, handoff):
    """B (``handoff`` None): (B's outputs, None for W's; the handoff). W: W's outputs, None for B's."""
    jaxpr, part = plan.jaxpr, _B if handoff is None else _W
    env = dict(zip(jaxpr.constvars, consts)) | {v: x for v, x in zip(jaxpr.invars, args) if x is not None}
    stacked = iter(handoff[len(plan.handoff) :]) if part == _W else None
    if part == _W:
        env.update(zip(plan.handoff, handoff))
    read = lambda v: v.val if isinstance(v, core.Literal) else env[v]
    scans: list = []
    for eqn, role in zip(jaxpr.eqns, plan.roles):
        if isinstance(role, _Cut):
            marks = role.b_reads if part == _B else role.w_reads
            values = [read(v) if m else None for v, m in zip(eqn.invars, marks)]
            if part == _B:
                out, h = role.run_b(eqn, values)
                scans.append(h)
            else:
                out = role.run_w(eqn, values, next(stacked))
        elif role == _BOTH or role == part:
            out = _bind(eqn, [read(v) for v in eqn.invars])
        else:
            continue
        env.update((v, x) for v, x in zip(eqn.outvars, out) if x is not None)
    mine = plan.need_b if part == _B else plan.need_w
    outs = [read(v) if isinstance(v, core.Literal) or v in mine else None for v in jaxpr.outvars]
    return (outs, [env[v] for v in plan.handoff] + scans) if part == _B else outs


def _nested(plan: _Plan, flat) -> list:
    """The flat handoff (an iterator) in the nesting ``_run`` gives it: the plan's own, then each cut
    scan's."""
    return [next(flat) for _ in plan.handoff] + [r.nested(flat) for r in plan.roles if isinstance(r, _Cut)]


_CUTS = {"scan": _ScanCut, "cond": _CondCut}


@dataclasses.dataclass(frozen=True)
class WeightCut:
    """``fn(primals, seeds) -> (weight_grads, input_grads)`` cut in two: ``backward(primals, seeds)``
    gives (input_grads, handoff), ``weights(primals, seeds, handoff)`` the weight gradients. ``primals``
    and ``seeds`` are pytrees of arrays; the outputs' trees are ``fn``'s."""

    jaxpr: core.ClosedJaxpr
    plan: _Plan
    trees: tuple  # (input tree, weight-gradient tree, input-gradient tree)
    n_weights: int

    @classmethod
    def of(cls, fn: Callable, primals, seeds) -> WeightCut:
        flat_in, in_tree = jax.tree.flatten((primals, seeds))
        flat = lambda *xs: jax.tree.leaves(fn(*jax.tree.unflatten(in_tree, xs)))
        out_shape = jax.eval_shape(fn, primals, seeds)
        dw_tree, dx_tree = (jax.tree.structure(t) for t in out_shape)
        traced = jax.make_jaxpr(flat)(*flat_in)
        closed = jax.make_jaxpr(lambda *xs: _inlined(traced.jaxpr, traced.consts, xs))(*flat_in)
        n_w, n_seeds = dw_tree.num_leaves, len(jax.tree.leaves(seeds))
        seeded = [False] * (len(flat_in) - n_seeds) + [True] * n_seeds
        b_outs = [False] * n_w + [True] * dx_tree.num_leaves
        plan = _plan(closed.jaxpr, b_outs, seeded, set(closed.jaxpr.invars))
        return cls(closed, plan, (in_tree, dw_tree, dx_tree), n_w)

    @property
    def clean(self) -> bool:
        """True where W's work is its own: no weight gradient is computed in B and handed over."""
        return self.plan.clean

    def backward(self, primals, seeds):
        """(the input gradients, the handoff: a flat list of arrays)."""
        outs, handoff = _run(self.plan, self.jaxpr.consts, jax.tree.leaves((primals, seeds)), None)
        return jax.tree.unflatten(self.trees[2], outs[self.n_weights :]), jax.tree.leaves(handoff)

    def weights(self, primals, seeds, handoff):
        handoff = _nested(self.plan, iter(handoff))
        outs = _run(self.plan, self.jaxpr.consts, jax.tree.leaves((primals, seeds)), handoff)
        return jax.tree.unflatten(self.trees[1], outs[: self.n_weights])
