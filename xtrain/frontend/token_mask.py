"""A boolean attention mask read as comparisons of per-token values: packed documents.

A batch row can hold several documents, each attending only to itself. HF builds that mask
from `position_ids` restarting at each document (its convention for packed batches, taken by
its SDPA path when called with `use_cache=False`) as

    (pos[b, k] <= pos[b, q]) & (doc[b, q] == doc[b, k])     doc = cumsum(pos restarts)

and a model written by hand builds the same from a document-id input. Each factor compares a
value of the query token with a value of the key token: no factor needs the L x S array the
mask is. `factors(mask)` walks the equations that built the mask while it is being traced
(as xtrain.frontend.static_mask does) and, when the mask is an `and` of such comparisons (and
of booleans of one token, e.g. a padding mask) of which one is a document equality (integer
operands, one varying along the queries, the other along the keys), returns them with their
operands at the mask's rank. The blockwise kernel (xtrain.ir.kernels.blockwise) then builds
each block's mask from its rows and columns and skips the blocks of disjoint documents at run
time. Anything else returns None and the mask is used as it is.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.frontend import static_mask

_COMPARISONS = {lax.eq_p: "eq", lax.ne_p: "ne", lax.lt_p: "lt", lax.le_p: "le", lax.gt_p: "gt", lax.ge_p: "ge"}
_MAX_NODES = 64  # equations looked at per mask


@dataclasses.dataclass(frozen=True)
class Factors:
    """A mask as `operands[2n] ops[n] operands[2n + 1]`, and-ed over n; every operand has the
    mask's rank and a query length or a key length of 1 (or both)."""

    ops: tuple[str, ...]
    operands: tuple


def _parent(t):
    return getattr(t, "parent", None) if isinstance(t, jax.core.Tracer) else None


def _at_rank(x, dims: tuple[int, ...], rank: int):
    """x, whose dim i is dim dims[i] of the mask (increasing), as an array of the mask's rank."""
    shape = [1] * rank
    for d, n in zip(dims, np.shape(x)):
        shape[d] = n
    return jnp.reshape(x, shape)


def _operand(t, dims: tuple[int, ...], rank: int):
    """A comparison's operand at the mask's rank, broadcasts undone (so no L x S array is kept)."""
    eqn = _parent(t)
    while eqn is not None and eqn.primitive is lax.broadcast_in_dim_p:
        dims = tuple(dims[d] for d in eqn.params["broadcast_dimensions"])
        t = eqn.in_tracers[0]
        eqn = _parent(t)
    return _at_rank(t, dims, rank)


def _one_sided(x) -> bool:
    return x.shape[-2] == 1 or x.shape[-1] == 1


class _Walk:
    def __init__(self, rank: int):
        self.rank, self.nodes = rank, 0
        self.ops: list[str] = []
        self.operands: list = []

    def add(self, t, dims: tuple[int, ...]) -> bool:
        """Records the factors of boolean `t` (its dim i is the mask's dims[i]); False when
        some part is not a comparison of per-token values."""
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            return False
        eqn = _parent(t)
        if eqn is not None and eqn.primitive is lax.and_p:
            return all(self.add(x, _aligned(x, dims)) for x in eqn.in_tracers)
        if eqn is not None and eqn.primitive is lax.broadcast_in_dim_p:
            return self.add(eqn.in_tracers[0], tuple(dims[d] for d in eqn.params["broadcast_dimensions"]))
        if eqn is not None and eqn.primitive in _COMPARISONS:
            a, b = (_operand(x, _aligned(x, dims), self.rank) for x in eqn.in_tracers)
            if not (_one_sided(a) and _one_sided(b)):
                return False
            self.ops.append(_COMPARISONS[eqn.primitive])
            self.operands += [a, b]
            return True
        if t.dtype != jnp.bool_:
            return False
        if t.size == 1 and _true(t):  # HF's `and` with a constant True
            return True
        x = _at_rank(t, dims, self.rank)  # a boolean of one token (padding), or a constant
        if not _one_sided(x):
            return False
        self.ops.append("eq")
        self.operands += [x, jnp.ones((1,) * self.rank, jnp.bool_)]
        return True


def _true(t) -> bool:
    value = static_mask.constant(t)
    return value is not None and bool(np.all(value))


def _aligned(x, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The mask dims of an operand of an elementwise op whose output has `dims` (numpy's
    broadcasting aligns the trailing dims)."""
    return dims[len(dims) - np.ndim(x):]


def _documents(ops, operands) -> bool:
    """Whether some factor is an equality of integers of the query token and the key token."""
    for n, op in enumerate(ops):
        a, b = operands[2 * n], operands[2 * n + 1]
        sides = {(x.shape[-2] > 1, x.shape[-1] > 1) for x in (a, b)}
        if op == "eq" and jnp.issubdtype(a.dtype, jnp.integer) and sides == {(True, False), (False, True)}:
            return True
    return False


def factors(mask) -> Factors | None:
    """The mask's per-token comparisons when it is packed documents' (module docstring), else None."""
    if mask is None or mask.dtype != jnp.bool_ or mask.ndim < 2 or _parent(mask) is None:
        return None
    walk = _Walk(mask.ndim)
    try:
        ok = walk.add(mask, tuple(range(mask.ndim)))
    except Exception:  # an operand that cannot be reshaped: the mask stays as it is
        return None
    if not ok or not _documents(walk.ops, walk.operands):
        return None
    return Factors(tuple(walk.ops), tuple(walk.operands))
