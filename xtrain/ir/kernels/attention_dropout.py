"""Attention dropout masks drawn from global coordinates.

Whether the weight of query row r over key column s at leading position (batch..., head) is
kept is a hash of the step's dropout key and those global coordinates only (threefry, as
jax.random draws): the blockwise kernel computes the same mask whatever its blocking, and ring
attention (xtrain.lowering.ring_attention), which holds a chunk of the sequence and of the
batch per device, draws the same mask as one device computing the whole call. So losses do
not depend on the mesh with attention dropout on.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.random import threefry2x32_p


@dataclasses.dataclass(frozen=True)
class Drop:
    """A dropout key and where a call's local scores sit in the whole attention.

    Attributes:
        key: the call's dropout key (typed or raw uint32[2]).
        lead: int32 flat index of each leading (..., Hk, G) position, shaped q.shape[:-2] +
            (1, 1); None: an iota over the call's own leading dims (it is the whole call).
        rows, cols: int32 global position of each local query row / key column; None: the
            call's own positions (0, 1, ...).
    """

    key: Any
    lead: Any = None
    rows: Any = None
    cols: Any = None


def flat_index(shape: tuple[int, ...], offsets=None, whole: tuple[int, ...] | None = None):
    """int32 flat index over the leading dims `shape` (of a whole of shape `whole`, this part
    starting at `offsets`), shaped shape + (1, 1)."""
    whole = whole or shape
    out = jnp.zeros(tuple(shape) + (1, 1), jnp.int32)
    for d in range(len(shape)):
        index = lax.broadcasted_iota(jnp.int32, tuple(shape) + (1, 1), d)
        if offsets is not None:
            index = index + offsets[d]
        out = out * whole[d] + index
    return out


def _words(key):
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    key = key.astype(jnp.uint32).reshape(-1)
    return key[0], key[1]


def _positions(given, start, size: int):
    if given is None:
        return start + lax.iota(jnp.int32, size)
    return lax.dynamic_slice_in_dim(given, start, size)


def _threefry(shape, *words):
    """threefry2x32 of four uint32 words broadcast to `shape`; each is made to vary over the
    mesh axes any of them varies over (inside shard_map: ring attention), as the primitive's
    loop needs."""
    zero = functools.reduce(lambda a, w: a + (w & jnp.uint32(0)), words, jnp.zeros(shape, jnp.uint32))
    return threefry2x32_p.bind(*(w + zero for w in words))


def kept(drop: Drop, rate: float, shape: tuple[int, ...], row0, col0):
    """Boolean (..., Hk, G, bq, bk) mask of the weights kept, for the block of scores whose local
    rows start at `row0` and columns at `col0` (ints or traced)."""
    lead = drop.lead if drop.lead is not None else flat_index(shape[:-2])
    rows = _positions(drop.rows, row0, shape[-2]).astype(jnp.uint32)[:, None]
    cols = _positions(drop.cols, col0, shape[-1]).astype(jnp.uint32)[None, :]
    k0, k1 = _words(drop.key)
    lead = lead.astype(jnp.uint32)
    r0, r1 = _threefry(tuple(shape[:-1]) + (1,), k0, k1, lead, rows)  # one key per (lead, row),
    bits, _ = _threefry(tuple(shape), r0, r1, cols, jnp.uint32(0))     # then one word per column
    uniform = (bits >> 8).astype(jnp.float32) * (1.0 / (1 << 24))
    return uniform < 1.0 - rate
