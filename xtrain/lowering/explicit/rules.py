"""Partition rules: one short function per primitive (or family), looked up in RULES.

A rule gets the equation and its operands as Sharded values (local array + Layout) and
returns the outputs as Sharded values. It may move operands (collectives.relayout, resolve,
gather_dim, split_dim) and must rewrite shape-carrying parameters to local shapes.
A primitive without a rule runs replicated (`fallback`) and is reported by name and module.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from xtrain.lowering.explicit import collectives as C
from xtrain.lowering.explicit.collectives import Context, Sharded
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.explicit.layout import Layout


# -- helpers ---------------------------------------------------------------------------------
def _out_avals(eqn):
    return [v.aval for v in eqn.outvars]


def _same_vma(ctx: Context, values):
    """Primitives need operands varying over the same mesh axes (the jnp layer would pcast)."""
    union = frozenset().union(*(C.vma(v) for v in values))
    return [C.pcast_varying(ctx, v, tuple(sorted(union - C.vma(v))))
            if hasattr(v, "shape") and union - C.vma(v) else v for v in values]


def _bind(ctx: Context, eqn, values, **overrides):
    params = {**eqn.params, **overrides}
    out = eqn.primitive.bind(*_same_vma(ctx, values), **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _wrap(eqn, values, layouts) -> list[Sharded]:
    return [Sharded(v, l, tuple(a.shape), a.dtype) for v, l, a in zip(values, layouts, _out_avals(eqn))]


def _local(shape, layout: Layout, ctx: Context) -> tuple[int, ...]:
    return layout.local_shape(shape, ctx.sizes)


def fallback(ctx: Context, eqn, args):
    """No rule: gather every operand, run the op replicated on each device."""
    if any(not a.layout.is_replicated for a in args):
        ctx.note_fallback(str(eqn.primitive))
    return replicated(ctx, eqn, args)


def replicated(ctx: Context, eqn, args):
    """Ops that are always computed whole (RNG keys, iota): replicate inputs, bind as is."""
    args = [C.replicate(ctx, a) for a in args]
    outs = _bind(ctx, eqn, [a.value for a in args])
    return _wrap(eqn, outs, [Layout.replicated(len(a.shape)) for a in _out_avals(eqn)])


# -- elementwise -----------------------------------------------------------------------------
LINEAR_UNARY = {"neg", "copy", "copy_p", "reduce_precision", "real", "imag", "conj", "stop_gradient"}
ADDITIVE = {"add", "sub", "add_any"}


def _target_dims(args, out_shape: tuple) -> tuple:
    """Each output dim takes the split of the most split operand that has that dim at full
    size; size-1 (broadcasting) dims stay whole."""
    ranked = sorted((a for a in args if a.ndim), key=lambda a: -len(a.layout.split_axes()))
    dims, used = [], set()
    for d, size in enumerate(out_shape):
        split = next((a.layout.dims[d] for a in ranked if a.shape[d] == size and a.layout.dims[d]
                      and not set(a.layout.dims[d]) & used), ())
        used.update(split)
        dims.append(split)
    return tuple(dims)


def _align(ctx: Context, args, out_shape: tuple, keep: tuple | None = None) -> tuple[list[Sharded], tuple]:
    """Brings operands to one dims layout (`_target_dims`). Pending sums are kept if in
    `keep` (default: all) and the result is not split over their axis (an addend's slice is
    not a slice's addend); the others are resolved, by reduce-scatter where the result splits
    a dim over them."""
    dims = _target_dims(args, out_shape)
    split = {a for d in dims for a in d}
    out = []
    for a in args:
        want = tuple(dims[d] if a.shape[d] == out_shape[d] else () for d in range(a.ndim))
        partial = tuple(p for p in a.layout.partial if p not in split and (keep is None or p in keep))
        out.append(C.relayout(ctx, a, Layout(want, partial)))
    return out, tuple(dims)


def _partial_after(prim: str, args) -> tuple | None:
    """The partial axes an elementwise op can keep, or None when all must be resolved."""
    partials = [a.layout.partial for a in args]
    if not any(partials):
        return ()
    if prim in LINEAR_UNARY or (prim == "convert_element_type" and args[0].dtype.kind == "f"):
        return partials[0]
    if prim in ADDITIVE and len(set(partials)) == 1:
        return partials[0]
    if prim == "mul" and sum(bool(p) for p in partials) == 1:
        return next(p for p in partials if p)
    if prim == "div" and partials[0] and not partials[1]:
        return partials[0]
    return None


def elementwise(ctx: Context, eqn, args):
    """Same-shape ops (scalars broadcast): align layouts; keep partial sums where linear."""
    keep = _partial_after(str(eqn.primitive), args)
    out_shape = tuple(_out_avals(eqn)[0].shape)
    if keep is None or set(keep) & {a for d in _target_dims(args, out_shape) for a in d}:
        keep = ()
    args, dims = _align(ctx, args, out_shape, keep)
    outs = _bind(ctx, eqn, [a.value for a in args])
    return _wrap(eqn, outs, [Layout(dims if a.shape else (), keep) for a in _out_avals(eqn)])


# -- structure -------------------------------------------------------------------------------
def broadcast_in_dim(ctx: Context, eqn, args):
    """New dims whole; broadcast size-1 dims whole; operand dims keep their split. A ZeRO-3
    parameter (a bias) is gathered before it is broadcast: its use starts here."""
    x = args[0]
    shape, bdims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    if x.param:
        x = _whole_dims_where(ctx, x, lambda d: bool(set(x.layout.dims[d]) & set(ctx.batch_axes)))
    for i, d in enumerate(bdims):
        if x.layout.dims[i] and x.shape[i] != shape[d]:
            x = C.gather_dim(ctx, x, i)
    dims = [()] * len(shape)
    for i, d in enumerate(bdims):
        dims[d] = x.layout.dims[i]
    layout = Layout(tuple(dims), x.layout.partial)
    out = _bind(ctx, eqn, [x.value, *[a.value for a in args[1:]]], shape=_local(shape, layout, ctx), sharding=None)
    return _wrap(eqn, out, [layout])


def _reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Pairs of (input dims, output dims) whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        i, j = i + bool(gi), j + bool(gj)
        while a != b:
            if a < b:
                a *= src[i]; gi.append(i); i += 1
            else:
                b *= dst[j]; gj.append(j); j += 1
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i); i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


def reshape(ctx: Context, eqn, args):
    """A split survives when it sits on the major dim of a merged/split group and divides
    the group's major output dim; any other split is gathered first."""
    x = args[0]
    new_sizes = tuple(eqn.params["new_sizes"])
    if eqn.params.get("dimensions") is not None:
        return fallback(ctx, eqn, args)
    dims = [()] * len(new_sizes)
    for gi, gj in _reshape_groups(x.shape, new_sizes):
        for k in gi[1:]:
            x = C.gather_dim(ctx, x, k)
        if not gi or not x.layout.dims[gi[0]]:
            continue
        # the major output dim must take the whole split (skip leading size-1 dims)
        target = next((d for d in gj if new_sizes[d] != 1), None)
        factor = x.layout.factor(gi[0], ctx.sizes)
        if target is None or new_sizes[target] % factor or any(new_sizes[d] != 1 for d in gj[:gj.index(target)]):
            x = C.gather_dim(ctx, x, gi[0])
            continue
        dims[target] = x.layout.dims[gi[0]]
    layout = Layout(tuple(dims), x.layout.partial)
    out = _bind(ctx, eqn, [x.value], new_sizes=_local(new_sizes, layout, ctx), sharding=None)
    return _wrap(eqn, out, [layout])


def transpose(ctx: Context, eqn, args):
    x = args[0]
    perm = eqn.params["permutation"]
    layout = Layout(tuple(x.layout.dims[p] for p in perm), x.layout.partial)
    return _wrap(eqn, _bind(ctx, eqn, [x.value]), [layout])


def squeeze(ctx: Context, eqn, args):
    x = args[0]
    drop = set(d % x.ndim for d in eqn.params["dimensions"])
    layout = Layout(tuple(d for i, d in enumerate(x.layout.dims) if i not in drop), x.layout.partial)
    return _wrap(eqn, _bind(ctx, eqn, [x.value]), [layout])


def expand_dims_like(ctx: Context, eqn, args):
    return fallback(ctx, eqn, args)


def concatenate(ctx: Context, eqn, args):
    """The joined dim must be whole; other dims aligned like elementwise operands."""
    dim = eqn.params["dimension"]
    args = [C.gather_dim(ctx, a, dim) for a in args]
    if len({a.layout.partial for a in args}) > 1:
        args = C.resolve_all(ctx, args)
    args, dims = _align(ctx, args, tuple(_out_avals(eqn)[0].shape))
    layout = Layout(dims, args[0].layout.partial)
    return _wrap(eqn, _bind(ctx, eqn, [a.value for a in args]), [layout])


def _whole_dims_where(ctx: Context, x: Sharded, needs_whole) -> Sharded:
    for d in range(x.ndim):
        if needs_whole(d):
            x = C.gather_dim(ctx, x, d)
    return x


def slice_(ctx: Context, eqn, args):
    """Dims that are cut must be whole; untouched dims keep their split."""
    x = args[0]
    start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
    cut = lambda d: start[d] != 0 or limit[d] != x.shape[d] or (strides and strides[d] != 1)
    x = _whole_dims_where(ctx, x, cut)
    local_limit = tuple(lim // x.layout.factor(d, ctx.sizes) for d, lim in enumerate(limit))
    return _wrap(eqn, _bind(ctx, eqn, [x.value], limit_indices=local_limit), [x.layout])


def pad(ctx: Context, eqn, args):
    x, value = args
    config = eqn.params["padding_config"]
    x = _whole_dims_where(ctx, x, lambda d: config[d] != (0, 0, 0))
    zero_pad = isinstance(value.value, (int, float)) and value.value == 0
    if x.layout.partial and not zero_pad:
        x = C.resolve(ctx, x)
    value = C.resolve(ctx, value)
    return _wrap(eqn, _bind(ctx, eqn, [x.value, value.value]), [x.layout])


def dynamic_slice(ctx: Context, eqn, args):
    """Dims sliced to less than their size must be whole; full-size dims keep their split."""
    x, *starts = args
    sizes = eqn.params["slice_sizes"]
    x = _whole_dims_where(ctx, x, lambda d: sizes[d] != x.shape[d])
    starts = [C.replicate(ctx, s) for s in starts]
    local = tuple(s // x.layout.factor(d, ctx.sizes) for d, s in enumerate(sizes))
    out = _bind(ctx, eqn, [x.value, *[s.value for s in starts]], slice_sizes=local)
    return _wrap(eqn, out, [x.layout])


def split(ctx: Context, eqn, args):
    x = C.gather_dim(ctx, args[0], eqn.params["axis"])
    outs = _bind(ctx, eqn, [x.value])
    return _wrap(eqn, outs, [x.layout] * len(outs))


# -- reductions ------------------------------------------------------------------------------
def _kept(x: Sharded, axes) -> tuple:
    return tuple(d for i, d in enumerate(x.layout.dims) if i not in axes)


def reduce_sum(ctx: Context, eqn, args):
    """Reducing a split dim leaves a partial sum over its axes (resolved when needed)."""
    x = args[0]
    axes = tuple(eqn.params["axes"])
    newly = tuple(a for d in axes for a in x.layout.dims[d])
    layout = Layout(_kept(x, axes), x.layout.partial + newly)
    return _wrap(eqn, _bind(ctx, eqn, [x.value], out_sharding=None) if "out_sharding" in eqn.params
                 else _bind(ctx, eqn, [x.value]), [layout])


_COMBINE = {"reduce_max": lambda x: x.max(0), "reduce_min": lambda x: x.min(0)}


def reduce_extremum(ctx: Context, eqn, args):
    """Local max/min, then the max/min of the per-shard results, gathered (one value per
    shard; unlike pmax/pmin this is differentiable, e.g. for a vocab-parallel logsumexp)."""
    x = C.resolve(ctx, args[0])
    axes = tuple(eqn.params["axes"])
    over = tuple(a for d in axes for a in x.layout.dims[d])
    (out,) = _bind(ctx, eqn, [x.value])
    if over:
        shards = C.all_gather_invariant(out[None], over if len(over) > 1 else over[0], axis=0, tiled=True)
        out = _COMBINE[str(eqn.primitive)](shards)
    return _wrap(eqn, [out], [Layout(_kept(x, axes))])


def reduce_whole(ctx: Context, eqn, args):
    """Reductions without a cheap combine (argmax, prod, and/or, cumulative): reduced dims whole."""
    axes = eqn.params.get("axes", (eqn.params.get("axis"),))
    x = C.resolve(ctx, args[0])
    x = _whole_dims_where(ctx, x, lambda d: d in axes)
    outs = _bind(ctx, eqn, [x.value])
    keep_shape = len(_out_avals(eqn)[0].shape) == x.ndim
    layout = x.layout if keep_shape else Layout(_kept(x, axes))
    return _wrap(eqn, outs, [layout] * len(outs))


# -- contractions ----------------------------------------------------------------------------
def _match_pairs(ctx, lhs, rhs, pairs):
    """Gives each (lhs dim, rhs dim) pair one split: the split side's, or none if they clash."""
    for l, r in pairs:
        a, b = lhs.layout.dims[l], rhs.layout.dims[r]
        if a == b:
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
    return _wrap(eqn, [_local_dot(ctx, eqn, lhs.value, rhs.value)], [Layout(tuple(dims), partial)])


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
        return _bind(ctx, eqn, [x, y], **extra)[0]
    x, y = _same_vma(ctx, [x, y])  # before the reshape: one cast of x (ctx caches it), so one
    # sum of its gradient over the cast's axes for every product reading x (q, k and v's)
    flat = _bind(ctx, eqn, [x.reshape(-1, x.shape[-1]), y], dimension_numbers=(((1,), tuple(rc)), ((), ())),
                 **extra)[0]
    return flat.reshape(*x.shape[:-1], *flat.shape[1:])


def conv(ctx: Context, eqn, args):
    """Convolutions split over the batch dim only; everything else whole."""
    lhs, rhs = C.resolve_all(ctx, args)
    dn = eqn.params["dimension_numbers"]
    batch_dim, out_batch = dn.lhs_spec[0], dn.out_spec[0]
    lhs = _whole_dims_where(ctx, lhs, lambda d: d != batch_dim)
    rhs = C.replicate(ctx, rhs)
    if eqn.params["batch_group_count"] != 1:
        lhs = C.gather_dim(ctx, lhs, batch_dim)
    dims = [()] * lhs.ndim
    dims[out_batch] = lhs.layout.dims[batch_dim]
    return _wrap(eqn, _bind(ctx, eqn, [lhs.value, rhs.value]), [Layout(tuple(dims))])


# -- indexing --------------------------------------------------------------------------------
def _row_lookup_dim(eqn, operand: Sharded) -> int | None:
    """The table dim of an embedding-style lookup (one indexed dim, collapsed, one row per
    index: embeddings, take_along_axis of a cross-entropy's target logit); else None."""
    dn = eqn.params["dimension_numbers"]
    if len(dn.start_index_map) != 1 or operand.layout.partial:
        return None
    d = dn.start_index_map[0]
    if d not in dn.collapsed_slice_dims or eqn.params["slice_sizes"][d] != 1:
        return None
    return d if jnp.issubdtype(operand.dtype, jnp.floating) else None


def _model_prefix(ctx: Context, axes) -> tuple:
    """The leading axes that are not batch axes (a ZeRO split over batch axes sits after them)."""
    out = []
    for a in axes:
        if a in ctx.batch_axes:
            break
        out.append(a)
    return tuple(out)


def _vocab_parallel_gather(ctx: Context, eqn, operand: Sharded, indices: Sharded, d: int):
    """Megatron's vocab-parallel embedding: each device looks up the rows its shard holds
    (zeros elsewhere); the result is a partial sum over the table's axes, resolved by the
    consumer (all-reduce, or reduce-scatter under sequence parallel). Moves activations,
    never the table."""
    from jax._src.lax.slicing import GatherScatterMode

    axes = _model_prefix(ctx, operand.layout.dims[d])
    operand = C.gather_dim(ctx, operand, d, operand.layout.dims[d][len(axes):])  # ZeRO part
    indices = _gather_axes(ctx, indices, axes)  # e.g. tokens split over tensor: small, ints
    batching = set(eqn.params["dimension_numbers"].operand_batching_dims)
    operand = _whole_dims_where(ctx, operand, lambda k: k != d and k not in batching)
    rows, local = operand.shape[d], operand.value.shape[d]
    index = indices.value
    if eqn.params["mode"] == GatherScatterMode.CLIP:
        index = jnp.clip(index, 0, rows - 1)
    shifted = index - (C.axis_offset(ctx, axes) * local).astype(index.dtype)
    mine = (shifted >= 0) & (shifted < local)  # (..., 1)
    out = _bind(ctx, eqn, [operand.value, jnp.where(mine, shifted, 0)])[0]
    offset_dims = eqn.params["dimension_numbers"].offset_dims
    mask = jnp.expand_dims(mine[..., 0], offset_dims)
    out = jnp.where(mask, out, jnp.zeros((), out.dtype))
    if eqn.params["mode"] == GatherScatterMode.FILL_OR_DROP:
        # an out-of-range index reads the fill value: added once, by the first shard
        fill = eqn.params["fill_value"]
        fill = jnp.nan if fill is None else fill
        outside = jnp.expand_dims(((index < 0) | (index >= rows))[..., 0], offset_dims)
        first = C.axis_offset(ctx, axes) == 0
        out = jnp.where(outside & first, jnp.asarray(fill, out.dtype), out)
    batch_out = [k for k in range(out.ndim) if k not in offset_dims]
    dims = [()] * out.ndim
    for out_d, idx_d in zip(batch_out, range(indices.ndim - 1)):
        dims[out_d] = indices.layout.dims[idx_d]
    return _wrap(eqn, [out], [Layout(tuple(dims), axes)])


def gather(ctx: Context, eqn, args):
    """Gathers whose operand is whole except on batching dims: each device gathers locally;
    output batch dims follow the index array's split. An embedding lookup from a table split
    over model axes is vocab-parallel instead (`_vocab_parallel_gather`)."""
    operand, indices = args
    dn = eqn.params["dimension_numbers"]
    indices = C.gather_dim(ctx, C.resolve(ctx, indices), indices.ndim - 1)  # index vector whole
    for od, idim in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
        operand, indices = _match_pairs(ctx, operand, indices, [(od, idim)])
    d = _row_lookup_dim(eqn, operand)
    if d is not None and _model_prefix(ctx, operand.layout.dims[d]):
        return _vocab_parallel_gather(ctx, eqn, operand, indices, d)
    batching = set(dn.operand_batching_dims)
    operand = _whole_dims_where(ctx, operand, lambda d: d not in batching)
    out_ndim = len(_out_avals(eqn)[0].shape)
    batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
    dims = [()] * out_ndim
    for out_d, idx_d in zip(batch_out, range(indices.ndim - 1)):
        dims[out_d] = indices.layout.dims[idx_d]
    out = _bind(ctx, eqn, [operand.value, indices.value])
    return _wrap(eqn, out, [Layout(tuple(dims), operand.layout.partial)])


# -- annotations -----------------------------------------------------------------------------
def sharding_constraint(ctx: Context, eqn, args):
    """xtrain.shard / with_sharding_constraint: move the value to the spec's layout, pending
    sums resolved (by reduce-scatter onto the dims the spec splits over their axes)."""
    (x,) = args
    sharding = eqn.params["sharding"] if "sharding" in eqn.params else eqn.params["dst_sharding"]
    spec = tuple(getattr(sharding, "spec", sharding))
    dims = tuple(_spec_axes(e) for e in spec) + ((),) * (x.ndim - len(spec))
    return [C.relayout(ctx, x, Layout(dims))]


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


# -- calls -----------------------------------------------------------------------------------
def call(ctx: Context, eqn, args):
    """jit / closed_call: interpret the callee with the operands' layouts."""
    closed = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    if isinstance(closed, jcore.ClosedJaxpr):
        return interpret(ctx, closed.jaxpr, closed.consts, args, inline=True)
    return interpret(ctx, closed, [], args, inline=True)


def _trace_jvp(eqn, jvp_fun, n: int):
    """The custom JVP rule's jaxpr, traced in the mesh context the model was traced in (the
    operands' abstract mesh, Auto axes). Traced under shard_map's Manual mesh instead, JAX
    reshards every use of a primal to that mesh, which this interpreter reads as a gather."""
    from jax._src import mesh as mesh_lib

    meshes = {getattr(getattr(v.aval, "sharding", None), "mesh", None) for v in eqn.invars}
    mesh = meshes.pop() if len(meshes) == 1 else None
    if not isinstance(mesh, mesh_lib.AbstractMesh):
        mesh = mesh_lib.empty_abstract_mesh
    with mesh_lib.use_abstract_mesh(mesh):
        return jvp_fun.call_wrapped(*[False] * n)


def custom_jvp(ctx: Context, eqn, args):
    """Keeps the user's derivative rule: the primal and its JVP are both interpreted."""
    call_jaxpr, jvp_fun = eqn.params["call_jaxpr"], eqn.params["jvp_jaxpr_fun"]
    consts, prims = args[: eqn.params["num_consts"]], args[eqn.params["num_consts"]:]
    path = ctx.path
    with_values = lambda xs, vals: [dataclasses.replace(x, value=v) for x, v in zip(xs, vals)]

    def primal(*vals):
        ctx.path = path
        return interpret(ctx, call_jaxpr.jaxpr, call_jaxpr.consts, consts + with_values(prims, vals))

    layouts: list = []  # output layouts, fixed by whichever of f / f_jvp is traced first

    @jax.custom_jvp
    def f(*vals):
        outs = primal(*vals)
        layouts[:] = [o.layout for o in outs]
        return [o.value for o in outs]

    @f.defjvp
    def f_jvp(primals, tangents):
        jaxpr, jconsts, out_zeros = _trace_jvp(eqn, jvp_fun, len(prims))
        ctx.path = path
        # remat='selective' tags nothing inside the rule: its tangents are linear, and a tag
        # (checkpoint_name) on them has no transpose; the rule's outputs are tagged outside
        remat, ctx.remat = ctx.remat, None
        try:
            outs = interpret(ctx, jaxpr, jconsts, with_values(prims, primals) + with_values(prims, tangents))
        finally:
            ctx.remat = remat
        n = len(out_zeros)
        want = layouts or [o.layout for o in outs[:n]]
        p_out = [C.relayout(ctx, o, l) for o, l in zip(outs[:n], want)]
        t_out = [C.relayout(ctx, o, l) for o, l in zip(outs[n:], want)]
        layouts[:] = want
        return [o.value for o in p_out], [o.value for o in t_out]

    values = f(*[p.value for p in prims])
    return _wrap(eqn, values, layouts)


def _instantiate(cts, avals):
    """bwd rules may return None / symbolic zeros for inputs without a cotangent."""
    out = []
    for ct, aval in zip(cts, avals):
        if ct is None or type(ct).__name__ in ("Zero", "SymbolicZero"):
            ct = jnp.zeros(aval.shape, aval.dtype)
        out.append(ct)
    return out


def _cotangent_for(ctx, ct: Sharded, primal: Sharded):
    """A cotangent in the primal's layout and type. A pending sum over an axis the primal
    varies on stays pending: each device's addend is its own contribution, which autodiff
    (or xtrain's gradient sync) sums later; summing it here would count it n times."""
    # (an axis the primal is split on is summed: a shard's cotangent is a slice of the sum)
    keep = C.vma(primal.value) - set(primal.layout.split_axes())
    ct = C.resolve(ctx, ct, tuple(a for a in ct.layout.partial if a not in keep))
    ct = C.relayout(ctx, ct, primal.layout.with_partial(ct.layout.partial))
    return _same_vma(ctx, [ct.value, primal.value])[0]


def custom_vjp(ctx, eqn, args):
    """Keeps the user's VJP: primal, fwd and bwd are all interpreted on shards. Outputs and
    cotangents cross the boundary whole along pending sums (partial sums are resolved)."""
    p = eqn.params
    call, n_consts = p["call_jaxpr"], p["num_consts"]
    if n_consts:
        return fallback(ctx, eqn, args)
    prims, path = args, ctx.path
    fwd_jaxpr, fwd_consts = p["fwd_jaxpr_thunk"].call_wrapped(*[True] * len(prims))
    # fwd returns [residuals not forwarded from inputs..., primal outputs...]; `forwards[i]` is
    # the input index residual i is forwarded from, or None (as JAX's own JVP rule reads it)
    _, res_tree, forwards = p["out_trees"]()
    n_res = sum(f is None for f in forwards)
    out_avals = [v.aval for v in eqn.outvars]
    prim_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in prims]
    with_values = lambda xs, vals: [dataclasses.replace(x, value=v) for x, v in zip(xs, vals)]
    layouts: dict = {}

    def resolved(outs):
        return [C.resolve(ctx, o) for o in outs]

    @jax.custom_vjp
    def f(*vals):
        ctx.path = path
        outs = resolved(interpret(ctx, call.jaxpr, call.consts, with_values(prims, vals)))
        layouts.setdefault("out", [o.layout for o in outs])
        return [o.value for o in outs]

    def f_fwd(*vals):
        ctx.path = path
        ins = with_values(prims, vals)
        outs = interpret(ctx, fwd_jaxpr, fwd_consts, ins)
        primal = resolved(outs[n_res:])
        want = layouts.setdefault("out", [o.layout for o in primal])
        primal = [C.relayout(ctx, o, l) for o, l in zip(primal, want)]
        own = iter(outs[:n_res])
        res = [next(own) if f is None else ins[f] for f in forwards]
        layouts["res"] = res
        return [o.value for o in primal], [r.value for r in res]

    def f_bwd(res, cts):
        ctx.path = path
        res_structs = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in layouts["res"]]
        bwd = jax.make_jaxpr(lambda *a: _instantiate(p["bwd"].call_wrapped(*a), prim_avals))(
            *res_structs, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals])
        ins = ([dataclasses.replace(r, value=v) for r, v in zip(layouts["res"], res)]
               + [Sharded(v, l, tuple(a.shape), a.dtype) for v, l, a in zip(cts, layouts["out"], out_avals)])
        outs = interpret(ctx, bwd.jaxpr, bwd.consts, ins)
        return tuple(_cotangent_for(ctx, o, x) for o, x in zip(outs, prims))

    f.defvjp(f_fwd, f_bwd)
    values = f(*[x.value for x in prims])
    return _wrap(eqn, values, layouts["out"])


