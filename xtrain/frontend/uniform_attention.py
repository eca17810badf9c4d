"""One block structure for the blockwise attention calls of one shape, so that layers which
differ only in their mask stay one family of repeated blocks (the layer scan, pipeline stages).

Gemma-2/3 mix sliding-window and full attention layers. Longer than one attention block, the
kernel gives each call the key blocks its own mask can reach (xtrain.frontend.static_mask): a
window layer visits a band, a full layer everything up to the diagonal, and an unmasked causal
call (sdpa's is_causal) has no mask operand at all. Their jaxprs then differ in structure and
the layers run unrolled.

`Tracer.apply` traces the model the first time it sees an input signature inside a probe
(a nested jaxpr) and records each kernel call: its shape, whether it is causal, its mask's
aval and the key blocks each query block visits. When calls of one shape differ, the model is
traced again with one shared structure per shape: per query block the union of the calls'
key-block ranges; causal when every call sees only keys on or below the diagonal (a causal call,
or a mask whose static bound lies there), else not; a mask operand for every call where any had
one. Each call keeps its own mask (a call without one gets a constant that hides what it hid:
nothing, or the keys above the diagonal), so results are unchanged; the cost is that a call
also computes the key blocks only the other calls' masks reach. Without differences the probe's jaxpr is evaluated into the caller's
trace (a few percent of a trace); later traces of a probed signature apply the shared
structures directly.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from xtrain.ir import walk
from xtrain.ir.kernels.blockwise import Blocking


@dataclasses.dataclass(frozen=True)
class Structure:
    """What makes two calls of one shape the same program: causal, the mask operand's aval
    ((shape, dtype name) or None) and per query block the [start, stop) key blocks visited."""

    causal: bool
    mask: tuple | None
    ranges: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class _Call:
    own: Structure
    within_causal: bool   # sees only keys on or below the diagonal (causal, or its mask's bound)
    lengths: tuple[int, int]  # query and key length


def _ranges(b: Blocking) -> tuple[tuple[int, int], ...]:
    return tuple((r.start, r.stop) for r in (b.key_blocks(i) for i in range(b.n_q)))


def _within_causal(b: Blocking, band) -> bool:
    if b.causal:
        return True
    if band is None or band.ndim < 2 or band.shape[-2:] != (b.length, b.source):
        return False
    above = np.triu(np.ones((b.length, b.source), bool), 1)
    return not np.any(np.asarray(band, bool) & above)


def _covers(shared: Structure, call: _Call) -> bool:
    """Whether `call` can run under `shared` with the same results."""
    own = call.own
    return (len(own.ranges) == len(shared.ranges)
            and all(lo >= slo and hi <= shi for (lo, hi), (slo, shi) in zip(own.ranges, shared.ranges))
            and (own.mask is None or own.mask == shared.mask) and (not shared.causal or call.within_causal))


def _union(calls: list[_Call]) -> Structure | None:
    """One structure every call fits, or None (masks of different avals)."""
    masks = {c.own.mask for c in calls if c.own.mask is not None}
    if len(masks) > 1 or len({len(c.own.ranges) for c in calls}) != 1:
        return None
    causal = all(c.within_causal for c in calls)
    mask = masks.pop() if masks else None
    if mask is None and not causal and any(c.own.causal for c in calls):  # a mask carries the causal calls' causality
        mask = (calls[0].lengths, "bool")
    ranges = tuple((min(r[0] for r in rows), max(r[1] for r in rows)) for rows in zip(*(c.own.ranges for c in calls)))
    return Structure(causal, mask, ranges)


class _Session:
    """The calls of one trace, by shape; `shared` from earlier traces applies where it fits."""

    def __init__(self, shared: dict):
        self.shared = shared
        self.calls: dict[tuple, list[_Call]] = {}
        self.used: dict[tuple, set[Structure]] = {}
        self.constants: dict[tuple, object] = {}  # substitute masks, one per kind (one constant of the program)

    def unify(self) -> bool:
        """Stores a shared structure for each shape whose calls ran with different ones; True
        when any was stored (the model must be traced again)."""
        changed = False
        for shape, used in self.used.items():
            if len(used) < 2:
                continue
            shared = _union(self.calls[shape])
            if shared is not None and self.shared.get(shape) != shared:
                self.shared[shape], changed = shared, True
        return changed


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("xtrain_uniform_attention", default=None)


def _substitute(session: _Session, structure: Structure, b: Blocking):
    """A constant mask of the shared aval that hides what a maskless call hid: nothing, or the
    keys above the diagonal when it was causal (every mask of a shared structure is exact on its
    own; the causal flag only skips blocks, and a ring over `context` uses the mask alone). A
    traced constant (jnp.asarray), so its uses are the same equations as a computed mask's."""
    shape, dtype = structure.mask
    kind = (shape, dtype, b.causal)
    if kind not in session.constants:
        seen = np.ones((b.length, b.source), bool)
        seen = np.broadcast_to(np.tril(seen) if kind[2] else seen, shape)
        value = np.array(seen) if dtype == "bool" else np.where(seen, 0.0, -np.inf).astype(jnp.dtype(dtype))
        session.constants[kind] = value
    return jnp.asarray(session.constants[kind])


