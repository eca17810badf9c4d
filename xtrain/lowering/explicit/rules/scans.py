"""Partition rules of the cumulative ops (cumsum, cumprod, cummax, cummin, cumlogsumexp).

A scan over a split dimension runs on each device's block, then each device combines its
block with the total of the blocks before it (after it, for a reverse scan): the blocks'
totals are all-gathered (one value per shard and row, not the activations) and the
exclusive prefix of this device is reduced from them. Dims the scan does not run along keep
their split.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from xtrain.lowering import collectives
from xtrain.lowering import sharded as C
from xtrain.lowering.context import Context
from xtrain.lowering.explicit.registry import bind, register, wrap


def _identity(prim: str, dtype):
    """The value that leaves the op's combine unchanged (a block with no blocks before it)."""
    if prim == "cumsum":
        return jnp.zeros((), dtype)
    if prim == "cumprod":
        return jnp.ones((), dtype)
    big = jnp.inf if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype).max
    if prim == "cummin":
        return jnp.asarray(big, dtype)
    return jnp.asarray(-big, dtype)  # cummax, cumlogsumexp


def _logsumexp0(t, mask):
    """log(sum(exp(t))) over the masked entries of axis 0; 0 where none is (the caller uses the
    local scan alone there). Written so no unselected branch yields a NaN gradient."""
    some = mask.any(0)
    m = lax.stop_gradient(jnp.where(mask, t, -jnp.inf).max(0))
    m = jnp.where(some, m, 0)
    s = jnp.where(mask, jnp.exp(jnp.where(mask, t, 0) - m), 0).sum(0)
    return jnp.where(some, m + jnp.log(jnp.where(some, s, 1)), 0), some


def _prefix(prim: str, totals, mask):
    """The op's reduction over axis 0 of the blocks' `totals` selected by `mask`."""
    if prim == "cumlogsumexp":
        return _logsumexp0(totals, mask)
    t = jnp.where(mask, totals, _identity(prim, totals.dtype))
    reduce = {"cumsum": jnp.sum, "cumprod": jnp.prod, "cummax": jnp.max, "cummin": jnp.min}[prim]
    return reduce(t, axis=0), None


def _combined(prim: str, prefix, local, some):
    if prim == "cumsum":
        return prefix + local
    if prim == "cumprod":
        return prefix * local
    if prim == "cummax":
        return jnp.maximum(prefix, local)
    if prim == "cummin":
        return jnp.minimum(prefix, local)
    return jnp.where(some, jnp.logaddexp(jnp.where(some, prefix, 0), local), local)


def cumulative(ctx: Context, eqn, args):
    """A scan along `axis`: local scan, then the exclusive prefix over the shards of `axis`."""
    prim, axis, reverse = str(eqn.primitive), eqn.params["axis"], eqn.params["reverse"]
    x = C.resolve(ctx, args[0])
    (local,) = bind(ctx, eqn, [x.value])
    axes = x.layout.dims[axis]
    if not axes:
        return wrap(eqn, [local], [x.layout])
    n = math.prod(ctx.sizes[a] for a in axes)
    last = 0 if reverse else local.shape[axis] - 1
    total = lax.slice_in_dim(local, last, last + 1, axis=axis)  # this block's total, kept dims
    totals = collectives.all_gather(total[None], axes, 0)  # (n, ..., 1, ...): every block's total
    me = C.axis_offset(ctx, axes)
    shards = jnp.arange(n).reshape((n,) + (1,) * total.ndim)
    mask = shards > me if reverse else shards < me
    prefix, some = _prefix(prim, totals, mask)
    return wrap(eqn, [_combined(prim, prefix, local, some)], [x.layout])


register(cumulative, "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
