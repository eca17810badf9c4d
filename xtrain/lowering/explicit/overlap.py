"""What compute each collective of the emitted program could overlap with.

A collective can run concurrently with every equation of its program region (the jaxpr it
sits in: the per-device step, or one iteration of a layer scan) that neither feeds it nor
consumes its result. The matmul/convolution FLOPs of those equations are the compute a
scheduler (XLA's latency-hiding scheduler on GPU and Neuron) can hide it behind; 0 means the
collective is on the critical path wherever it is placed.
"""
from __future__ import annotations

from jax.extend import core as jcore

from xtrain.cost import flops


def _ancestors(jaxpr) -> list[int]:
    """Per equation, a bitset of the equations it depends on (transitively)."""
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
    return anc


def independent_flops(jaxpr, index: int, anc: list[int], flops: list[float]) -> float:
    """FLOPs of the equations of `jaxpr` that neither feed nor consume equation `index`."""
    mine = 1 << index
    return sum(f for j, f in enumerate(flops)
               if f and j != index and not (anc[index] >> j) & 1 and not anc[j] & mine)


class Region:
    """Dependency facts of one jaxpr, computed once for all its collectives."""

    def __init__(self, jaxpr):
        self.jaxpr = jaxpr
        self.anc = _ancestors(jaxpr)
        self.flops = [flops.of_eqn(e).matmul for e in jaxpr.eqns]

    def overlap(self, index: int) -> float:
        return independent_flops(self.jaxpr, index, self.anc, self.flops)
