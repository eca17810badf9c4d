"""The zero-bubble executor: a scan over a zbh1 or zbv table's ticks (schedule.py) in which every
stage branches on its own entry (`lax.switch` on a per-device index):

    F     the stage's forward, as jax.vjp: the output goes to the next stage; of the pullback's
          residuals, the ones that depend on the microbatch (activations) are kept in slot
          (chunk, microbatch mod K); the ones computed from the weights alone (a cast, a
          transpose) are not: they are the same for every microbatch
    B     the pullback rebuilt from the kept residuals (the weight-only ones recomputed from
          the weights) and applied to the cotangent from the next stage: the input cotangent
          goes to the previous stage; the weight-gradient half is dead code in this branch,
          which XLA removes
    W     the same pullback, keeping the weight gradients (the input-gradient half removed)
    idle  nothing

So a stage runs one F, one B and one W per microbatch and no forward twice: no masked work,
no recomputation. The price is memory: a microbatch's residuals stay from its F to its W
(the table's `held`), where the 1F1B executor keeps only stage inputs and recomputes.

Every tick still sends one activation forward and one cotangent backward around the ring
(outside the branches; zeros where nothing is sent). The collectives inside a stage (tensor,
data, expert axes) run in the branch every device of their group takes, since a group lies
within one stage. Conditionals exist on CPU and GPU; Trainium runs none, so the assembly
refuses zero-bubble schedules for Neuron.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from xtrain.ir.analysis import depends, flops
from xtrain.lowering.pipeline import split_backward
from xtrain.lowering.pipeline.branching import evaluator, switch, varying, widen
from xtrain.lowering.pipeline.executors import TickTables, masked, scan_tree, store, with_aux
from xtrain.lowering.pipeline.schedule import Kind, Table
from xtrain.lowering.pipeline.stage import microbatch, ring, take


class _Forward:
    """One stage's forward as a jaxpr with its pullback's residuals as extra outputs, traced
    once; which residuals depend on the microbatch (kept) and which on the weights alone."""

    def __init__(self, run, probe: tuple):
        box = {}

        def forward(w, o, x, batch_mb, i, c):
            (y, s, n), pull, counts = jax.vjp(lambda w, o, x: with_aux(run(w, o, x, (batch_mb, i), c)), w, o, x,
                                              has_aux=True)
            leaves, box["tree"] = jax.tree.flatten(pull)
            return (y, s, n, counts), leaves

        self.closed, (outs, leaves) = jax.make_jaxpr(forward, return_shape=True)(*probe)
        self.pullback_tree = box["tree"]
        self.out_tree = jax.tree.structure(outs)
        n_out, n_res = len(jax.tree.leaves(outs)), len(leaves)
        # what differs per microbatch: its input activation and its batch (the weights, the
        # microbatch and chunk numbers are at hand again at its B and W)
        w, o, x, batch_mb = probe[:4]
        flags = [False] * len(jax.tree.leaves((w, o))) + [True] * len(jax.tree.leaves((x, batch_mb)))
        flags += [False] * (len(self.closed.jaxpr.invars) - len(flags))
        dynamic = depends.outputs(self.closed.jaxpr, flags)[n_out:]
        self.kept = [k for k in range(n_res) if dynamic[k]]
        self.kept_avals = [self.closed.out_avals[n_out + k] for k in self.kept]
        self.out_avals = self.closed.out_avals[:n_out]
        self._n_out, self._n_res = n_out, n_res
        self._run = evaluator(self.closed, [True] * n_out + dynamic)
        self._static = evaluator(self.closed, [False] * n_out + [not d for d in dynamic])

    def __call__(self, *args):
        """(y, s, n, counts) and the kept residuals."""
        outs = self._run(*jax.tree.leaves(args))
        return jax.tree.unflatten(self.out_tree, outs[:self._n_out]), outs[self._n_out:]

    def pullback(self, kept: list, *args):
        """The pullback of the forward of `args` (its microbatch part only shapes the static
        residuals' computation, which does not read it) with `kept` residuals."""
        static = iter(self._static(*jax.tree.leaves(args)))
        kept_at = dict(zip(self.kept, kept))
        leaves = [kept_at[k] if k in kept_at else next(static) for k in range(self._n_res)]
        return jax.tree.unflatten(self.pullback_tree, leaves)


class _Tick:
    """A stage's forward, B and W traced for one tick's operands (their mesh-axis variance is
    the tick's): the forward with its kept residuals, the backward split into B and W."""

    def __init__(self, run, args: tuple, x0: list, axis: str, saved=None, at=(0, 0)):
        """`saved`: the tick's (kept residuals, cotangents, last); zeros (the probe) if None."""
        self.fwd = fwd = _Forward(run, args)
        self.real = [jnp.issubdtype(x.dtype, jnp.inexact) for x in x0]
        self.y_avals = fwd.out_avals[:len(x0)]
        self.s_aval, self.n_aval = fwd.out_avals[len(x0)], fwd.out_avals[len(x0) + 1]
        self.counts_avals = jax.tree.unflatten(fwd.out_tree, fwd.out_avals)[3]
        self.at = at  # the buffers' (chunk, slot) of this tick's microbatch
        if saved is None:
            kept = [widen(z, varying(a)) for z, a in zip(zeros_of(fwd.kept_avals), fwd.kept_avals)]
            gy = [widen(z, varying(a)) for a, r in zip(self.y_avals, self.real) if r
                  for z in zeros_of([a])]
            saved = (kept, gy, jnp.bool_(False))
        operands = (*args, *saved)
        closed, shapes = jax.make_jaxpr(self._backward, return_shape=True)(*operands)
        self.grads_tree = jax.tree.structure(shapes[1])
        n_dx = len(shapes[0])
        self.split = split_backward.SplitBackward(closed, [k < n_dx for k in range(len(closed.out_avals))],
                                                  frozenset({axis}))

    def _read(self, buffers: tuple) -> list:
        """Each buffer list's entries at this tick's (chunk, slot)."""
        return [[b[self.at] for b in group] for group in buffers]

    def cotangent(self, gy: list, last):
        """The pullback's output cotangent: the next stage's, or the loss seed on the last (whose
        activation output nothing reads: zero, whatever its buffer slot last held)."""
        gy = iter(gy)
        ys = [widen(jnp.where(last, 0, next(gy)), varying(a)) if r else np.zeros(a.shape, jax.dtypes.float0)
              for a, r in zip(self.y_avals, self.real)]
        seed = widen(jnp.where(last, 1.0, 0.0).astype(self.s_aval.dtype), varying(self.s_aval))
        return ys, seed, widen(jnp.zeros(self.n_aval.shape, self.n_aval.dtype), varying(self.n_aval))

    def _backward(self, w, o, x, batch_mb, i, c, kept, gy, last):
        dw, do, dx = self.fwd.pullback(kept, w, o, x, batch_mb, i, c)(self.cotangent(gy, last))
        return [d for d, r in zip(dx, self.real) if r], (dw, do)

    def outputs(self, ops, y=None, kept=None, s=None, n=None, counts=None, dx=None, edge=None, grads=None):
        """One branch's results: zeros where the branch has none; the gradient accumulators as
        they came (`ops`) but in W, which adds to them in place."""
        pick = lambda value, avals: zeros_of(avals) if value is None else value
        scalar = lambda value, aval: jnp.zeros(aval.shape, aval.dtype) if value is None else value
        return (pick(y, self.y_avals), pick(kept, self.fwd.kept_avals), scalar(s, self.s_aval), scalar(n, self.n_aval),
                jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.counts_avals) if counts is None else counts,
                pick(dx, [a for a, r in zip(self.y_avals, self.real) if r]), pick(edge, self.split.boundary_avals()),
                ops[5] if grads is None else grads)

    def branches(self, args) -> list:
        """idle, F, B, W over (inputs, residuals, cotangents, edges, last, (chunk grads, other
        grads)): the buffers are read inside the branch that needs them, the gradients added in
        W's; each returns `outputs` (edge: what B hands to W). `args(inputs)`: the stage
        function's arguments (w, o, x, batch_mb, i, c)."""
        def saved(ops):
            inputs, residuals, cotangents, edges, last, _ = ops
            return (*args(inputs), *self._read((residuals, cotangents)), last)

        def forward(ops):
            (y, s, n, counts), kept = self.fwd(*args(ops[0]))
            return self.outputs(ops, y=y, kept=kept, s=s, n=n, counts=counts)

        def backward(ops):
            dx, edge = self.split.b(*jax.tree.leaves(saved(ops)))
            return self.outputs(ops, dx=dx, edge=edge)

        def weight(ops):
            a = args(ops[0])
            (edge,) = self._read((ops[3],))
            dw, do = jax.tree.unflatten(self.grads_tree, self.split.w(edge, *jax.tree.leaves(saved(ops))))
            g_chunks, g_other = ops[5]
            g_chunks = [g.at[a[5]].add(d) for g, d in zip(g_chunks, dw)]
            return self.outputs(ops, grads=(g_chunks, jax.tree.map(jnp.add, g_other, do)))

        return [lambda ops: self.outputs(ops), forward, backward, weight]


