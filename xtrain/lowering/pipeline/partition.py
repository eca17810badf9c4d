"""Which layers each pipeline stage runs.

Costs are measured on the traced graph, per layer (the equations of `blocks.k`): FLOPs (2 x
multiply-adds of every dot_general, one per output element of other ops, nested calls
included), bytes of the parameters it reads and of the activations it produces. A layer's cost
is its estimated time: its FLOPs or its bytes at an accelerator-like 100 FLOPs per byte,
whichever is slower (roofline). `split=
"auto"` cuts the layer sequence into contiguous stages minimising the most expensive stage
(exact, by dynamic programming), so that stage exceeds the ideal (total / p) by less than the
largest single layer. Stage 0 also pays for the prologue, the last stage for the epilogue.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
from jax.extend import core as jcore

from xtrain.errors import PlanError
from xtrain.ir.analysis import flops as cost_flops
from xtrain.lowering.explicit.blocks import segments

FLOPS_PER_BYTE = 100.0  # ridge point of a GPU/Trainium-class chip: where memory traffic costs as much as math


@dataclasses.dataclass(frozen=True)
class Cost:
    """What a run of equations costs, measured on the traced graph."""

    flops: float
    param_bytes: int
    activation_bytes: int

    @property
    def time(self) -> float:
        """Roofline estimate in FLOP units: the math or the memory traffic, whichever is slower."""
        return max(self.flops, FLOPS_PER_BYTE * (self.param_bytes + self.activation_bytes))

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.flops + other.flops, self.param_bytes + other.param_bytes,
                    self.activation_bytes + other.activation_bytes)


ZERO = Cost(0.0, 0, 0)


def _nbytes(var) -> int:
    aval = var.aval
    if not hasattr(aval, "shape"):
        return 0
    itemsize = getattr(aval.dtype, "itemsize", None)  # PRNG key types (dropout) are not numpy dtypes
    return int(math.prod(aval.shape)) * (itemsize if itemsize is not None else 8)


def flops(eqns) -> float:
    """FLOPs of a list of equations (nested jaxprs included; xtrain.ir.analysis.flops)."""
    return cost_flops.of_eqns(eqns).total


def cost_of(eqns, param_vars: set) -> Cost:
    reads = {v for e in eqns for v in e.invars if isinstance(v, jcore.Var) and v in param_vars}
    made = sum(_nbytes(v) for e in eqns for v in e.outvars)
    return Cost(flops(eqns), sum(_nbytes(v) for v in reads), made)


def layer_costs(jaxpr, module_paths: frozenset[str], param_vars) -> list[tuple[str, Cost]]:
    """(module path, cost) of every top-level block `prefix.k` of `jaxpr`, in order."""
    params = set(param_vars)
    out = []
    for key, lo, hi in segments(jaxpr, module_paths):
        if key is not None:
            out.append((f"{key[0]}.{key[1]}", cost_of(jaxpr.eqns[lo:hi], params)))
    return out


def balance(costs: list[float], parts: int) -> list[int]:
    """Start index of each of `parts` contiguous groups of `costs` minimising the largest
    group's sum (every group non-empty)."""
    n = len(costs)
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    # best[k][i]: smallest max-group cost of costs[:i] in k groups; cut[k][i]: where group k starts
    best = np.full((parts + 1, n + 1), np.inf)
    cut = np.zeros((parts + 1, n + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, i = [], n
    for k in range(parts, 0, -1):
        i = int(cut[k][i])
        starts.append(i)
    return starts[::-1]


def explicit_starts(split: tuple[str, ...], layer_paths: list[str]) -> list[int]:
    """Start index of each stage from the module paths where stages 1.. begin."""
    index = {p: i for i, p in enumerate(layer_paths)}
    starts = [0]
    for path in split:
        if path not in index:
            raise PlanError(f"Pipeline(split=...): {path!r} is not one of the model's repeated blocks "
                            f"({layer_paths[0]} .. {layer_paths[-1]}); cut points must be block module paths")
        if index[path] <= starts[-1]:
            raise PlanError(f"Pipeline(split=...): cut point {path!r} does not come after the previous stage's "
                            f"start {layer_paths[starts[-1]]!r}; give cut points in layer order, each stage non-empty")
        starts.append(index[path])
    return starts


def check_enough_layers(num_layers: int, stages: int, prefix: str) -> None:
    if stages > num_layers:
        raise PlanError(f"Pipeline: {stages} stages but the model has only {num_layers} repeated blocks "
                        f"({prefix}.0 .. {prefix}.{num_layers - 1}); use at most {num_layers} stages "
                        "(stages x virtual_stages; zbv runs two per pipeline stage)")
