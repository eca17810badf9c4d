"""A stage's backward cut in two without doing any work twice: B, what the input cotangent needs
(the previous stage waits for it), and W, the rest (the weight gradients), which runs at a later
tick from what B hands it.

The backward is a jaxpr (the pullback of the stage's forward). Its equations are sorted by
liveness: B runs the ones the input cotangent needs; W runs the ones the weight gradients need
that B did not already run. A value B computed and W reads is a *boundary* value: B returns it
and the executor keeps it until W.

The layers' backward is one `scan` whose body does both: it carries the hidden state's
cotangent down the layers (B) and emits each layer's weight gradients (W), which read that
cotangent. Such a scan is split too: B runs the scan of the carried chain and also emits, per
layer, the body values W's equations read (a linear layer's output cotangent, say); W runs a
scan of the remaining equations over those. Per layer a linear's backward thus runs its
input-gradient matmul in B and its weight-gradient matmul in W, the split the zero-bubble
papers make (Qi et al., 2024). Other equations with sub-jaxprs (calls, branches) are not split:
one that both parts need runs in B.
"""
from __future__ import annotations

import dataclasses

import jax
from jax import lax
from jax._src import source_info_util
from jax.extend import core as jcore

from xtrain.lowering.pipeline.branching import varying as varying_of
from xtrain.lowering.pipeline.branching import widen

Var = jcore.Var


def _reads(eqn) -> list:
    return [v for v in eqn.invars if isinstance(v, Var)]


def _live(eqns, needed) -> tuple[list[int], set]:
    """(indices of the equations that `needed` vars depend on, every var they read or define
    that is live), by reverse liveness; a sub-jaxpr counts as one op."""
    live, kept = {v for v in needed if isinstance(v, Var)}, []
    for k in reversed(range(len(eqns))):
        if any(v in live for v in eqns[k].outvars):
            kept.append(k)
            live.update(_reads(eqns[k]))
    return kept[::-1], live


# ops W redoes from their inputs rather than have B hand over their result: views and casts
_CHEAP = frozenset({"reshape", "transpose", "convert_element_type", "squeeze", "expand_dims", "broadcast_in_dim",
                    "pvary", "pcast", "copy", "copy_p"})


def _push_down(eqns, boundary: set, w_run: set[int], b_defined: set, varying: frozenset) -> set:
    """Moves into W (`w_run`, equation indices) the equations of `boundary` vars (B-defined vars
    W reads) that W should redo from their inputs rather than have B hand over: views and casts,
    and any value that varies over fewer of the `varying` axes than the buffer that would keep it
    (a buffer written at a stage's own slot varies over the pipeline axis; a value read back
    from it would not have its var's type, and such a value depends only on what W has too).
    Their inputs join the boundary where B defines them. Returns the boundary."""
    defs = {v: k for k, eqn in enumerate(eqns) for v in eqn.outvars}
    todo = list(boundary)
    while todo:
        v = todo.pop()
        k = defs.get(v)
        if k is None or (eqns[k].primitive.name not in _CHEAP and varying <= varying_of(v.aval)):
            continue
        boundary.discard(v)
        w_run.add(k)
        for u in _reads(eqns[k]):
            if u in b_defined and u not in boundary:
                boundary.add(u)
                todo.append(u)
    return boundary


def _in_order(jaxpr, vars_: set) -> tuple:
    """`vars_` in the order `jaxpr` defines them (inputs first)."""
    order = list(jaxpr.invars) + [v for eqn in jaxpr.eqns for v in eqn.outvars]
    return tuple(v for v in order if v in vars_)


def _run(eqns, env: dict) -> None:
    """Evaluates `eqns` into `env` (var -> value), as jax.core.eval_jaxpr does."""
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for eqn in eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = eqn.primitive.bind(*map(read, eqn.invars), **params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if isinstance(v, Var))


