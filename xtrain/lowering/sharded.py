"""Values of the per-device program and how they move between layouts.

A `Layout` says how one value of the global program is split over the mesh: per dimension the
mesh axes splitting it (major first), plus the axes over which a sum is still pending. A
`Sharded` is such a value on one device: its local array, its Layout and, for a stored
parameter, the batch axes it is a ZeRO-3 shard over. The moves (`resolve`, `scatter_partial`,
`gather_dim`, `split_dim`, `relayout`) emit their communication through the collectives layer
(xtrain.lowering.collectives); the report counts it back from the emitted program.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.lowering import collectives
from xtrain.lowering.context import Context

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per-dimension mesh axes (major first) and axes with a sum still pending.

    A value with `partial=("data",)` holds, on each device, one addend of the true value:
    the global value is the sum over the `data` axis.
    """

    dims: tuple[Axes, ...]
    partial: Axes = ()
    # (dim, segment sizes): dim holds this device's slice of every segment (its dims entry's
    # axes split each one; xtrain.sharding.segments), not one contiguous block
    segments: tuple[tuple[int, tuple[int, ...]], ...] = ()
    # (dim, n): the first n axes of a per-segment dim divide its segments among them, contiguously,
    # and the rest split each one (batch x heads merged into one dim: the batch's axes, the heads')
    outer: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        used = self.split_axes() + tuple(self.partial)
        assert len(set(used)) == len(used), f"mesh axis used twice in layout {self}"
        assert all(self.dims[d] for d, _ in self.segments), f"a segmented dim is whole in layout {self}"
        assert all(self.segmented(d) for d, _ in self.outer), f"outer axes of a dim not split per segment in {self}"

    def segmented(self, dim: int) -> tuple[int, ...] | None:
        """The segment sizes of `dim` split per segment, else None."""
        return dict(self.segments).get(dim)

    def outer_axes(self, dim: int) -> int:
        """How many of `dim`'s axes divide its segments among them (0: each axis splits each one)."""
        return dict(self.outer).get(dim, 0)

    @staticmethod
    def replicated(ndim: int) -> "Layout":
        return Layout(((),) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not any(self.dims)

    def split_axes(self) -> Axes:
        return tuple(a for d in self.dims for a in d)

    def with_dims(self, dims) -> "Layout":
        dims = tuple(tuple(d) for d in dims)
        # a per-segment split moves only with its reordering (lowering.explicit.segmented)
        assert all(dims[d] == self.dims[d] for d, _ in self.segments), f"segmented dim of {self} moved to {dims}"
        return Layout(dims, self.partial, self.segments, self.outer)

    def with_partial(self, partial) -> "Layout":
        return Layout(self.dims, tuple(partial), self.segments, self.outer)

    def factor(self, dim: int, sizes: Mapping[str, int]) -> int:
        return math.prod(sizes[a] for a in self.dims[dim])

    def local_shape(self, shape, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(s // self.factor(i, sizes) for i, s in enumerate(shape))

    def divides(self, shape, sizes: Mapping[str, int]) -> bool:
        return all(s % self.factor(i, sizes) == 0 for i, s in enumerate(shape))

    def __str__(self) -> str:
        dims = ", ".join("x".join(d) if d else "-" for d in self.dims)
        return f"[{dims}]" + (f" partial({','.join(self.partial)})" if self.partial else "") + \
            "".join(f" segments{d}{sizes}" for d, sizes in self.segments) + \
            "".join(f" outer{d}:{n}" for d, n in self.outer)


@dataclasses.dataclass
class Sharded:
    """A value of the global program: its local array and how it is split."""

    value: Any            # local array (a tracer inside shard_map)
    layout: Layout
    shape: tuple[int, ...]  # global shape
    dtype: Any
    zero: Axes = ()         # a stored parameter split over these batch axes (ZeRO-3): gathered per use
    feedback: Any = None    # its int8 error-feedback residual (ZeRO-3 with int8 gradients: zero3_int8)

    @property
    def ndim(self) -> int:
        return len(self.shape)


def memoized(ctx: Context, key: tuple, source, make):
    """`make()`, or its earlier result for the same `source` value: a tensor read by several
    ops (x feeding q, k and v) is gathered or cast once, so forward has one collective and
    backward one transpose of it (the consumers' cotangents are summed first). Keys hold
    id(source); the entry keeps `source` alive so the id cannot be reused."""
    hit = ctx.memo.get(key)
    if hit is not None and hit[0] is source:
        return hit[1]
    out = make()
    ctx.memo[key] = (source, out)
    return out


def pcast_varying(ctx: Context, v, axes: Axes):
    """`v` typed as varying over `axes` too (the transpose of this cast is a psum)."""
    return memoized(ctx, ("pcast", id(v), axes), v, lambda: lax.pcast(v, axes, to="varying"))


def axis_offset(ctx: Context, axes: Axes):
    """This device's index along `axes` flattened major-first (0 for no axes)."""
    return collectives.axis_offset(ctx.sizes, axes)


def resolved_before(ctx: Context, x: Sharded) -> Sharded:
    """`x` summed, if another op already resolved its pending sum (a norm's x.pow(2) reads the
    sum, then x * rsqrt(...) would keep its own pending copy and reduce it again), else `x`."""
    hit = ctx.memo.get(("psum", id(x.value), x.layout, x.layout.partial)) if x.layout.partial else None
    return hit[1] if hit is not None and hit[0] is x.value else x


def defer_biases(ctx: Context, value, plain, biases) -> None:
    """Records that `value`, a pending sum with whole `biases` added on one device each (a
    row-parallel matmul's bias), is also `plain` + `biases`: a full reduction sums `plain` and
    adds the biases after it, as Megatron does, so their gradients need no reduction over the
    sum's axes (the biases on one device would make them vary: an all-reduce in the backward)."""
    ctx.memo[("biases", id(value))] = (value, (plain, tuple(biases)))


def deferred_biases(ctx: Context, x: Sharded):
    """(plain, biases) of `defer_biases`, or None."""
    hit = ctx.memo.get(("biases", id(x.value)))
    return hit[1] if hit is not None and hit[0] is x.value else None


def carry_biases(ctx: Context, source, out, move) -> None:
    """`out` = `move`(`source`) (a reshape or transpose of a pending sum): its deferred biases,
    broadcast to the sum's local shape, moved alike."""
    hit = ctx.memo.get(("biases", id(source)))
    if hit is None or hit[0] is not source:
        return
    plain, biases = hit[1]
    defer_biases(ctx, out, move(plain), [move(jnp.broadcast_to(b, plain.shape)) for b in biases])


def _summed(ctx: Context, x: Sharded, axes: Axes, reduce, after):
    """`reduce` of `x`'s value over `axes`, or of its plain sum then `after` of each deferred bias."""
    deferred = deferred_biases(ctx, x) if set(axes) == set(x.layout.partial) else None
    if deferred is None:
        return reduce(x.value)
    plain, biases = deferred
    out = reduce(plain)
    for bias in biases:
        out = out + after(bias)
    return out


def resolve(ctx: Context, x: Sharded, axes: Axes | None = None) -> Sharded:
    """Sums pending partial addends (all of them, or only `axes`) with one all-reduce."""
    axes = x.layout.partial if axes is None else tuple(a for a in x.layout.partial if a in axes)
    if not axes:
        return x
    return memoized(ctx, ("psum", id(x.value), x.layout, axes), x.value, lambda: dataclasses.replace(
        x, value=_summed(ctx, x, axes, lambda v: collectives.all_reduce(v, axes), lambda b: b),
        layout=x.layout.with_partial(tuple(a for a in x.layout.partial if a not in axes))))


def scatter_partial(ctx: Context, x: Sharded, dim: int, axes: Axes) -> Sharded:
    """Sums the pending addends over `axes` and keeps this device's slice of the whole
    dimension `dim`: one reduce-scatter, where all-reduce + slice would move twice the bytes."""
    assert not x.layout.dims[dim] and set(axes) <= set(x.layout.partial)
    dims = list(x.layout.dims)
    dims[dim] = tuple(axes)
    layout = Layout(tuple(dims), tuple(a for a in x.layout.partial if a not in axes), x.layout.segments,
                    x.layout.outer)
    local = x.value.shape[dim] // math.prod(ctx.sizes[a] for a in axes)
    at = lambda b: dim - (x.value.ndim - b.ndim)  # numpy broadcasting aligns trailing dims
    piece = lambda b: b if at(b) < 0 or b.shape[at(b)] == 1 else lax.dynamic_slice_in_dim(
        b, axis_offset(ctx, axes) * local, local, axis=at(b))
    return memoized(ctx, ("psum_scatter", id(x.value), x.layout, dim, axes), x.value, lambda: dataclasses.replace(
        x, value=_summed(ctx, x, axes, lambda v: collectives.reduce_scatter(v, axes, dim), piece), layout=layout))


def resolve_all(ctx: Context, xs) -> list[Sharded]:
    return [resolve(ctx, x) for x in xs]


def is_zero_shard(x: Sharded, axes: Axes) -> bool:
    """Whether gathering `x` over `axes` is ZeRO-3's gather of a stored parameter's shards."""
    return bool(x.zero) and set(axes) <= set(x.zero)


def _all_gather(x: Sharded, axes: Axes, dim: int, varying: bool):
    # ZeRO-3/FSDP gathers are varying (the caller says so), so the gradient comes back
    # reduce-scattered (the transpose); xtrain.lowering.zero.RegatherPolicy gathers the
    # weight again in the backward pass. A consumer that varies over `axes` anyway also wants
    # the reduce-scatter transpose. Otherwise, once gathered, every device along `axes` holds
    # the same values: say so (invariant), so the rest of the program is not typed as varying
    # over axes it does not vary over.
    return collectives.all_gather(x.value, axes, dim, invariant=not varying)


def gather_dim(ctx: Context, x: Sharded, dim: int, axes: Axes | None = None, varying: bool = False) -> Sharded:
    """All-gathers dimension `dim` over `axes` (default: all its axes). Only minor (trailing)
    axes can be gathered alone; otherwise the whole dimension is gathered. `varying`: the
    result is typed as varying over `axes` (for a consumer that varies over them: its
    backward is then a reduce-scatter, not an all-reduce and a slice)."""
    have = x.layout.dims[dim]
    axes = have if axes is None else tuple(a for a in have if a in axes)
    if not axes:
        return x
    if have[len(have) - len(axes):] != axes:
        axes = have
    dims = list(x.layout.dims)
    dims[dim] = have[: len(have) - len(axes)]
    # ZeRO-3 (always varying): a parameter read twice (a tied embedding: the lookup and the
    # head) is gathered once, as XLA does; the backward pass gathers it once again
    varying = varying or is_zero_shard(x, axes)
    gather = lambda: dataclasses.replace(x, value=_all_gather(x, axes, dim, varying),
                                         layout=x.layout.with_dims(dims))
    return memoized(ctx, ("all_gather", id(x.value), x.layout, dim, axes, varying), x.value, gather)


def split_dim(ctx: Context, x: Sharded, dim: int, axes: Axes) -> Sharded:
    """Keeps this device's slice of a whole dimension (no communication)."""
    assert not x.layout.dims[dim], "split_dim needs a whole dimension"
    if not axes:
        return x
    parts = math.prod(ctx.sizes[a] for a in axes)
    local = x.value.shape[dim] // parts
    value = lax.dynamic_slice_in_dim(x.value, axis_offset(ctx, axes) * local, local, axis=dim)
    dims = list(x.layout.dims)
    dims[dim] = tuple(axes)
    return dataclasses.replace(x, value=value, layout=x.layout.with_dims(dims))


def unsplit_to_partial(ctx: Context, x: Sharded, dim: int) -> Sharded:
    """This device's slice of dimension `dim` placed in zeros of the whole dimension, as pending
    addends over the dimension's axes (no communication: the sum over them is the whole value)."""
    axes = x.layout.dims[dim]
    parts = math.prod(ctx.sizes[a] for a in axes)
    local = x.value.shape[dim]
    zeros = jnp.zeros(x.value.shape[:dim] + (local * parts,) + x.value.shape[dim + 1:], x.value.dtype)
    value = lax.dynamic_update_slice_in_dim(zeros, x.value, axis_offset(ctx, axes) * local, axis=dim)
    dims = list(x.layout.dims)
    dims[dim] = ()
    return dataclasses.replace(x, value=value, layout=Layout(tuple(dims), x.layout.partial + tuple(axes),
                                                                    x.layout.segments, x.layout.outer))


def subsplit(ctx: Context, x: Sharded, dim: int, axes: Axes) -> Sharded:
    """Dimension `dim` split further over `axes` (minor): this device's slice of its block."""
    parts = math.prod(ctx.sizes[a] for a in axes)
    local = x.value.shape[dim] // parts
    value = lax.dynamic_slice_in_dim(x.value, axis_offset(ctx, axes) * local, local, axis=dim)
    dims = list(x.layout.dims)
    dims[dim] = dims[dim] + tuple(axes)
    return dataclasses.replace(x, value=value, layout=x.layout.with_dims(dims))


def move_split(ctx: Context, x: Sharded, src: int, dst: int, axes: Axes | None = None) -> Sharded:
    """The minor `axes` of dimension `src`'s split (default: all) moved onto `dst` (as its
    minor axes): one all-to-all, the bytes of the local value, where a gather would hold the
    whole of `src`."""
    have = x.layout.dims[src]
    axes = have if axes is None else tuple(axes)
    assert have[len(have) - len(axes):] == axes
    dims = list(x.layout.dims)
    dims[src], dims[dst] = have[:len(have) - len(axes)], dims[dst] + axes
    return memoized(ctx, ("move_split", id(x.value), x.layout, src, dst, axes), x.value, lambda: dataclasses.replace(
        x, value=collectives.all_to_all(x.value, axes, dst, src), layout=x.layout.with_dims(dims)))


def replicate(ctx: Context, x: Sharded) -> Sharded:
    x = resolve(ctx, x)
    for dim in range(x.ndim):
        x = gather_dim(ctx, x, dim)
    return x


def relayout(ctx: Context, x: Sharded, target: Layout) -> Sharded:
    """Moves `x` to `target`'s dims (partial sums resolved unless `target` keeps them; by a
    reduce-scatter where `target` splits a whole dim over the pending axes)."""
    keep = set(target.partial)
    for dim, want in enumerate(target.dims):
        if want and not x.layout.dims[dim] and set(want) <= set(x.layout.partial) - keep:
            x = scatter_partial(ctx, x, dim, want)
    x = resolve(ctx, x, tuple(a for a in x.layout.partial if a not in keep))
    for axis in target.partial:
        if axis not in x.layout.partial:  # a whole value as addends: all of it on device 0
            for dim in [d for d, have in enumerate(x.layout.dims) if axis in have]:
                x = gather_dim(ctx, x, dim)  # (whole over it first: a value is split or pending over an axis)
            value = jnp.where(lax.axis_index(axis) == 0, x.value, jnp.zeros_like(x.value))
            x = dataclasses.replace(x, value=value, layout=x.layout.with_partial(x.layout.partial + (axis,)))
    for dim, (have, want) in enumerate(zip(x.layout.dims, target.dims)):
        if have == want:
            continue
        x = gather_dim(ctx, x, dim)
    for dim, want in enumerate(target.dims):
        if want and not x.layout.dims[dim]:
            if any(a in x.layout.split_axes() for a in want):
                x = gather_dim(ctx, x, x.layout.dims.index(next(d for d in x.layout.dims if set(d) & set(want))))
            x = split_dim(ctx, x, dim, want)
    return x


def to_sharded(value, layout: Layout, shape, dtype) -> Sharded:
    return Sharded(value, layout, tuple(shape), np.dtype(dtype) if not hasattr(dtype, "name") else dtype)


def aval_bytes(x) -> int:
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