def zeros_of(avals) -> list:
    return [jnp.zeros(a.shape, a.dtype) for a in avals]


def split_grads(run, chunks: list, other: dict, x0: list, batch: list, tables: TickTables, p: int, v: int,
                axis: str, note=None):
    """As executors.table_grads (same arguments and results) for a zero-bubble table; `note`
    tells the report what the buffers hold."""
    stage = lax.axis_index(axis)
    send_forward, send_backward = ring(axis, p, 1), ring(axis, p, -1)
    K = tables.slots
    # the buffers' shapes: each tick traces its stage again at its operands' mesh-axis variance,
    # which the scan's carry settles
    probe = _Tick(run, ([w[0] for w in chunks], other, list(x0), microbatch(batch, 0), jnp.int32(0), jnp.int32(0)),
                  x0, axis)
    shapes = lambda t: ([a.shape for a in t.fwd.kept_avals], [a.shape for a in t.split.boundary_avals()])
    params = (lambda c: [w[0] for w in chunks]) if v == 1 else (lambda c: [w[c] for w in chunks])
    if note is not None:
        size = lambda avals: sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in avals) / 2**20
        kept, edge = size(probe.fwd.kept_avals), size(probe.split.boundary_avals())
        held = "microbatches" if v == 1 else "(microbatch, chunk) pairs, its chunks sharing them"
        note(f"zero bubble: per microbatch{' and chunk' if v > 1 else ''} a stage keeps {kept:.2f} MiB of its forward's "
             f"residuals from F to W, and B hands W {edge:.2f} MiB (the layers' output cotangents); buffers for {K} "
             f"{held}, a scratch slot and the tick's own: {(K + 2) * (kept + edge):.2f} MiB per device")

    def tick(carry, t):
        inputs, residuals, edges, cotangents, g_chunks, g_other, total, count = carry
        kind, i, c = take(tables.kind, t)[stage], take(tables.micro, t)[stage], take(tables.chunk, t)[stage]
        # the buffers: one pool of slots per stage, shared by its chunks (executors.tick_tables)
        bc, slot, last = 0, take(tables.pool, t)[stage], tables.last(stage, c)
        read = lambda buffers: [b[bc, slot] for b in buffers]
        args = lambda inputs: (params(c), other, read(inputs), microbatch(batch, i), i, c)
        # traced at this tick's operands (their mesh-axis variance); these reads feed only the trace
        here = _Tick(run, args(inputs), x0, axis, (read(residuals), read(cotangents), last), (bc, slot))
        if shapes(here) != shapes(probe):
            raise AssertionError("zero-bubble: the stage's residuals differ between two traces")
        y, kept, s, n, counts, dx, edge, (g_chunks, g_other) = switch(
            kind, here.branches(args), (inputs, residuals, cotangents, edges, last, (g_chunks, g_other)))
        is_f, is_b = kind == Kind.FORWARD, kind == Kind.BACKWARD
        total, count = total + jnp.where(is_f & last, s, 0), count + jnp.where(is_f & last, n, 0)
        # a write the tick does not make goes to the scratch slot K
        residuals = [r.at[bc, jnp.where(is_f, slot, K)].set(k) for r, k in zip(residuals, kept)]
        edges = [e.at[bc, jnp.where(is_b, slot, K)].set(k) for e, k in zip(edges, edge)]
        if tables.turned is None:
            inputs = [store(b, send_forward(a), take(tables.act_in, t)[stage]) for b, a in zip(inputs, y)]
            cotangents = [store(b, send_backward(d), take(tables.grad_in, t)[stage]) for b, d in zip(cotangents, dx)]
        else:
            inputs, cotangents = _v_arrivals(tables, t, stage, (send_forward, send_backward if p > 2 else None),
                                             inputs, cotangents, y, dx, is_f, probe.real)
        return (inputs, residuals, edges, cotangents, g_chunks, g_other, total, count), masked(counts, is_f, c, v)

    buf = lambda avals, extra=0: [jnp.zeros((1, K + extra) + tuple(a.shape), a.dtype) for a in avals]
    zero = jnp.zeros((), jnp.float32)
    init = (buf(x0), buf(probe.fwd.kept_avals, 1), buf(probe.split.boundary_avals(), 1),
            buf([a for a, r in zip(probe.y_avals, probe.real) if r]), [jnp.zeros_like(w) for w in chunks],
            jax.tree.map(jnp.zeros_like, other), zero, zero)
    T = tables.kind.shape[0]
    (*_, g_chunks, g_other, total, count), counts = scan_tree(tick, init, jnp.arange(T), T)
    return total, count, g_chunks, g_other, {key: c.sum(axis=0) for key, c in counts.items()}