@dataclasses.dataclass(frozen=True)
class _Scan:
    """One scan equation split into its B part and its W part (module docstring)."""

    eqn: object
    b_eqns: tuple           # body equations B runs
    b_carry: tuple          # carry positions B runs
    b_ys: tuple             # ys positions B's caller reads
    w_eqns: tuple           # body equations W runs
    w_carry: tuple          # carry positions W runs (those B does not)
    w_ys: tuple             # ys positions W's caller reads
    boundary: tuple         # body vars B emits per iteration for W

    @staticmethod
    def of(eqn, b_out: list[bool], w_out: list[bool], varying: frozenset) -> "_Scan":
        body = eqn.params["jaxpr"].jaxpr
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        carry_in = body.invars[nc:nc + nk]

        def settle(out: list[bool], also: frozenset = frozenset()):
            """Equations and carries needed for the outputs `out`, the carries to a fixpoint;
            carries in `also` come from elsewhere (B's), so they do not pull in their chain."""
            carry = [o for o in out[:nk]]
            while True:
                needed = [v for v, u in zip(body.outvars, carry + list(out[nk:])) if u]
                kept, live = _live(body.eqns, needed)
                wider = [c or (v in live and k not in also) for k, (c, v) in enumerate(zip(carry, carry_in))]
                if wider == carry:
                    return kept, live, tuple(k for k, c in enumerate(carry) if c)
                carry = wider

        b_kept, _, b_carry = settle(b_out)
        b_defined = {v for k in b_kept for v in body.eqns[k].outvars} | {carry_in[k] for k in b_carry}
        w_kept, w_live, w_carry = settle(w_out, frozenset(b_carry))
        w_eqns = {k for k in w_kept if not all(v in b_defined for v in body.eqns[k].outvars if v in w_live)}
        reads = {v for k in w_eqns for v in _reads(body.eqns[k])}
        reads |= {v for v, u in zip(body.outvars, w_out) if u and isinstance(v, Var)}
        handed = {v for v in b_defined if not (v in carry_in and carry_in.index(v) in w_carry)}
        boundary = _push_down(body.eqns, reads & handed, w_eqns, handed, varying)
        return _Scan(eqn, tuple(body.eqns[k] for k in b_kept), b_carry,
                     tuple(k for k, u in enumerate(b_out[nk:]) if u), tuple(body.eqns[k] for k in sorted(w_eqns)),
                     w_carry, tuple(k for k, u in enumerate(w_out[nk:]) if u), _in_order(body, boundary))

    def _pieces(self, env: dict):
        eqn = self.eqn
        closed, nc, nk = eqn.params["jaxpr"], eqn.params["num_consts"], eqn.params["num_carry"]
        body = closed.jaxpr
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        outer = list(map(read, eqn.invars))
        base = dict(zip(body.constvars, closed.consts))
        base.update(zip(body.invars[:nc], outer[:nc]))
        return body, nc, nk, outer, base

    def run_b(self, env: dict) -> list:
        """Runs B's scan into `env`; returns the boundary, stacked over the iterations."""
        body, nc, nk, outer, base = self._pieces(env)
        carry_in, xs_in = body.invars[nc:nc + nk], body.invars[nc + nk:]

        def step(carry, xs):
            local = dict(base)
            local.update((carry_in[k], c) for k, c in zip(self.b_carry, carry))
            local.update(zip(xs_in, xs))
            _run(self.b_eqns, local)
            read = lambda v: v.val if isinstance(v, jcore.Literal) else local[v]
            return ([read(body.outvars[k]) for k in self.b_carry],
                    ([read(body.outvars[nk + k]) for k in self.b_ys], [local[v] for v in self.boundary]))

        carry, (ys, boundary) = lax.scan(step, [outer[nc + k] for k in self.b_carry], outer[nc + nk:],
                                         length=self.eqn.params["length"], reverse=self.eqn.params["reverse"])
        env.update((self.eqn.outvars[k], c) for k, c in zip(self.b_carry, carry))
        env.update((self.eqn.outvars[nk + k], y) for k, y in zip(self.b_ys, ys))
        return boundary

    def run_w(self, env: dict, boundary: list) -> None:
        """Runs W's scan into `env` from B's boundary."""
        body, nc, nk, outer, base = self._pieces(env)
        carry_in, xs_in = body.invars[nc:nc + nk], body.invars[nc + nk:]

        def step(carry, xs):
            xs, edge = xs
            local = dict(base)
            local.update((carry_in[k], c) for k, c in zip(self.w_carry, carry))
            local.update(zip(xs_in, xs))
            local.update(zip(self.boundary, edge))
            _run(self.w_eqns, local)
            read = lambda v: v.val if isinstance(v, jcore.Literal) else local[v]
            return [read(body.outvars[k]) for k in self.w_carry], [read(body.outvars[nk + k]) for k in self.w_ys]

        carry, ys = lax.scan(step, [outer[nc + k] for k in self.w_carry], (outer[nc + nk:], boundary),
                             length=self.eqn.params["length"], reverse=self.eqn.params["reverse"])
        env.update((self.eqn.outvars[k], c) for k, c in zip(self.w_carry, carry))
        env.update((self.eqn.outvars[nk + k], y) for k, y in zip(self.w_ys, ys))


