"""HF's eager attention recognised while it is traced, and computed by the blockwise kernel.

HF's `attn_implementation="eager"` writes attention as torch ops:
`softmax(q @ k^T * scale + mask, dim=-1) @ v` (the softmax maybe in fp32 and cast back,
then dropout on the weights). xtrain's torch.matmul (xtrain.frontend.torch_ops) asks `matmul`
here first: when its left operand is a softmax over the last axis whose input the traced
program computed as a batched q.k^T, optionally times (or divided by) a constant and plus an
additive mask, the product is computed by the blockwise kernel from q, k, the mask and v
instead, so the step keeps no L x S weights (the score matrix traced on the way becomes dead
code, which XLA drops). The recognition reads the equations that produced the operand
(DynamicJaxprTracer.parent), never a value.

What stays as written, with the reason in the report (`Implementation.EAGER`): dropout on the
weights (torch's eager pattern draws its own mask), scores masked by masked_fill / where, a
softmax input that is not q.k^T (+ mask), a scale that is not a constant, a mask that does not
broadcast to the scores. An additive mask that is a constant of the program and exactly causal
(HF's eager mask without padding) becomes the kernel's own causal mask when the sequence spans
several blocks (`_is_causal`); the mask is still handed over, for when sliding-window layers of the
same shape (Gemma-3) make every call of that shape take a mask (xtrain.frontend.uniform_attention).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.frontend import sdpa, static_mask
from xtrain.ir import markers
from xtrain.ir.attention import DEFAULT_BLOCK, Implementation, Site

_CASTS = (lax.convert_element_type_p,)


def _parent(t):
    return getattr(t, "parent", None)


def _strip_casts(t):
    while _parent(t) is not None and t.parent.primitive in _CASTS and len(t.parent.in_tracers) == 1:
        t = t.parent.in_tracers[0]
    return t


def _softmax_input(t):
    """The input of a softmax over the last axis that produced t (casts aside), else None."""
    eqn = _parent(_strip_casts(t))
    if eqn is None or eqn.primitive.name != "custom_jvp_call" or len(eqn.in_tracers) != 1:
        return None
    body = eqn.params["call_jaxpr"].jaxpr
    last = (t.ndim - 1,)
    reductions = [e for e in body.eqns if e.primitive in (lax.reduce_max_p, lax.reduce_sum_p)]
    names = {e.primitive for e in body.eqns}
    if {lax.reduce_max_p, lax.reduce_sum_p, lax.exp_p, lax.div_p} <= names and \
            all(tuple(e.params["axes"]) == last for e in reductions):
        return eqn.in_tracers[0]
    return None


def _scalar(t):
    value = static_mask._Walk().constant(t)
    return None if value is None or value.size != 1 else float(value.reshape(()))


def _dot(t):
    """(q, k^T) when t is the batched q (..., L, D) . k^T (..., D, S), else None."""
    eqn = _parent(t)
    if eqn is None or eqn.primitive is not lax.dot_general_p:
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    q, kt = eqn.in_tracers
    n = q.ndim
    if n < 3 or kt.ndim != n or tuple(lc) != (n - 1,) or tuple(rc) != (n - 2,) or \
            tuple(lb) != tuple(range(n - 2)) or tuple(rb) != tuple(range(n - 2)):
        return None
    return q, kt


def _scaled_dot(t):
    """(q, k^T, scale) when t is q.k^T, optionally times or divided by a constant, else None."""
    t = _strip_casts(t)
    eqn = _parent(t)
    if eqn is not None and eqn.primitive in (lax.mul_p, lax.div_p):
        a, b = eqn.in_tracers
        for s, c in (((a, b), (b, a)) if eqn.primitive is lax.mul_p else ((a, b),)):
            qk, value = _dot(_strip_casts(s)), _scalar(c)
            if qk is not None and value is not None:
                return (*qk, value if eqn.primitive is lax.mul_p else 1.0 / value)
        return None
    qk = _dot(t)
    return None if qk is None else (*qk, 1.0)


def _terms(t, depth: int = 3) -> list:
    """The summands of a (nested) sum t."""
    eqn = _parent(_strip_casts(t))
    if depth == 0 or eqn is None or eqn.primitive is not lax.add_p:
        return [t]
    return [x for term in eqn.in_tracers for x in _terms(term, depth - 1)]


def _scores(t):
    """(q, k, scale, additive mask or None) of scores t, or a reason they are not q.k^T (+ mask)."""
    t = _strip_casts(t)
    found, mask, eqn = _scaled_dot(t), None, _parent(t)
    if found is None and eqn is not None and eqn.primitive is lax.add_p:
        terms = _terms(t)  # T5: (q.k^T + position bias) + mask
        dots = [n for n, term in enumerate(terms) if _scaled_dot(term) is not None]
        if len(dots) == 1:
            found = _scaled_dot(terms[dots[0]])
            mask = functools.reduce(jnp.add, [term for n, term in enumerate(terms) if n != dots[0]])
    if found is None and eqn is not None and eqn.primitive is lax.select_n_p:
        return "the scores are masked by masked_fill / where (an additive mask is recognised)"
    if found is None:
        return "the softmax's input is not q.k^T (times a constant) plus an optional mask"
    q, kt, scale = found
    scores = q.shape[:-1] + kt.shape[-1:]
    if mask is not None and (mask.ndim != len(scores) or mask.shape[-1] != scores[-1]
                             or any(m not in (1, s) for m, s in zip(mask.shape, scores))):
        return f"a mask of shape {tuple(mask.shape)} against scores of {scores}"
    return q, jnp.swapaxes(kt, -1, -2), scale, mask


def matmul(x, y):
    """torch.matmul(x, y): the blockwise kernel when x is eager attention's weights, else x @ y."""
    if not isinstance(x, jax.core.Tracer) or x.ndim < 3 or y.ndim != x.ndim:
        return jnp.matmul(x, y)
    source = _softmax_input(x)
    if source is None:
        reason = _why_not(x)
        if reason is None:
            return jnp.matmul(x, y)
        with jax.named_scope(markers.name(Site(Implementation.EAGER, why=reason))):
            return jnp.matmul(x, y)
    found = _scores(source)
    if isinstance(found, str):
        with jax.named_scope(markers.name(Site(Implementation.EAGER, why=found))):
            return jnp.matmul(x, y)
    q, k, scale, mask = found
    if y.shape[:-2] != q.shape[:-2] or y.shape[-2] != k.shape[-2]:
        with jax.named_scope(markers.name(Site(Implementation.EAGER, why=f"values of shape {tuple(y.shape)}"))):
            return jnp.matmul(x, y)
    causal = _is_causal(mask, q.shape[-2], k.shape[-2])
    why = "HF eager attention recognised" + (", its constant mask is causal" if causal else "")
    out = sdpa.blockwise_call(q, k, y.astype(q.dtype), None if causal else mask, scale, why, causal=causal,
                              dropped_mask=mask if causal else None)
    return out.astype(jnp.result_type(x.dtype, y.dtype))


