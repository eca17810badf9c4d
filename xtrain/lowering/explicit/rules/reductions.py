"""Partition rules of reductions: a split dim reduced leaves a pending partial sum (sums) or a
combine over the shards (max/min/prod/and/or/xor, variadic reduce); argmax/argmin reduce whole dims.
The cumulative ops are in scans.py."""
from __future__ import annotations

from xtrain.lowering import collectives, fp8
from xtrain.lowering import sharded as C
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit.registry import bind, out_avals, register, whole_dims_where, wrap
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded


def _kept(x: Sharded, axes) -> tuple:
    return tuple(d for i, d in enumerate(x.layout.dims) if i not in axes)


def reduce_sum(ctx: Context, eqn, args):
    """Reducing a split dim leaves a partial sum over its axes (resolved when needed)."""
    x = args[0]
    axes = tuple(eqn.params["axes"])
    newly = tuple(a for d in axes for a in x.layout.dims[d])
    layout = Layout(_kept(x, axes), x.layout.partial + newly)
    return wrap(eqn, bind(ctx, eqn, [x.value], out_sharding=None) if "out_sharding" in eqn.params
                 else bind(ctx, eqn, [x.value]), [layout])


def reduce_combined(ctx: Context, eqn, args):
    """An associative reduction (max, min, prod, and, or, xor): the local reduction, then the
    same reduction over the per-shard results, gathered (one value per shard; unlike
    pmax/pmin this is differentiable, e.g. for a vocab-parallel logsumexp)."""
    x = C.resolve(ctx, args[0])
    axes = tuple(eqn.params["axes"])
    over = tuple(a for d in axes for a in x.layout.dims[d])
    if fp8.is_local_amax(eqn):  # each device's own over the batch axes: the step max-reduces them once
        over = tuple(a for a in over if a not in ctx.batch_axes)
    (out,) = bind(ctx, eqn, [x.value])
    if over:
        shards = collectives.all_gather(out[None], over, 0, invariant=True)
        (out,) = bind(ctx, eqn, [shards], axes=(0,))
    return wrap(eqn, [out], [Layout(_kept(x, axes))])


def reduce_variadic(ctx: Context, eqn, args):
    """`reduce` of several operands by a reducer jaxpr (an argmax written as one reduction):
    reduced dims that are split are reduced locally, then the reducer runs over the per-shard
    results, gathered (XLA's reduce assumes the reducer associative, so this is as exact)."""
    n = len(args) // 2
    dims = tuple(eqn.params["dimensions"])
    ops = [C.resolve(ctx, a) for a in args[:n]]
    ops = [C.relayout(ctx, o, ops[0].layout) for o in ops]
    inits = [C.replicate(ctx, a) for a in args[n:]]
    over = tuple(a for d in dims for a in ops[0].layout.dims[d])
    outs = bind(ctx, eqn, [o.value for o in ops] + [i.value for i in inits])
    if over:
        shards = [collectives.all_gather(o[None], over, 0, invariant=True) for o in outs]
        outs = bind(ctx, eqn, shards + [i.value for i in inits], dimensions=(0,))
    return wrap(eqn, outs, [Layout(_kept(ops[0], dims))] * len(outs))


def reduce_whole(ctx: Context, eqn, args):
    """Reductions without a cheap combine (argmax, argmin): reduced dims whole."""
    axes = eqn.params.get("axes", (eqn.params.get("axis"),))
    x = C.resolve(ctx, args[0])
    x = whole_dims_where(ctx, x, lambda d: d in axes)
    outs = bind(ctx, eqn, [x.value])
    keep_shape = len(out_avals(eqn)[0].shape) == x.ndim
    layout = x.layout if keep_shape else Layout(_kept(x, axes))
    return wrap(eqn, outs, [layout] * len(outs))


register(reduce_sum, "reduce_sum")
register(reduce_combined, "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
register(reduce_variadic, "reduce")
register(reduce_whole, "argmax", "argmin")
