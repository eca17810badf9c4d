"""Counts the collectives of the emitted program (the jaxpr xtrain hands to XLA), autodiff's
transposes included, with the module path each one serves. XLA may later merge all-reduces;
this count is what xtrain asked for.

With each collective goes the compute it could overlap with: every equation of its program
region (the jaxpr it sits in: the per-device step, or one iteration of a layer scan) that
neither feeds it nor consumes its result. The matmul/convolution FLOPs of those equations are
what a scheduler (XLA's latency-hiding scheduler on GPU and Neuron) can hide it behind; 0 means
the collective is on the critical path wherever it is placed. In a loop body (the layer scan),
a collective whose result feeds no loop carry (a layer's gradients, leaving as the scan's
per-layer output) can finish during the next iteration (XLA's collective pipeliner): it gets
the FLOPs of a whole iteration.

A ragged all-to-all (MoE dispatch and combine on GPU) moves as many rows as the routing sends; it is
counted as an all-to-all of its smaller buffer (the sender's routed rows in the dispatch, the rows
it gets back in the combine: what a device sends when the experts' load is even)."""
from __future__ import annotations

import math

import numpy as np
from jax.extend import core as jcore

from xtrain.ir.analysis import flops
from xtrain.lowering.explicit.registry import FALLBACK_SCOPE
from xtrain.lowering.report import Collective

_KIND = {"psum": "all-reduce", "pmax": "all-reduce", "pmin": "all-reduce", "psum_invariant": "all-reduce",
         "all_gather": "all-gather", "all_gather_invariant": "all-gather", "psum_scatter": "reduce-scatter",
         "reduce_scatter": "reduce-scatter", "ppermute": "collective-permute", "all_to_all": "all-to-all",
         "ragged_all_to_all": "all-to-all"}


def _bytes(avals) -> int:
    return sum(int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize for a in avals)


def _axes(params) -> tuple[str, ...]:
    axes = params.get("axes", params.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _source(eqn, module_paths) -> str:
    stack = str(eqn.source_info.name_stack)
    parts = stack.split("/")
    path = next((p for p in reversed(parts) if any(m == p.split("(")[-1].rstrip(")") for m in module_paths)), None)
    return f"{path.split('(')[-1].rstrip(')')} [{stack}]" if path else stack


def _fallback(eqn) -> str:
    """The primitive whose replicated fallback emitted this collective (its name scope,
    explicit.registry.fallback; a transpose keeps the scope), else ""."""
    for part in reversed(str(eqn.source_info.name_stack).split("/")):
        if FALLBACK_SCOPE in part:
            return part.split(FALLBACK_SCOPE, 1)[1].rstrip(")")
    return ""


def collectives(closed, sizes: dict[str, int], module_paths=frozenset()) -> list[Collective]:
    """Every collective in a (nested) jaxpr, in program order; a scan body's once per iteration.
    A step's per-device program has no dead ones: xtrain.lowering.ordering.in_order stages it
    dead-code eliminated, as XLA compiles it."""
    return _walk(closed.jaxpr, sizes, module_paths)


def _walk(jaxpr, sizes, module_paths, carries: int | None = None) -> list[Collective]:
    """The collectives of one run of `jaxpr`; `carries`: for a scan body, how many of its
    outputs are loop carries."""
    region = Region(jaxpr, carries) if any(str(e.primitive) in _KIND for e in jaxpr.eqns) else None
    found: list[Collective] = []
    for i, eqn in enumerate(jaxpr.eqns):
        name = str(eqn.primitive)
        if name in _KIND:
            axes = _axes(eqn.params)
            groups = eqn.params.get("axis_index_groups")  # a grouped collective: its group's devices
            n = len(groups[0]) if groups else math.prod(sizes[a] for a in axes)
            payload = _bytes([v.aval for v in eqn.invars])
            if name == "ragged_all_to_all":  # (operand, output, offsets and sizes): the rows routed
                payload = min(_bytes([eqn.invars[0].aval]), _bytes([eqn.invars[1].aval]))
            if _KIND[name] == "all-gather":
                payload *= n
            found.append(Collective(_KIND[name], axes, payload, _source(eqn, module_paths), n, region.overlap(i),
                                    _fallback(eqn)))
        for sub in jcore.jaxprs_in_params(eqn.params):
            if name == "scan":  # iteration by iteration
                found += _walk(sub, sizes, module_paths, eqn.params["num_carry"]) * eqn.params["length"]
            else:
                found += _walk(sub, sizes, module_paths)
    return found


# -- overlap ---------------------------------------------------------------------------------------
def _ancestors(jaxpr) -> tuple[list[int], dict]:
    """(per equation, a bitset of the equations it depends on (transitively); var -> index of
    the equation producing it)."""
    producer: dict = {}
    anc: list[int] = []
    for i, eqn in enumerate(jaxpr.eqns):
        bits = 0
        for v in eqn.invars:
            p = producer.get(v) if isinstance(v, jcore.Var) else None
            if p is not None:
                bits |= (1 << p) | anc[p]
        anc.append(bits)
        for v in eqn.outvars:
            producer[v] = i
    return anc, producer


def independent_flops(jaxpr, index: int, anc: list[int], flops: list[float]) -> float:
    """FLOPs of the equations of `jaxpr` that neither feed nor consume equation `index`."""
    mine = 1 << index
    return sum(f for j, f in enumerate(flops)
               if f and j != index and not (anc[index] >> j) & 1 and not anc[j] & mine)


class Region:
    """Dependency facts of one jaxpr, computed once for all its collectives."""

    def __init__(self, jaxpr, carries: int | None = None):
        self.jaxpr = jaxpr
        self.anc, producer = _ancestors(jaxpr)
        self.flops = [flops.of_eqn(e).matmul for e in jaxpr.eqns]
        self.carried = 0  # scan body: bitset of the equations its loop carries depend on
        if carries is not None:
            for v in jaxpr.outvars[:carries]:
                p = producer.get(v) if isinstance(v, jcore.Var) else None
                if p is not None:
                    self.carried |= (1 << p) | self.anc[p]
        self.loop = carries is not None

    def overlap(self, index: int) -> float:
        if self.loop and not (self.carried >> index) & 1:  # pipelined into the next iteration
            return float(sum(self.flops))
        return independent_flops(self.jaxpr, index, self.anc, self.flops)