class SplitBackward:
    """`closed` (a backward jaxpr) as B -> (its outputs marked in `b_out`, boundary) and
    W(boundary) -> the other outputs. Both take `closed`'s inputs. `varying`: the mesh axes the
    buffers that keep the boundary vary over (_push_down)."""

    def __init__(self, closed, b_out: list[bool], varying: frozenset = frozenset()):
        self.closed = jaxpr = closed
        eqns, outs = jaxpr.jaxpr.eqns, jaxpr.jaxpr.outvars
        self.b_out = list(b_out)
        b_kept, b_live = _live(eqns, [v for v, b in zip(outs, b_out) if b])
        w_kept, w_live = _live(eqns, [v for v, b in zip(outs, b_out) if not b])
        # what B computes: every output of its equations, of a scan only what B reads (a scan
        # W needs more of is split)
        b_defined = {v for k in b_kept for v in eqns[k].outvars
                     if eqns[k].primitive.name != "scan" or v in b_live}
        both = set(b_kept)
        w_run: set[int] = set()
        scans: dict[int, _Scan] = {}
        for k in w_kept:
            eqn = eqns[k]
            wanted = [v in w_live for v in eqn.outvars]
            if all(v in b_defined for v, w in zip(eqn.outvars, wanted) if w):
                continue
            w_run.add(k)
            if k in both and eqn.primitive.name == "scan":
                scans[k] = _Scan.of(eqn, [v in b_live for v in eqn.outvars],
                                    [w and v not in b_defined for v, w in zip(eqn.outvars, wanted)], varying)
        reads = {v for k in w_run for v in _reads(eqns[k])}
        reads |= {v for v, b in zip(outs, b_out) if not b and isinstance(v, Var)}
        self.boundary = _in_order(jaxpr.jaxpr, _push_down(eqns, reads & b_defined, w_run, b_defined, varying))
        self.steps = [scans.get(k, eqns[k]) for k in b_kept]   # B's: equations and split scans, in order
        self.w_steps = [scans.get(k, eqns[k]) for k in sorted(w_run)]
        self.scans = [s for s in self.steps if isinstance(s, _Scan)]

    def _env(self, args: list) -> dict:
        jaxpr = self.closed.jaxpr
        env = dict(zip(jaxpr.constvars, self.closed.consts))
        env.update(zip(jaxpr.invars, args))
        return env

    def _outs(self, env: dict, b: bool) -> list:
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        return [read(v) for v, m in zip(self.closed.jaxpr.outvars, self.b_out) if m == b]

    def b(self, *args) -> tuple[list, list]:
        """(B's outputs, the boundary: top-level values, then each split scan's stacked ones)."""
        env, per_scan = self._env(list(args)), []
        for step in self.steps:
            if isinstance(step, _Scan):
                per_scan.append(step.run_b(env))
            else:
                _run([step], env)
        return self._outs(env, True), [env[v] for v in self.boundary] + [x for xs in per_scan for x in xs]

    def w(self, boundary: list, *args) -> list:
        """W's outputs from B's boundary (kept elsewhere meanwhile: each value is cast back to
        vary over the mesh axes B's varied over)."""
        boundary = [widen(x, varying_of(v.aval)) for x, v in zip(boundary, self._boundary_vars())]
        env = self._env(list(args))
        env.update(zip(self.boundary, boundary[:len(self.boundary)]))
        rest = boundary[len(self.boundary):]
        for step in self.w_steps:
            if isinstance(step, _Scan):
                n = len(step.boundary)
                step.run_w(env, rest[:n])
                rest = rest[n:]
            else:
                _run([step], env)
        return self._outs(env, False)

    def _boundary_vars(self) -> list:
        return list(self.boundary) + [v for scan in self.scans for v in scan.boundary]

    def boundary_avals(self) -> list:
        """Shapes and dtypes of what `b` hands to `w`."""
        out = [v.aval for v in self.boundary]
        for scan in self.scans:
            n = scan.eqn.params["length"]
            out += [jax.core.ShapedArray((n,) + v.aval.shape, v.aval.dtype) for v in scan.boundary]
        return out
