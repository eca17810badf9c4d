"""A static bound of a boolean attention mask, read from how the traced program built it.

HF builds a sliding-window mask as `causal & window & padding`: the first two from position
indices (iota and the window size, constants of the program), the last from the batch's
attention mask (an input). `bound` walks the equations that produced the mask while it is
being traced: a part computed from constants only is evaluated (compile-time constant
folding, never a runtime value), an `and` keeps the bounds of both operands, and a broadcast
or reshape of a bounded boolean keeps its bound. The result is False wherever the mask is
False for every input of the program, so the attention kernel may skip a key block where the
bound is all False (`visible_blocks`). An additive mask bounds where it is a constant of the
program (HF's eager masks without padding): keys at or below -1e30 are hidden. Anything else (an input, a random draw, an op not
listed) bounds nothing.

It reads JAX's tracing state (DynamicJaxprTracer.parent, get_const): where that is not
available the bound is simply None and attention computes every block.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_SHAPE_OPS = {lax.broadcast_in_dim_p, lax.reshape_p, lax.squeeze_p, lax.transpose_p, lax.convert_element_type_p}
_MAX_NODES = 500            # equations looked at per mask
_MAX_CONSTANT = 1 << 27     # elements of one folded constant


class _Walk:
    def __init__(self):
        self.constants: dict[int, np.ndarray | None] = {}
        self.nodes = 0

    def constant(self, t):
        """t's value when the program computes it from constants only, else None."""
        if not isinstance(t, jax.core.Tracer):
            return np.asarray(t)
        if id(t) in self.constants:
            return self.constants[id(t)]
        self.nodes += 1
        value = None if self.nodes > _MAX_NODES or t.size > _MAX_CONSTANT else self._fold(t)
        self.constants[id(t)] = value
        return value

    def _fold(self, t):
        eqn = getattr(t, "parent", None)
        if eqn is None:
            get_const = getattr(t, "get_const", None)
            value = get_const() if get_const is not None else None
            return None if value is None else np.asarray(value)
        if eqn.effects:
            return None
        ins = [self.constant(x) for x in eqn.in_tracers]
        if any(x is None for x in ins):
            return None
        with jax.ensure_compile_time_eval():
            outs = eqn.primitive.bind(*ins, **eqn.params)
        outs = outs if eqn.primitive.multiple_results else [outs]
        index = next((n for n, v in enumerate(eqn.outvars) if v is t.val), None)
        return None if index is None else np.asarray(outs[index])

    def bound(self, t):
        """Boolean, broadcastable to t: False where t is False whatever the program's inputs."""
        value = self.constant(t)
        if value is not None:
            return value.astype(bool) if value.dtype == np.bool_ else None
        eqn = getattr(t, "parent", None)
        if eqn is None or self.nodes > _MAX_NODES:
            return None
        if eqn.primitive is lax.and_p and t.dtype == jnp.bool_:
            bounds = [b for b in (self.bound(x) for x in eqn.in_tracers) if b is not None]
            return np.logical_and(*bounds) if len(bounds) == 2 else (bounds[0] if bounds else None)
        if eqn.primitive in _SHAPE_OPS and t.dtype == jnp.bool_ and eqn.in_tracers[0].dtype == jnp.bool_:
            inner = self.bound(eqn.in_tracers[0])
            if inner is None:
                return None
            with jax.ensure_compile_time_eval():
                return np.asarray(eqn.primitive.bind(jnp.asarray(inner), **eqn.params))
        return None


_HIDDEN = -1e30  # an additive mask value at or below this hides its key (HF writes finfo.min or -inf)


def _additive(walk: _Walk, mask) -> np.ndarray | None:
    """Where a constant additive mask leaves keys visible, when every row sees one (a fully
    hidden row is uniform over all keys in torch: no block may be skipped there)."""
    value = walk.constant(mask)
    if value is None or value.ndim < 1:
        return None
    seen = value > _HIDDEN
    return seen if seen.any(axis=-1).all() else None


def constant(t) -> np.ndarray | None:
    """t's value when the traced program computes it from constants only, else None."""
    try:
        return _Walk().constant(t)
    except Exception:
        return None


def bound(mask) -> np.ndarray | None:
    """A static bound of a mask being traced (see the module docstring), or None: boolean masks,
    and additive masks that are constants of the program (HF's eager sliding window)."""
    if mask is None or (mask.dtype != jnp.bool_ and not jnp.issubdtype(mask.dtype, jnp.floating)):
        return None
    try:
        return _Walk().bound(mask) if mask.dtype == jnp.bool_ else _additive(_Walk(), mask)
    except Exception:  # an op that cannot be folded eagerly bounds nothing; attention computes every block
        return None


def visible_blocks(mask_bound, length: int, source: int, block_q: int, block_k: int):
    """Per query block, the [first, last + 1) key blocks the bound leaves visible (at least one),
    or () when the bound skips none."""
    if mask_bound is None or mask_bound.ndim < 2 or mask_bound.shape[-2:] != (length, source):
        return ()
    seen = mask_bound.reshape(-1, length, source).any(axis=0)
    n_q, n_k = -(-length // block_q), -(-source // block_k)
    seen = np.pad(seen, ((0, n_q * block_q - length), (0, n_k * block_k - source)))
    blocks = seen.reshape(n_q, block_q, n_k, block_k).any(axis=(1, 3))
    ranges = []
    for row in blocks:
        hits = np.flatnonzero(row)
        ranges.append((int(hits[0]), int(hits[-1]) + 1) if hits.size else (0, 1))
    if all(r == (0, n_k) for r in ranges):
        return ()
    return tuple(ranges)
