"""Partition rules of windowed reductions: pooling (reduce_window_sum/max/min, a generic
reduce_window) and their gradients (select_and_scatter_add, select_and_gather_add,
select_and_scatter).

A dim whose window is one element wide, with unit stride and no padding or dilation (the
batch and channel dims of a pooling), is untouched: it keeps its split, and the operands
that share it are split alike. A split windowed (spatial) dim is gathered: a window may
straddle two shards (a halo exchange would move less; pooling over a split spatial dim is
rare: sequence splits are `context`'s and pooling runs over images).
"""
from __future__ import annotations

from xtrain.lowering import sharded as C
from xtrain.lowering.context import Context
from xtrain.lowering.explicit.registry import bind, register, whole_dims_where, wrap
from xtrain.lowering.sharded import Layout


def _untouched(params, ndim: int) -> set[int]:
    """Dims of the window whose output element d reads input element d alone."""
    ones = lambda name: params.get(name) or (1,) * ndim
    window, strides = params["window_dimensions"], ones("window_strides")
    base, dilation = ones("base_dilation"), ones("window_dilation")
    padding = params.get("padding") or ((0, 0),) * ndim
    return {d for d in range(ndim) if window[d] == 1 and strides[d] == 1 and base[d] == 1
            and dilation[d] == 1 and tuple(padding[d]) == (0, 0)}


def _windowed(ctx: Context, x, keep: set[int]):
    return whole_dims_where(ctx, x, lambda d: d not in keep)


def reduce_window(ctx: Context, eqn, args):
    """Pooling: untouched dims keep the first operand's split; a sum keeps a pending sum."""
    keep = _untouched(eqn.params, args[0].ndim)
    n = len(args) // 2 if str(eqn.primitive) == "reduce_window" else len(args)
    first = args[0] if str(eqn.primitive) == "reduce_window_sum" else C.resolve(ctx, args[0])
    first = _windowed(ctx, first, keep)
    layout = Layout(first.layout.dims)
    ops = [first] + [C.relayout(ctx, a, layout) for a in args[1:n]]
    inits = [C.replicate(ctx, a) for a in args[n:]]
    outs = bind(ctx, eqn, [o.value for o in ops] + [i.value for i in inits])
    return wrap(eqn, outs, [first.layout] * len(outs))


def select_and_scatter_add(ctx: Context, eqn, args):
    """Max-pooling's gradient (source cotangent, pooled operand) -> the operand's cotangent, and its
    JVP `select_and_gather_add` (tangents, operand) -> each window's selected tangent: untouched
    dims split as the operand's; the linear argument keeps a pending sum."""
    linear, operand = args
    keep = _untouched(eqn.params, operand.ndim)
    operand = _windowed(ctx, C.resolve(ctx, operand), keep)
    linear = C.relayout(ctx, linear, Layout(operand.layout.dims, linear.layout.partial))
    out = bind(ctx, eqn, [linear.value, operand.value])
    return wrap(eqn, out, [linear.layout])


def select_and_scatter(ctx: Context, eqn, args):
    """The generic form: (operand, source, init value) -> the operand's shape."""
    operand, source, init = (C.resolve(ctx, a) for a in args)
    keep = _untouched(eqn.params, operand.ndim)
    operand = _windowed(ctx, operand, keep)
    source = C.relayout(ctx, source, Layout(operand.layout.dims))
    out = bind(ctx, eqn, [operand.value, source.value, C.replicate(ctx, init).value])
    return wrap(eqn, out, [operand.layout])


register(reduce_window, "reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
register(select_and_scatter_add, "select_and_scatter_add")
register(select_and_scatter_add, "select_and_gather_add")  # its JVP: the same splits
register(select_and_scatter, "select_and_scatter")