RULES = {}


def _scan(ctx, eqn, args):
    from xtrain.lowering.explicit.scan import scan_rule
    return scan_rule(ctx, eqn, args)


def _while(ctx, eqn, args):
    from xtrain.lowering.explicit.scan import while_rule
    return while_rule(ctx, eqn, args)


def pow_(ctx: Context, eqn, args):
    """x ** c with a literal whole exponent (RMSNorm's x.pow(2)) as integer_pow, which XLA
    emits as multiplies. As an operand the exponent is typed varying like x (a pcast), and in
    a layer scan JAX hoists that loop-invariant cast out of the loop: XLA then sees a pow by
    an unknown value and runs the generic exp/log form."""
    exponent = eqn.invars[1]
    if (isinstance(exponent, jcore.Literal) and np.ndim(exponent.val) == 0
            and jnp.issubdtype(args[0].dtype, jnp.floating)
            and float(exponent.val).is_integer() and abs(float(exponent.val)) <= 16):
        x = C.resolve(ctx, args[0])
        return [Sharded(lax.integer_pow(x.value, int(exponent.val)), x.layout, x.shape, x.dtype)]
    return elementwise(ctx, eqn, args)


def _register(rule, *names):
    for name in names:
        RULES[name] = rule


_register(pow_, "pow")
_register(elementwise, "add", "sub", "mul", "div", "max", "min", "integer_pow", "neg", "exp", "exp2",
          "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt", "abs",
          "sign", "floor", "ceil", "round", "is_finite", "erf", "erfc", "erf_inv", "lgamma", "digamma",
          "square", "select_n", "clamp", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not", "xor",
          "rem", "atan2", "nextafter", "convert_element_type", "copy", "copy_p", "stop_gradient",
          "add_any", "reduce_precision", "shift_left", "shift_right_logical", "shift_right_arithmetic",
          "population_count", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh")
_register(broadcast_in_dim, "broadcast_in_dim")
_register(reshape, "reshape")
_register(transpose, "transpose")
_register(squeeze, "squeeze")
_register(concatenate, "concatenate")
_register(slice_, "slice")
_register(pad, "pad")
_register(dynamic_slice, "dynamic_slice")
_register(split, "split")
_register(reduce_sum, "reduce_sum")
_register(reduce_extremum, "reduce_max", "reduce_min")
_register(reduce_whole, "argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or", "cumsum", "cumprod",
          "cummax", "cummin", "cumlogsumexp")
_register(dot_general, "dot_general")
_register(conv, "conv_general_dilated")
_register(gather, "gather")
_register(sharding_constraint, "sharding_constraint", "reshard")
_register(call, "pjit", "jit", "closed_call", "core_call", "remat", "checkpoint")
_register(custom_jvp, "custom_jvp_call")
_register(custom_vjp, "custom_vjp_call")
_register(_scan, "scan")
_register(_while, "while")
_register(replicated, "iota", "random_seed", "random_bits", "random_split", "random_fold_in", "random_wrap",
          "random_unwrap", "threefry2x32", "rng_bit_generator")


def rule_for(primitive):
    return RULES.get(str(primitive), fallback)