def _v_arrivals(tables: TickTables, t, stage, sends, inputs, cotangents, y, dx, is_f, real):
    """The buffers after a zbv tick: a stage's one output (an F's activation or a B's cotangent)
    goes one way, by chunk (chunk 0's activations right, its cotangents left; chunk 1's the other
    way round) or stays (the turn at the last stage), so each tick sends one buffer each way
    around the ring (one in all for 2 stages, whose neighbours coincide) and the static tables say
    what each arrival is. `sends`: around the ring forward and backward (None: the same ring)."""
    gy = iter(dx)
    out = [jnp.where(is_f, a, next(gy)) if r else a for a, r in zip(y, real)]  # what this stage computed
    from_left = [sends[0](o) for o in out]
    from_right = from_left if sends[1] is None else [sends[1](o) for o in out]
    entries = take(tables.turned, t)[stage]
    act_in, grad_in = take(tables.act_in, t)[stage], take(tables.grad_in, t)[stage]
    inputs = [store(store(store(b, left, act_in), right, entries[0]), own, entries[1])
              for b, left, right, own in zip(inputs, from_left, from_right, y)]
    arrived = [(left, right) for (left, right), r in zip(zip(from_left, from_right), real) if r]
    cotangents = [store(store(store(b, right, grad_in), left, entries[2]), own, entries[3])
                  for b, (left, right), own in zip(cotangents, arrived, dx)]
    return inputs, cotangents


