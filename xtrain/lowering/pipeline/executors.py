"""The schedules as loops over ticks, per device, inside shard_map.

    gpipe      a scan over m + p - 1 forward ticks; JAX autodiff of that scan runs the backward
               ticks in reverse and keeps every tick's activations (m microbatches' worth)
    table      1F1B and interleaved: a scan over the schedule table's ticks. At each tick a
               stage takes its microbatch's input (from the neighbour, kept in a buffer until
               its backward) and runs one `jax.vjp` of its chunk: the forward's output goes to
               the next stage, and on a backward tick the cotangent from the next stage gives
               the input cotangent for the previous stage and the parameter gradients. Only
               stage inputs are held (recomputed in the backward tick), in buffers of K slots
               indexed by microbatch mod K: memory independent of m.

Every tick sends one activation forward and one cotangent backward around the ring of stages
(`ppermute`); what a stage receives, and where it keeps it, is read from static tables.
A tick of `table` runs forward and backward on every stage (the masking of lockstep SPMD): a
tick costs F + B whatever the stage does, where a GPipe tick costs F or B; only the warm-up
ticks, before any stage's first backward, run the forward alone.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.lowering.collectives import vma
from xtrain.lowering.pipeline.schedule import V_SHAPED, Kind, Table
from xtrain.lowering.pipeline.stage import microbatch, ring, take


def scan_tree(body, carry, xs, length: int):
    """lax.scan over a pytree carry whose mesh-axis variance may widen in the body: the
    initial carry is widened to what the body returns until the two agree (a fixpoint, since
    widening one carry can widen others that are computed from it)."""
    leaves, tree = jax.tree.flatten(carry)
    seen: list = []

    def flat(values, x):
        new, y = body(jax.tree.unflatten(tree, values), x)
        new = jax.tree.leaves(new)
        seen[:] = [vma(v) for v in new]
        return new, y

    for _ in range(8):
        try:
            final, ys = lax.scan(flat, leaves, xs, length=length)
            return jax.tree.unflatten(tree, final), ys
        except TypeError:
            if not seen:
                raise
            wider = [vma(v) | s for v, s in zip(leaves, seen)]
            if wider == [vma(v) for v in leaves]:
                raise
            leaves = [lax.pcast(v, tuple(sorted(w - vma(v))), to="varying") if w - vma(v) else v
                      for v, w in zip(leaves, wider)]
            seen.clear()
    raise AssertionError("scan carry variance did not settle")


@dataclasses.dataclass(frozen=True)
class TickTables:
    """Static per-(tick, stage) arrays for the table executor. An arrival entry is (valid, chunk,
    slot). The activations travel the ring forward (+1) and the cotangents backward (-1); in a
    V-shaped table (zbv) the second chunk's travel the other way and turn at the last stage
    without leaving it (`turned`: entries of the other direction, then of the stage's own output)."""

    kind: np.ndarray        # (T, p) Kind
    micro: np.ndarray       # (T, p) microbatch
    chunk: np.ndarray       # (T, p) chunk
    act_in: np.ndarray      # (T, p, 3) activation arriving at the end of the tick
    grad_in: np.ndarray     # (T, p, 3) cotangent arriving
    slots: int              # K
    warmup: int             # ticks before the first backward anywhere: forward only
    loss_at: tuple[int, int]  # (stage, chunk) of the last virtual stage: the loss
    turned: np.ndarray | None = None  # V-shaped: (T, p, 4, 3): activation via -1, own; cotangent via +1, own
    pool: np.ndarray | None = None  # zero bubble: (T, p) the buffer slot of each entry's (chunk, microbatch)

    def last(self, stage, chunk):
        """Whether (stage, chunk) (traced) runs the last virtual stage: the loss."""
        return (stage == self.loss_at[0]) & (chunk == self.loss_at[1])


def _arrivals(table: Table, kind: Kind, t: int, s: int, src: int | None = None):
    """What stage s receives from stage `src` (default: its ring neighbour: s - 1 for
    activations, s + 1 for cotangents; s itself: its own output, turning) at the end of tick t:
    (valid, chunk, microbatch)."""
    p = table.stages
    if src is None:
        src = (s - 1) % p if kind == Kind.FORWARD else (s + 1) % p
    op = table.ticks[t][src]
    if op is None or op.kind != kind:
        return 0, 0, 0
    vs = table.virtual_stage(src, op.chunk) + (1 if kind == Kind.FORWARD else -1)
    if not 0 <= vs < table.virtual_stages:
        return 0, 0, 0
    stage, chunk = table.place(vs)
    return (1, chunk, op.microbatch) if stage == s else (0, 0, 0)


def _slots_needed(table: Table, held: dict) -> int:
    """Smallest K such that the microbatches one (stage, chunk) holds at any tick differ mod K
    (held: (stage, chunk) -> microbatch -> [first tick held, last tick used])."""
    span = 1
    for intervals in held.values():
        for t in range(len(table.ticks)):
            live = [i for i, (lo, hi) in intervals.items() if lo <= t <= hi]
            if live:
                span = max(span, max(live) - min(live) + 1)
    return span


def tick_tables(table: Table) -> TickTables:
    T, p = len(table.ticks), table.stages
    kind, micro, chunk = (np.zeros((T, p), np.int32) for _ in range(3))
    act, grad = np.zeros((T, p, 3), np.int32), np.zeros((T, p, 3), np.int32)
    v_shaped = table.name in V_SHAPED
    turned = np.zeros((T, p, 4, 3), np.int32)
    uses: dict = {}  # (stage, chunk) -> microbatch -> [first tick held, backward tick]
    for t, row in enumerate(table.ticks):
        for s, op in enumerate(row):
            if op is not None:
                kind[t, s], micro[t, s], chunk[t, s] = op.kind, op.microbatch, op.chunk
                held = uses.setdefault((s, op.chunk), {}).setdefault(op.microbatch, [t, t])
                held[0], held[1] = min(held[0], t), max(held[1], t)
            entries = [(act[t, s], Kind.FORWARD, None), (grad[t, s], Kind.BACKWARD, None)]
            if v_shaped:  # the other ring direction, then the stage's own output
                entries += [(turned[t, s, 0], Kind.FORWARD, (s + 1) % p), (turned[t, s, 1], Kind.FORWARD, s),
                            (turned[t, s, 2], Kind.BACKWARD, (s - 1) % p), (turned[t, s, 3], Kind.BACKWARD, s)]
            for out, k, src in entries:
                if p == 2 and src is not None and src != s:  # one neighbour, one arrival: counted once
                    continue
                ok, c, i = _arrivals(table, k, t, s, src)
                out[:] = (ok, c, i)
                if ok:
                    held = uses.setdefault((s, c), {}).setdefault(i, [t, t])
                    held[0] = min(held[0], t)
    warmup = int(np.argmax((kind == Kind.BACKWARD).any(axis=1)))
    loss_at = table.place(table.virtual_stages - 1)
    if table.split_backward:  # one pool of slots per stage, shared by its chunks
        slot_of, slots = _pooled(uses, p)
        pool = np.zeros((T, p), np.int32)
        for t, row in enumerate(table.ticks):
            for s, op in enumerate(row):
                if op is not None:
                    pool[t, s] = slot_of[(s, op.chunk, op.microbatch)]
        for entries in (act, grad, turned):
            for index in zip(*np.nonzero(entries[..., 0])):
                s = index[1]
                entries[index][1:] = (0, slot_of[(s, entries[index][1], entries[index][2])])
        return TickTables(kind, micro, chunk, act, grad, slots, warmup, loss_at, turned if v_shaped else None, pool)
    slots = _slots_needed(table, uses)
    for entries in (act, grad):
        entries[..., 2] %= slots
    return TickTables(kind, micro, chunk, act, grad, slots, warmup, loss_at)


def _pooled(uses: dict, p: int) -> tuple[dict, int]:
    """A slot per (stage, chunk, microbatch), from one pool per stage: each held from its first
    arrival to its last use (W), a slot reused only after its last holder's last tick (greedy
    interval colouring, optimal for intervals). Returns ({(stage, chunk, microbatch): slot}, the
    largest pool)."""
    slot_of, size = {}, 1
    for s in range(p):
        spans = sorted((lo, hi, c, i) for (stage, c), held in uses.items() if stage == s
                       for i, (lo, hi) in held.items())
        free_at: list[int] = []  # per slot: the tick after which it is free
        for lo, hi, c, i in spans:
            slot = next((k for k, end in enumerate(free_at) if end < lo), None)
            if slot is None:
                slot = len(free_at)
                free_at.append(hi)
            free_at[slot] = hi
            slot_of[(s, c, i)] = slot
        size = max(size, len(free_at))
    return slot_of, size


def _like(cotangents, primals):
    """Cotangents cast to vary over the mesh axes their primal outputs vary over."""
    def one(ct, x):
        missing = tuple(sorted(vma(x) - vma(ct)))
        return lax.pcast(ct, missing, to="varying") if missing else ct

    return jax.tree.map(one, cotangents, primals)


def store(buffer, arrived, entry):
    """Writes `arrived` into buffer[chunk, slot] when entry's valid flag is set."""
    ok, c, slot = entry[0] == 1, entry[1], entry[2]
    old = buffer[c, slot]
    return buffer.at[c, slot].set(jnp.where(ok, arrived, old))


def gpipe_forward(run, x0: list, batch: list, p: int, m: int, axis: str):
    """(loss sum, count, layer counts) over all microbatches on this stage (the loss nonzero on
    the last stage; layer counts {key: (1, Lc, ...)} summed over the active ticks).

    run(x, (batch_mb, i), active) -> (activation out, sum, count, layer counts) is this stage's
    function."""
    stage = lax.axis_index(axis)
    send = ring(axis, p, 1)

    def tick(carry, t):
        x, total, count = carry
        i = t - stage
        active = (i >= 0) & (i < m)
        i = jnp.clip(i, 0, m - 1)
        y, s, c, counts = run(x, (microbatch(batch, i), i), active)
        zero = jnp.zeros_like(s)
        total, count = total + jnp.where(active, s, zero), count + jnp.where(active, c, zero)
        return ([send(v) for v in y], total, count), masked(counts, active)

    zero = jnp.zeros((), jnp.float32)
    (_, total, count), counts = scan_tree(tick, ([lax.stop_gradient(v) for v in x0], zero, zero),
                                          jnp.arange(m + p - 1), m + p - 1)
    return total, count, {key: c.sum(axis=0)[None] for key, c in counts.items()}


def masked(counts: dict, keep, chunk=None, chunks: int = 1) -> dict:
    """A tick's layer counts where it is a real forward (zero otherwise), at row `chunk` of
    (chunks, Lc, ...) when given."""
    out = {key: jnp.where(keep, c, jnp.zeros_like(c)) for key, c in counts.items()}
    if chunk is None:
        return out
    return {key: jnp.zeros((chunks,) + c.shape, c.dtype).at[chunk].set(c) for key, c in out.items()}


def with_aux(out):
    """Splits a stage function's (activation, sum, count, layer counts) for jax.vjp's has_aux."""
    return out[:3], out[3]


def table_grads(run, chunks: list, other: dict, x0: list, batch: list, tables: TickTables,
                p: int, v: int, axis: str):
    """(loss sum, count, chunk grads (v, Lc, ...), other grads, layer counts {key: (v, Lc, ...)}
    summed over the forward ticks) for the 1F1B-family tables.

    run(chunk_params, other, x, (batch_mb, i), chunk) -> (activation out, sum, count, layer counts)."""
    stage = lax.axis_index(axis)
    forward, backward = ring(axis, p, 1), ring(axis, p, -1)
    K = tables.slots
    # kept inputs and arrived cotangents: (v, K, ...) per activation array; integer carries
    # (a dropout key threaded through the blocks) have no cotangent
    real = [jnp.issubdtype(x.dtype, jnp.inexact) for x in x0]
    buf = lambda xs: [jnp.zeros((v, K) + x.shape, x.dtype) for x in xs]
    last_stage = lambda c: tables.last(stage, c)

    def forward_tick(carry, t):
        """A warm-up tick: no stage runs a backward yet, so no vjp and no cotangents."""
        inputs, cotangents, g_chunks, g_other, total, count = carry
        kind, i, c = take(tables.kind, t)[stage], take(tables.micro, t)[stage], take(tables.chunk, t)[stage]
        y, s, n, counts = run([w[c] for w in chunks], other, [b[c, i % K] for b in inputs],
                              (microbatch(batch, i), i), c)
        keep = (kind == Kind.FORWARD) & last_stage(c)
        total, count = total + jnp.where(keep, s, jnp.zeros_like(s)), count + jnp.where(keep, n, jnp.zeros_like(n))
        act_in = take(tables.act_in, t)[stage]
        inputs = [store(b, forward(a), act_in) for b, a in zip(inputs, y)]
        return (inputs, cotangents, g_chunks, g_other, total, count), masked(counts, kind == Kind.FORWARD, c, v)

    def tick(carry, t):
        inputs, cotangents, g_chunks, g_other, total, count = carry
        kind, i, c = take(tables.kind, t)[stage], take(tables.micro, t)[stage], take(tables.chunk, t)[stage]
        slot = i % K
        x = [b[c, slot] for b in inputs]
        mb = (microbatch(batch, i), i)
        params_c = [w[c] for w in chunks]
        (y, s, n), vjp, counts = jax.vjp(lambda w, o, x: with_aux(run(w, o, x, mb, c)), params_c, other, x,
                                         has_aux=True)
        is_b, is_f, last = kind == Kind.BACKWARD, kind == Kind.FORWARD, last_stage(c)
        gy = iter(_like([jnp.where(is_b & ~last, b[c, slot], jnp.zeros_like(b[c, slot])) for b in cotangents],
                        [a for a, r in zip(y, real) if r]))
        gy = [next(gy) if r else np.zeros(a.shape, jax.dtypes.float0) for a, r in zip(y, real)]
        g_sum = jnp.where(is_b & last, 1.0, 0.0).astype(s.dtype)
        d_chunk, d_other, dx = vjp((gy, *_like((g_sum, jnp.zeros_like(n)), (s, n))))
        g_chunks = [g.at[c].add(d) for g, d in zip(g_chunks, d_chunk)]
        g_other = jax.tree.map(jnp.add, g_other, d_other)
        zero = jnp.zeros_like(s)
        total, count = total + jnp.where(is_f & last, s, zero), count + jnp.where(is_f & last, n, zero)
        act_in, grad_in = take(tables.act_in, t)[stage], take(tables.grad_in, t)[stage]
        inputs = [store(b, forward(a), act_in) for b, a in zip(inputs, y)]
        cotangents = [store(b, backward(d), grad_in) for b, d in zip(cotangents, [d for d, r in zip(dx, real) if r])]
        return (inputs, cotangents, g_chunks, g_other, total, count), masked(counts, is_f, c, v)

    zero = jnp.zeros((), jnp.float32)
    init = (buf(x0), buf([x for x, r in zip(x0, real) if r]), [jnp.zeros_like(w) for w in chunks], jax.tree.map(jnp.zeros_like, other), zero, zero)
    T, warm = tables.kind.shape[0], tables.warmup
    carry, early = scan_tree(forward_tick, init, jnp.arange(warm), warm) if warm else (init, {})
    (_, _, g_chunks, g_other, total, count), counts = scan_tree(tick, carry, jnp.arange(warm, T), T - warm)
    counts = {key: c.sum(axis=0) + (early[key].sum(axis=0) if key in early else 0) for key, c in counts.items()}
    return total, count, g_chunks, g_other, counts
