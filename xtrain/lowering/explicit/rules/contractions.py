"""Partition rules of contractions: dot_general (column/row parallel products, pending partial
sums over split contracting dims) and convolutions (batch split, and the channels of grouped ones)."""
from __future__ import annotations

import math

from xtrain.lowering import sharded as C
from xtrain.sharding.mesh import CONTEXT
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit.rules import linear_grad
from xtrain.lowering.explicit.registry import bind, register, same_vma, whole_dims_where, wrap
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded


def _match_pairs(ctx, lhs, rhs, pairs):
    """Gives each (lhs dim, rhs dim) pair one split: the split side's, or none if they clash."""
    for l, r in pairs:
        a, b = lhs.layout.dims[l], rhs.layout.dims[r]
        if a == b:
            continue
        if a and b and _context_extra(lhs, rhs, a, b):
            # the sequence split further over `context` on one side (logits vs. labels of a
            # cross-entropy): the other side is sliced locally, nothing is gathered
            lhs, rhs = (lhs, C.subsplit(ctx, rhs, r, a[len(b):])) if len(a) > len(b) else \
                (C.subsplit(ctx, lhs, l, b[len(a):]), rhs)
            continue
        if a and b and (a == b[:len(a)] or b == a[:len(b)]):
            # one side is split further (e.g. a row-parallel weight also split over data by
            # FSDP): gather only the extra minor axes, not the whole dimension on both sides
            lhs, rhs = (lhs, C.gather_dim(ctx, rhs, r, b[len(a):])) if len(b) > len(a) else \
                (C.gather_dim(ctx, lhs, l, a[len(b):]), rhs)
            continue
        if b and not a and _frees_axes_of_lhs(ctx, lhs, b):
            lhs = _gather_axes(ctx, lhs, b)
        if a and not b and not set(a) & set(rhs.layout.split_axes() + rhs.layout.partial):
            rhs = C.split_dim(ctx, rhs, r, a)
        elif b and not a and not set(b) & set(lhs.layout.split_axes() + lhs.layout.partial):
            lhs = C.split_dim(ctx, lhs, l, b)
        else:
            lhs, rhs = C.gather_dim(ctx, lhs, l), C.gather_dim(ctx, rhs, r)
    return lhs, rhs


def _context_extra(lhs, rhs, a, b) -> bool:
    """One side's split is the other's plus `context` only, an axis the other does not use."""
    short, long, other = (b, a, rhs) if len(a) > len(b) else (a, b, lhs)
    extra = long[len(short):]
    return long[:len(short)] == short and extra == (CONTEXT,) and \
        CONTEXT not in other.layout.split_axes() + other.layout.partial


def _frees_axes_of_lhs(ctx, lhs, axes) -> bool:
    """Whether a clash over `axes` is resolved by gathering the lhs (the activation) rather
    than the rhs (the weight): yes unless they are batch axes (ZeRO-3 gathers the weight,
    never the batch) or the lhs holds a pending sum over them."""
    return not set(axes) & set(ctx.batch_axes) and not set(axes) & set(lhs.layout.partial)


def _gather_axes(ctx, x, axes) -> Sharded:
    """Gathers the dims of `x` split over `axes` for a consumer that varies over them."""
    for d in range(x.ndim):
        if set(x.layout.dims[d]) & set(axes):
            x = C.gather_dim(ctx, x, d, tuple(set(x.layout.dims[d]) & set(axes)), varying=True)
    return x


def _no_partial_clash(ctx, lhs, rhs):
    """An operand's pending sum over an axis the other operand is split on is resolved."""
    if set(lhs.layout.partial) & set(rhs.layout.split_axes()):
        lhs = C.resolve(ctx, lhs)
    if set(rhs.layout.partial) & set(lhs.layout.split_axes()):
        rhs = C.resolve(ctx, rhs)
    return lhs, rhs


def _free_dims_clash(ctx, lhs, rhs, lfree, rfree):
    """One mesh axis cannot split two output dims: Megatron's sequence parallel gathers the
    activation (lhs) before a column-parallel matmul; over batch axes the rhs is gathered."""
    for d in rfree:
        clash = set(rhs.layout.dims[d]) & set(lhs.layout.split_axes())
        if clash and _frees_axes_of_lhs(ctx, lhs, clash):
            lhs = _gather_axes(ctx, lhs, clash)
        clash = set(rhs.layout.dims[d]) & set(lhs.layout.split_axes())
        if clash:
            rhs = C.gather_dim(ctx, rhs, d, tuple(clash))
    return lhs, rhs


