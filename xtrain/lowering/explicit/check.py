"""Differential check of the explicit lowering: a function run partitioned (inputs split by
given layouts, outputs gathered) must equal the same function run whole. The rule fuzzer
in the tests and users debugging a rule both call `run_partitioned`."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from xtrain.lowering import sharded as C
from xtrain.lowering.explicit import rules  # noqa: F401  (registers the partition rules: checked alone, none would be)
from xtrain.lowering.context import Context
from xtrain.lowering.findings import Findings, collected
from xtrain.lowering.sharded import Sharded
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.sharded import Layout
from xtrain.sharding.fallback import REPLICATE, FallbackPolicy


def _spec(layout: Layout) -> PartitionSpec:
    return PartitionSpec(*[(d if len(d) > 1 else d[0]) if d else None for d in layout.dims])


def _partialize(ctx: Context, value, layout: Layout):
    """A whole value as addends over `layout.partial`: device 0 of each axis holds it all."""
    for axis in layout.partial:
        value = jnp.where(lax.axis_index(axis) == 0, value, jnp.zeros_like(value))
    return value


def run_partitioned(fn: Callable, args: Sequence[np.ndarray], layouts: Sequence[Layout],
                    mesh: jax.sharding.Mesh, fallback: FallbackPolicy = REPLICATE) -> tuple[list, Findings]:
    """Evaluates `fn(*args)` through the explicit lowering; returns (outputs, what it found).
    `fallback`: an op without a rule runs replicated (the default; Findings.fallbacks names it),
    or raises (FallbackPolicy())."""
    closed = jax.make_jaxpr(fn)(*args)
    ctx = Context.of(dict(mesh.shape), fallback=fallback)
    axes = tuple(mesh.axis_names)

    def per_device(*local):
        ins = [Sharded(_partialize(ctx, lax.pcast(v, axes, to="varying"), l), l, tuple(a.shape), a.dtype)
               for v, l, a in zip(local, layouts, args)]
        outs = interpret(ctx, closed.jaxpr, closed.consts, ins)
        return [C.replicate(ctx, o).value for o in outs]

    out_specs = [PartitionSpec()] * len(closed.jaxpr.outvars)
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(_spec(l) for l in layouts),
                           out_specs=out_specs, check_vma=False)
    outputs = [np.asarray(o) for o in jax.jit(mapped)(*args)]
    return outputs, collected([ctx.record])