_MAX_FOLDED = 1 << 26  # elements of a mask folded to compare with the causal pattern


def _is_causal(mask, length: int, source: int) -> bool:
    """Whether an additive mask is a constant of the program (built from positions only, no
    padding) that is 0 on and below the diagonal and -inf or a huge negative above it: the kernel
    then applies causality itself (skipping blocks) and the L x S mask is not needed."""
    block = DEFAULT_BLOCK.get(sdpa._backend(), DEFAULT_BLOCK["cpu"])
    if mask is None or length != source or length <= block or mask.size > _MAX_FOLDED \
            or not jnp.issubdtype(mask.dtype, jnp.floating):
        return False  # within one block nothing is skipped: the layers keep one structure (a layer scan)
    value = static_mask._Walk().constant(mask)
    if value is None:
        return False
    rows = value.reshape(-1, length, source)
    below = np.tril(np.ones((length, source), bool))
    return bool(np.all(rows[:, below] == 0) and np.all(rows[:, ~below] <= -1e30))


def _why_not(x):
    """Why weights that are a softmax times something else (dropout) are left as written, else None."""
    eqn = _parent(x)
    if eqn is not None and eqn.primitive is lax.mul_p and any(_softmax_input(a) is not None for a in eqn.in_tracers):
        return "the weights are multiplied after the softmax: dropout (the eager pattern draws its own mask)"
    return None