def _tick_switch(jaxpr):
    """The executor's lax.switch (idle, F, B, W) in a traced step, or None."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond" and len(eqn.params["branches"]) == 4:
            return eqn
        for sub in jcore.jaxprs_in_params(eqn.params):
            found = _tick_switch(getattr(sub, "jaxpr", sub))
            if found is not None:
                return found
    return None


def stage_matmul_flops(program, table: Table) -> list[float]:
    """Per stage, the matmul FLOPs its ticks run in a traced zero-bubble step (`program`, a
    ClosedJaxpr): each tick's branch, where a branch's own branches on `last` (the epilogue
    and its backward) count on the last stage only."""
    eqn = _tick_switch(getattr(program, "jaxpr", program))
    if eqn is None:
        raise ValueError("no zero-bubble tick switch in this program")
    own, last_only = [], []
    for branch in eqn.params["branches"]:
        inner = [e for e in branch.jaxpr.eqns if e.primitive.name == "cond"]
        last_only.append(sum(flops.of_eqn(e).matmul for e in inner))
        own.append(flops.count(branch).matmul - last_only[-1])
    out, loss = [], table.virtual_stages - 1
    for s in range(table.stages):
        ops = [row[s] for row in table.ticks if row[s] is not None]
        out.append(sum(own[int(op.kind)] + (last_only[int(op.kind)] if table.holds(s, op.chunk, loss) else 0)
                       for op in ops))
    return out
