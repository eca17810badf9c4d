"""Partition rules of indexing: gathers local where the operand is whole, vocab-parallel
lookups where an embedding table is split over model axes."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.ir import vma
from xtrain.lowering import sharded as C
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit.registry import (bind, fallback, out_avals, register, same_vma, whole_dims_where,
                                               wrap)
from xtrain.lowering.explicit.rules.contractions import _gather_axes, _match_pairs
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded


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


def _lookup(ctx: Context, eqn, table, index):
    """A row lookup (an embedding) whose gradient's zeros are made only once the cotangent is
    there: JAX transposes a gather into a scatter-add into a table of zeros, and XLA's GPU
    scheduler, with memory to spare, made that table (the embedding's, 2 GiB in f32 on
    Llama-3.1-8B) before the backward pass's layer loop and held it throughout. Here the zeros
    come out of an optimization barrier with the cotangent; the scatter-add is JAX's transpose.
    Not inside a user's derivative rule (`ctx.options.derivative_rule`): its tangents are linear,
    and a custom VJP on them has no transpose."""
    if ctx.options.derivative_rule:
        return bind(ctx, eqn, [table, index])[0]
    table, index = same_vma(ctx, [table, index])
    dn, shape, dtype, axes = eqn.params["dimension_numbers"], table.shape, table.dtype, vma.of(table)
    scatter = lax.ScatterDimensionNumbers(
        update_window_dims=dn.offset_dims, inserted_window_dims=dn.collapsed_slice_dims,
        scatter_dims_to_operand_dims=dn.start_index_map, operand_batching_dims=dn.operand_batching_dims,
        scatter_indices_batching_dims=dn.start_indices_batching_dims)

    @jax.custom_vjp
    def lookup(table, index):
        return bind(ctx, eqn, [table, index])[0]

    def backward(index, ct):
        zero, ct = lax.optimization_barrier((jnp.zeros((), dtype), ct))
        zeros = vma.widen(jnp.broadcast_to(zero, shape), axes)
        return lax.scatter_add(zeros, index, ct.astype(dtype), scatter, mode=eqn.params["mode"],
                               unique_indices=eqn.params["unique_indices"],
                               indices_are_sorted=eqn.params["indices_are_sorted"]), None

    lookup.defvjp(lambda table, index: (lookup(table, index), index), backward)
    return lookup(table, index)


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
    operand = whole_dims_where(ctx, operand, lambda k: k != d and k not in batching)
    rows, local = operand.shape[d], operand.value.shape[d]
    index = indices.value
    if eqn.params["mode"] == GatherScatterMode.CLIP:
        index = jnp.clip(index, 0, rows - 1)
    shifted = index - (C.axis_offset(ctx, axes) * local).astype(index.dtype)
    mine = (shifted >= 0) & (shifted < local)  # (..., 1)
    out = _lookup(ctx, eqn, operand.value, jnp.where(mine, shifted, 0))
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
    return wrap(eqn, [out], [Layout(tuple(dims), axes)])


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
    operand = whole_dims_where(ctx, operand, lambda d: d not in batching)
    out_ndim = len(out_avals(eqn)[0].shape)
    batch_out = [d for d in range(out_ndim) if d not in dn.offset_dims]
    dims = [()] * out_ndim
    for out_d, idx_d in zip(batch_out, range(indices.ndim - 1)):
        dims[out_d] = indices.layout.dims[idx_d]
    if d is None:
        out = bind(ctx, eqn, [operand.value, indices.value])
    else:
        out = [_lookup(ctx, eqn, operand.value, indices.value)]
    return wrap(eqn, out, [Layout(tuple(dims), operand.layout.partial)])


register(gather, "gather")


def _passthrough(eqn, operand: Sharded, updates: Sharded) -> dict[int, int]:
    """{operand dim: updates dim} of a scatter's window dims that span the whole operand dim and
    are not scattered into: rows written in place (a shift of each sequence), splittable alike."""
    dn = eqn.params["dimension_numbers"]
    skipped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    operand_dims = [d for d in range(operand.ndim) if d not in skipped]
    return {od: ud for od, ud in zip(operand_dims, dn.update_window_dims)
            if od not in dn.scatter_dims_to_operand_dims and updates.shape[ud] == operand.shape[od]}


LINEAR_SCATTERS = {"scatter", "scatter-add", "scatter_add", "scatter-sub"}  # pending sums pass through


def _row_splits(eqn, operand: Sharded) -> set[int]:
    """Scattered operand dims written one row per index (an embedding gradient's row, the
    padding row torch zeroes) whose split stays: each device writes the rows its shard holds
    (indices shifted by the shard's offset; the others dropped, so the mode must drop)."""
    from jax._src.lax.slicing import GatherScatterMode

    dn = eqn.params["dimension_numbers"]
    if eqn.params["mode"] == GatherScatterMode.CLIP:
        return set()
    return {d for d in dn.scatter_dims_to_operand_dims if d in dn.inserted_window_dims and operand.layout.dims[d]}


def _shifted(ctx: Context, eqn, indices, operand: Sharded, rows: set[int]):
    """Global indices -> this device's, along the `rows` dims of the operand."""
    dn = eqn.params["dimension_numbers"]
    offsets = [C.axis_offset(ctx, operand.layout.dims[d]) * operand.value.shape[d] if d in rows else 0
               for d in dn.scatter_dims_to_operand_dims]
    return indices - jnp.stack([jnp.asarray(o, indices.dtype) for o in offsets])


def _through_dims(eqn, operand: Sharded, updates: Sharded) -> list:
    """The operand's dims: its split where it may stay, taking the updates' split on a
    pass-through window dim the operand holds whole (free axes only)."""
    through = _passthrough(eqn, operand, updates)
    keep = set(through) | _row_splits(eqn, operand)
    dims = [operand.layout.dims[d] if d in keep else () for d in range(operand.ndim)]
    used = {a for d in dims for a in d} | set(operand.layout.partial)
    for od, ud in through.items():
        if not dims[od] and updates.layout.dims[ud] and not set(updates.layout.dims[ud]) & used:
            dims[od] = updates.layout.dims[ud]
            used.update(dims[od])
    return dims


def scatter(ctx: Context, eqn, args):
    """Scatter with any combiner (set, add, sub, mul, min, max). Splits that stay: a pass-through
    window dim (rows written in place: the operand and updates split alike) and a scattered
    dim written one row per index (`_row_splits`); the other dims whole, the indices whole. A
    set/add/sub keeps the operand's pending sum (the updates become addends alike)."""
    from jax._src.lax.slicing import GatherScatterMode

    dn = eqn.params["dimension_numbers"]
    if len(args) != 3 or dn.operand_batching_dims:
        return fallback(ctx, eqn, args)
    operand, indices, updates = args
    if operand.zero:  # a ZeRO-3/FSDP parameter (torch's padding row kept out of the gradient): its use starts here
        operand = whole_dims_where(ctx, operand, lambda d: bool(set(operand.layout.dims[d]) & set(operand.zero)))
    if str(eqn.primitive) not in LINEAR_SCATTERS:
        operand, updates = C.resolve(ctx, operand), C.resolve(ctx, updates)
    dims = _through_dims(eqn, operand, updates)
    operand = C.relayout(ctx, operand, Layout(tuple(dims), operand.layout.partial))
    update_dims = [()] * updates.ndim
    for od, ud in _passthrough(eqn, operand, updates).items():
        update_dims[ud] = operand.layout.dims[od]
    # its splits first: a pending sum it takes on (addends) may be over an axis it is split on now
    kept = tuple(p for p in updates.layout.partial if p in operand.layout.partial)
    updates = C.relayout(ctx, C.relayout(ctx, updates, Layout(tuple(update_dims), kept)),
                         Layout(tuple(update_dims), operand.layout.partial))
    rows = _row_splits(eqn, operand)
    index = C.replicate(ctx, C.resolve(ctx, indices)).value
    mode = eqn.params["mode"]
    if rows:
        index, mode = _shifted(ctx, eqn, index, operand, rows), GatherScatterMode.FILL_OR_DROP
    out = bind(ctx, eqn, [operand.value, index, updates.value], mode=mode)
    return wrap(eqn, out, [operand.layout])


def splits_scattered_rows(eqn, args) -> bool:
    """Whether a scatter-add's operand is split, or its updates on a pass-through window dim
    (then `scatter` keeps those splits; else routing's rule sums per-device updates)."""
    operand, _, updates = args[:3]
    through = _passthrough(eqn, operand, updates)
    return bool(operand.layout.split_axes()) or any(updates.layout.dims[ud] for ud in through.values())


register(scatter, "scatter", "scatter-mul", "scatter-min", "scatter-max", "scatter-sub")