def dot_general(ctx: Context, eqn, args):
    """Batch dims split alike stay split; free dims keep their split; a split contracting
    dim (both sides alike) leaves a partial sum over its axes."""
    lhs, rhs = args
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lhs.layout.partial and rhs.layout.partial:
        rhs = C.resolve(ctx, rhs)
    lhs, rhs = _no_partial_clash(ctx, lhs, rhs)
    lhs, rhs = _match_pairs(ctx, lhs, rhs, list(zip(lb, rb)) + list(zip(lc, rc)))
    lhs, rhs = _no_partial_clash(ctx, lhs, rhs)
    lfree = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
    rfree = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
    lhs, rhs = _free_dims_clash(ctx, lhs, rhs, lfree, rfree)
    dims = [lhs.layout.dims[d] for d in lb] + [lhs.layout.dims[d] for d in lfree] + [rhs.layout.dims[d] for d in rfree]
    partial = lhs.layout.partial + rhs.layout.partial + tuple(a for d in lc for a in lhs.layout.dims[d])
    return wrap(eqn, [_local_dot(ctx, eqn, lhs.value, rhs.value)], [Layout(tuple(dims), partial)])


def _local_dot(ctx: Context, eqn, x, y):
    """The equation's dot_general on the local values. An activation times a weight (no batch
    dims, x contracted on its last dim only) runs on x flattened to 2-D (tokens, features):
    the weight's gradient is then one 2-D product contracting the tokens, which XLA:CPU runs
    on the output gradient in place. On the N-D form its dot canonicalisation copied the output
    gradient transposed, and fused into that copy every elementwise op that produced the
    gradient (the norms' backward; with the blocks unrolled, across layers, again per copy)."""
    extra = {"out_sharding": None} if "out_sharding" in eqn.params else {}
    (lc, rc), (lb, _) = eqn.params["dimension_numbers"]
    if lb or tuple(lc) != (x.ndim - 1,) or x.ndim < 3:
        return bind(ctx, eqn, [x, y], **extra)[0]
    x, y = same_vma(ctx, [x, y])  # before the reshape: one cast of x (ctx caches it), so one
    # sum of its gradient over the cast's axes for every product reading x (q, k and v's)
    numbers = (((1,), tuple(rc)), ((), ()))

    def forward(x2, w):
        return bind(ctx, eqn, [x2, w], dimension_numbers=numbers, **extra)[0]

    x2 = x.reshape(-1, x.shape[-1])
    if y.ndim == 2 and ctx.remat is None and ctx.regather is None and x.dtype == y.dtype:
        # the weight's gradient in the orientation XLA:CPU runs fastest (rules/linear_grad.py);
        # not under remat / ZeRO-3's re-gather, whose policies name the dots they save
        flat = linear_grad.linear(x2, y, rc[0], eqn.params, forward)
    else:
        flat = forward(x2, y)
    return flat.reshape(*x.shape[:-1], *flat.shape[1:])


def conv(ctx: Context, eqn, args):
    """Convolutions keep a split of the batch dim, and a split of the input channels of a grouped
    convolution (depthwise: a state-space mixer's) whose group count the split divides: each device
    convolves its own groups with its slice of the kernel's output channels. Everything else whole."""
    lhs, rhs = C.resolve_all(ctx, args)
    dn, groups = eqn.params["dimension_numbers"], eqn.params["feature_group_count"]
    (batch_dim, feature), (out_batch, out_feature), kernel_out = dn.lhs_spec[:2], dn.out_spec[:2], dn.rhs_spec[0]
    channels = lhs.layout.dims[feature] if eqn.params["batch_group_count"] == 1 else ()
    parts = math.prod(ctx.sizes[a] for a in channels)
    if groups % parts or lhs.layout.segmented(feature):
        channels, parts = (), 1
    lhs = whole_dims_where(ctx, lhs, lambda d: d != batch_dim and (d != feature or not channels))
    rhs = whole_dims_where(ctx, rhs, lambda d: d != kernel_out or rhs.layout.dims[d] != channels)
    if channels and not rhs.layout.dims[kernel_out]:
        rhs = C.split_dim(ctx, rhs, kernel_out, channels)
    if eqn.params["batch_group_count"] != 1:
        lhs = C.gather_dim(ctx, lhs, batch_dim)
    dims = [()] * lhs.ndim
    dims[out_batch], dims[out_feature] = lhs.layout.dims[batch_dim], channels
    out = bind(ctx, eqn, [lhs.value, rhs.value], feature_group_count=groups // parts)
    return wrap(eqn, out, [Layout(tuple(dims))])


register(dot_general, "dot_general")
register(conv, "conv_general_dilated")
