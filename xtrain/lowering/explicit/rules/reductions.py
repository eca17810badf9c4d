"""Partition rules of reductions: a split dim reduced leaves a pending partial sum (sums) or a
combine over the shards (max/min); the rest reduce whole dims."""
from __future__ import annotations

from xtrain.lowering import collectives
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


_COMBINE = {"reduce_max": lambda x: x.max(0), "reduce_min": lambda x: x.min(0)}


def reduce_extremum(ctx: Context, eqn, args):
    """Local max/min, then the max/min of the per-shard results, gathered (one value per
    shard; unlike pmax/pmin this is differentiable, e.g. for a vocab-parallel logsumexp)."""
    x = C.resolve(ctx, args[0])
    axes = tuple(eqn.params["axes"])
    over = tuple(a for d in axes for a in x.layout.dims[d])
    (out,) = bind(ctx, eqn, [x.value])
    if over:
        shards = collectives.all_gather(out[None], over, 0, invariant=True)
        out = _COMBINE[str(eqn.primitive)](shards)
    return wrap(eqn, [out], [Layout(_kept(x, axes))])


def reduce_whole(ctx: Context, eqn, args):
    """Reductions without a cheap combine (argmax, prod, and/or, cumulative): reduced dims whole."""
    axes = eqn.params.get("axes", (eqn.params.get("axis"),))
    x = C.resolve(ctx, args[0])
    x = whole_dims_where(ctx, x, lambda d: d in axes)
    outs = bind(ctx, eqn, [x.value])
    keep_shape = len(out_avals(eqn)[0].shape) == x.ndim
    layout = x.layout if keep_shape else Layout(_kept(x, axes))
    return wrap(eqn, outs, [layout] * len(outs))


register(reduce_sum, "reduce_sum")
register(reduce_extremum, "reduce_max", "reduce_min")
register(reduce_whole, "argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or", "cumsum", "cumprod",
         "cummax", "cummin", "cumlogsumexp")
