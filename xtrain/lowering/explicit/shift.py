"""A shift along a sequence split over `context`: pad by k at the end, then drop the first k.

HF's causal-LM loss shifts the labels one token left this way (`pad(labels, (0, 1))` then
`labels[..., 1:]`). On a context-split sequence each device then needs the first k tokens of
the next device's chunk: the `pad` rule defers the padding (`PendingPad`: the local chunk,
unpadded) and the `slice` rule that drops the first k makes it one neighbour exchange (a
collective permute over `context`; the last device takes the pad value). Any other use of the
padded value materialises it first (`materialize`: the sequence gathered, then padded), so no
rule ever reads a deferred pad as an ordinary value.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from xtrain.lowering import collectives
from xtrain.lowering import sharded as C
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded
from xtrain.sharding.mesh import CONTEXT


@dataclasses.dataclass
class PendingPad(Sharded):
    """A pad by `amount` at the end of dim `dim` (split over `context`), not yet applied:
    `value` is the local chunk unpadded, `shape` the padded global shape."""

    dim: int = 0
    amount: int = 0
    fill: object = 0


def defer(ctx: Context, x: Sharded, fill: Sharded, config) -> PendingPad | None:
    """The pad of `x` by `config` deferred, when it pads only the end of a dim split over
    `context` alone by less than a chunk; else None."""
    padded = [d for d, c in enumerate(config) if tuple(c) != (0, 0, 0)]
    if len(padded) != 1 or x.layout.partial or not fill.layout.is_replicated:
        return None
    d = padded[0]
    lo, hi, interior = config[d]
    if lo or interior or x.layout.dims[d] != (CONTEXT,) or not 0 < hi < x.value.shape[d]:
        return None
    shape = tuple(s + (hi if i == d else 0) for i, s in enumerate(x.shape))
    return PendingPad(x.value, x.layout, shape, x.dtype, dim=d, amount=hi, fill=fill.value)


def materialize(ctx: Context, x: Sharded) -> Sharded:
    """A deferred pad applied (the sequence gathered first); any other value as is."""
    if not isinstance(x, PendingPad):
        return x
    shape = tuple(s - (x.amount if i == x.dim else 0) for i, s in enumerate(x.shape))
    whole = C.gather_dim(ctx, Sharded(x.value, x.layout, shape, x.dtype), x.dim)
    widths = [(0, 0, 0)] * x.ndim
    widths[x.dim] = (0, x.amount, 0)
    return dataclasses.replace(whole, value=lax.pad(whole.value, jnp.asarray(x.fill, x.value.dtype), widths),
                               shape=x.shape)


def is_shift(x: PendingPad, start, limit, strides) -> bool:
    """Whether a slice of `x` drops exactly the first `amount` of the padded dim and nothing else."""
    keep = all(start[d] == 0 and limit[d] == x.shape[d] for d in range(x.ndim) if d != x.dim)
    return keep and start[x.dim] == x.amount and limit[x.dim] == x.shape[x.dim] and not any(
        s != 1 for s in (strides or ()))


def shifted(ctx: Context, x: PendingPad) -> Sharded:
    """Each chunk without its first `amount` tokens, followed by the next chunk's first ones
    (one collective permute over `context`); the last device appends the pad value."""
    c, k, d = ctx.sizes[CONTEXT], x.amount, x.dim
    head = lax.slice_in_dim(x.value, 0, k, axis=d)
    incoming = collectives.permute(head, CONTEXT, [(i, i - 1) for i in range(1, c)])
    last = lax.axis_index(CONTEXT) == c - 1
    incoming = jnp.where(last, jnp.full_like(incoming, x.fill), incoming)
    value = jnp.concatenate([lax.slice_in_dim(x.value, k, x.value.shape[d], axis=d), incoming], axis=d)
    shape = tuple(s - (k if i == d else 0) for i, s in enumerate(x.shape))
    return Sharded(value, x.layout, shape, x.dtype)