def adjust(b: Blocking, query, key, value, mask, band, rng, dropped=None):
    """The Blocking and mask one kernel call runs with: its own, or its shape's shared structure
    (recorded while a `Tracer` probes or applies). `band`: the mask's static bound or None;
    `dropped`: the call's own mask when its causal flag replaced it (it has no mask operand)."""
    session = _SESSION.get()
    if session is None:
        return b, mask
    shape = tuple((tuple(x.shape), str(x.dtype)) for x in (query, key, value)) + (
        b.scale, b.dropout, b.block_q, b.block_k, rng is None)
    own = Structure(b.causal, None if mask is None else (tuple(mask.shape), str(mask.dtype)), _ranges(b))
    call = _Call(own, _within_causal(b, band), (b.length, b.source))
    session.calls.setdefault(shape, []).append(call)
    shared = session.shared.get(shape)
    if shared is None or not _covers(shared, call):
        session.used.setdefault(shape, set()).add(own)
        return b, mask
    session.used.setdefault(shape, set()).add(shared)
    if mask is None and shared.mask is not None:
        own_fits = dropped is not None and (tuple(dropped.shape), str(dropped.dtype)) == shared.mask
        mask = dropped if own_fits else _substitute(session, shared, b)
    return dataclasses.replace(b, causal=shared.causal, visible=shared.ranges), mask


def _signature(leaves, dynamic: list[int], tree, extra) -> tuple:
    return (tree, extra, jax.default_backend(),
            tuple((i in dynamic, tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
                  for i, x in enumerate(leaves)))


class Tracer:
    """Per model: the shared structures found so far and the input signatures probed."""

    def __init__(self):
        self.shared: dict[tuple, Structure] = {}
        self.probed: set[tuple] = set()

    @contextlib.contextmanager
    def _session(self):
        session = _Session(self.shared)
        token = _SESSION.set(session)
        try:
            yield session
        finally:
            _SESSION.reset(token)

    def apply(self, fn, args: tuple, extra=()):
        """fn(*args) traced so that attention calls of one shape share one structure (see the
        module docstring). `extra`: what else the trace depends on (e.g. training mode)."""
        leaves, tree = jax.tree.flatten(args)
        dynamic = [i for i, x in enumerate(leaves) if isinstance(x, jax.core.Tracer)]
        signature = _signature(leaves, dynamic, tree, extra)
        if not dynamic or signature in self.probed:
            with self._session():
                return fn(*args)

        probe = walk.over_dynamic(fn, leaves, tree, dynamic)

        with self._session() as session:
            closed, out_shape = jax.make_jaxpr(probe, return_shape=True)(*[leaves[i] for i in dynamic])
        self.probed.add(signature)
        if session.unify():  # calls of one shape differ: trace again with the shared structures
            with self._session():
                return fn(*args)
        outs = walk.evaluate(closed.jaxpr, closed.consts, [leaves[i] for i in dynamic],
                             lambda eqn, values, _path: walk.bind_eqn(eqn, values))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
