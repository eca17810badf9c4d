"""Partition rule of cuDNN's fused attention (jax.nn.dot_product_attention on CUDA, which the
front end picks there: xtrain.frontend.sdpa).

Its forward and backward primitives take (batch, length, heads, dim) arrays and per-row
statistics (batch, heads, length); batch and heads are independent, so a split of either
(data parallel, tensor-parallel heads) stays local and each device runs the kernel on its
shard. Lengths and head dims are made whole. Empty placeholder operands (no bias, no mask)
are replicated.
"""
from __future__ import annotations

from xtrain.lowering import sharded as C
from xtrain.lowering.explicit.registry import bind, register, wrap
from xtrain.lowering.sharded import Context, Layout, Sharded


def _target(x: Sharded, batch, heads) -> Layout:
    """(B, T, N, H) -> batch and heads split; (B, N, T) statistics alike; anything else whole."""
    if x.ndim == 4:
        return Layout((batch, (), heads, ()))
    if x.ndim == 3:
        return Layout((batch, heads, ()))
    return Layout.replicated(x.ndim)


def _split(x: Sharded, dim: int, others: list[Sharded]):
    """x's axes on `dim` if every 4-D operand is split the same way there, else none."""
    axes = x.layout.dims[dim]
    same = all(o.layout.dims[dim] == axes for o in others if o.ndim == 4)
    return tuple(axes) if same else ()


def fused_attention(ctx: Context, eqn, args):
    """cuDNN attention on each device's batch / head shard."""
    args = C.resolve_all(ctx, args)
    query = args[0]
    batch, heads = _split(query, 0, args), _split(query, 2, args)
    args = [C.relayout(ctx, a, _target(a, batch, heads)) for a in args]
    outs = bind(ctx, eqn, [a.value for a in args])
    layouts = [Layout((batch, (), heads, ())) if len(v.aval.shape) == 4 else Layout((batch, heads, ()))
               for v in eqn.outvars]
    return wrap(eqn, outs, layouts)


register(fused_attention, "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper")
