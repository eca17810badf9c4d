"""The collectives the explicit lowering emits, on values that know their layout.

Every function takes and returns `Sharded` values; payload sizes are read back later from
the emitted program (`program_collectives`), so nothing here keeps counts.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.lowering.explicit.layout import Axes, Layout

if TYPE_CHECKING:
    from xtrain.remat import LayerRemat

from jax._src.lax.parallel import all_gather_invariant  # noqa: E402  (no public name in jax 0.10)



class RegatherPolicy:
    """jax.checkpoint policy of ZeRO-3's re-gather: keep every value but the all-gathers over
    the batch axes (ZeRO-3's gathered parameters: activations are never gathered over them),
    which the backward pass then gathers again; nothing else is recomputed.

    A layer scan gathers each layer's shards as one flat buffer (`gather_flat`) and cuts it
    back into tensors; the ops of that unpacking must not be saved either (their outputs are
    the gathered weights). A policy sees an operation and its operands' types, not where the
    operands come from, so `gather_flat` records the (shape, dtype) of every operand it
    unpacks in `unpacking`, and reshapes, transposes, splits and concatenations of such
    operands are recomputed. An activation of the same type is then recomputed from its own
    saved input: the same bytes kept, never a wrong value."""

    _UNPACK_OPS = frozenset({"reshape", "transpose", "split", "concatenate"})

    def __init__(self, batch_axes: Axes):
        self.batch_axes = tuple(batch_axes)
        self.unpacking: set[tuple] = set()

    def record(self, *values) -> None:
        self.unpacking.update((tuple(v.shape), str(v.dtype)) for v in values)

    def __call__(self, prim, *avals, **params) -> bool:
        name = str(prim)
        if name == "all_gather":
            axes = params["axis_name"]
            return not set(axes if isinstance(axes, tuple) else (axes,)) <= set(self.batch_axes)
        if name in self._UNPACK_OPS and avals:
            return (tuple(avals[0].shape), str(avals[0].dtype)) not in self.unpacking
        return True


@dataclasses.dataclass
class Sharded:
    """A value of the global program: its local array and how it is split."""

    value: Any            # local array (a tracer inside shard_map)
    layout: Layout
    shape: tuple[int, ...]  # global shape
    dtype: Any
    param: bool = False     # a model parameter as stored (gathers of it are recomputed in backward)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclasses.dataclass
class Context:
    """Per-lowering facts: mesh axis sizes and what fell back to replicated execution."""

    sizes: Mapping[str, int]
    module_paths: frozenset = frozenset()
    batch_axes: tuple = ()  # axes the batch is split on (gathers of parameters over them are ZeRO-3's)
    fallbacks: dict[str, set[str]] = dataclasses.field(default_factory=dict)  # primitive -> module paths
    path: str = ""
    # conversions already emitted in the jaxpr being interpreted (see `memoized`)
    memo: dict = dataclasses.field(default_factory=dict)
    remat: "LayerRemat | None" = None  # activation checkpointing of each layer of a layer scan
    regather: "RegatherPolicy | None" = None  # ZeRO-3's re-gather of weights in each layer scan step
    unroll: bool = False  # repeated blocks emitted one after another instead of as a layer scan
    layer: tuple[str, str] | None = None  # (block 0's module path, the unrolled layer's) while emitting it

    def note_fallback(self, primitive: str) -> None:
        self.fallbacks.setdefault(primitive, set()).add(self.path or "<top level>")


def vma(x) -> frozenset:
    """Mesh axes a value varies over inside shard_map (empty for constants and Python scalars)."""
    if not (isinstance(x, jax.Array) or hasattr(x, "aval")):
        return frozenset()
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax 0.10: aval.mat.varying; older releases: aval.vma
    return mat.varying if mat is not None else getattr(aval, "vma", frozenset())


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
    index = 0
    for a in axes:
        index = index * ctx.sizes[a] + lax.axis_index(a)
    return index


def resolve(ctx: Context, x: Sharded, axes: Axes | None = None) -> Sharded:
    """Sums pending partial addends (all of them, or only `axes`) with one all-reduce."""
    axes = x.layout.partial if axes is None else tuple(a for a in x.layout.partial if a in axes)
    if not axes:
        return x
    return memoized(ctx, ("psum", id(x.value), x.layout, axes), x.value, lambda: dataclasses.replace(
        x, value=lax.psum(x.value, axes),
        layout=x.layout.with_partial(tuple(a for a in x.layout.partial if a not in axes))))


def scatter_partial(ctx: Context, x: Sharded, dim: int, axes: Axes) -> Sharded:
    """Sums the pending addends over `axes` and keeps this device's slice of the whole
    dimension `dim`: one reduce-scatter, where all-reduce + slice would move twice the bytes."""
    assert not x.layout.dims[dim] and set(axes) <= set(x.layout.partial)
    name = axes if len(axes) > 1 else axes[0]
    dims = list(x.layout.dims)
    dims[dim] = tuple(axes)
    layout = Layout(tuple(dims), tuple(a for a in x.layout.partial if a not in axes))
    return memoized(ctx, ("psum_scatter", id(x.value), x.layout, dim, axes), x.value, lambda: dataclasses.replace(
        x, value=lax.psum_scatter(x.value, name, scatter_dimension=dim, tiled=True), layout=layout))


def resolve_all(ctx: Context, xs) -> list[Sharded]:
    return [resolve(ctx, x) for x in xs]


def _all_gather(ctx: Context, x: Sharded, axes: Axes, dim: int, varying: bool):
    name = axes if len(axes) > 1 else axes[0]
    if x.param and set(axes) <= set(ctx.batch_axes):
        # ZeRO-3/FSDP: varying, so the gradient comes back reduce-scattered (the transpose);
        # the re-gather policy (RegatherPolicy) gathers it again in the backward pass.
        return lax.all_gather(x.value, name, axis=dim, tiled=True)
    if varying:  # the consumer varies over `axes` anyway: the transpose is one reduce-scatter
        return lax.all_gather(x.value, name, axis=dim, tiled=True)
    # Once gathered, every device along `axes` holds the same values: say so (invariant), so
    # the rest of the program is not typed as varying over axes it does not vary over.
    return all_gather_invariant(x.value, name, axis=dim, tiled=True)


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
    gather = lambda: dataclasses.replace(x, value=_all_gather(ctx, x, axes, dim, varying),
                                         layout=x.layout.with_dims(dims))
    if x.param and set(axes) <= set(ctx.batch_axes):
        # ZeRO-3 (always varying): a parameter read twice (a tied embedding: the lookup and
        # the head) is gathered once, as XLA does; the backward pass gathers it once again
        varying = True
    return memoized(ctx, ("all_gather", id(x.value), x.layout, dim, axes, varying), x.value, gather)


def _zero3_dim(ctx: Context, x: Sharded) -> tuple[int, Axes] | None:
    """(dim, batch axes) of a ZeRO-3 parameter shard whose batch axes can be gathered alone
    (the minor axes of its dim), else None."""
    if not x.param:
        return None
    for dim, have in enumerate(x.layout.dims):
        axes = tuple(a for a in have if a in ctx.batch_axes)
        if axes:
            return (dim, axes) if have[len(have) - len(axes):] == axes else None
    return None


def gather_flat(ctx: Context, params: list[Sharded], vectors_apart: bool = False) -> list[Sharded]:
    """ZeRO-3 in repeated blocks: gathers one layer's parameter shards over the batch axes with
    one all-gather (FSDP's flat parameter) per group of shards that share dtype, batch axes and
    varying axes, then cuts the result back into tensors. Its transpose is one reduce-scatter
    of the layer's gradients. Parameters that are not ZeRO-3 shards pass through.
    `vectors_apart`: 1-D parameters (norm weights, biases) form groups of their own."""
    out, groups = list(params), {}
    for index, x in enumerate(params):
        found = _zero3_dim(ctx, x)
        if found is not None:
            key = (found[1], str(x.dtype), vma(x.value), vectors_apart and len(x.shape) <= 1)
            groups.setdefault(key, []).append((index, found[0]))
    for (axes, _, _, _), members in groups.items():
        values = _gather_flat(ctx, [params[i].value for i, _ in members], [d for _, d in members], axes)
        for (index, dim), value in zip(members, values):
            x = params[index]
            dims = list(x.layout.dims)
            dims[dim] = dims[dim][: len(dims[dim]) - len(axes)]
            out[index] = dataclasses.replace(x, value=value, layout=x.layout.with_dims(dims))
    return out


def _gather_flat(ctx: Context, shards: list, dims: list[int], axes: Axes) -> list:
    name = axes if len(axes) > 1 else axes[0]
    if len(shards) == 1:
        return [lax.all_gather(shards[0], name, axis=dims[0], tiled=True)]
    n = math.prod(ctx.sizes[a] for a in axes)
    record = ctx.regather.record if ctx.regather is not None else (lambda *_: None)
    flat = [s.reshape(-1) for s in shards]
    record(*shards, *flat)
    whole = lax.all_gather(jnp.concatenate(flat), name, axis=0)  # (n, sum of shard sizes): device-major
    record(whole)
    out = []
    for shard, dim, piece in zip(shards, dims, lax.split(whole, [s.size for s in shards], axis=1)):
        blocks = piece.reshape((n,) + shard.shape)
        moved = jnp.moveaxis(blocks, 0, dim)  # device index next to the local rows of `dim`
        record(piece, blocks, moved)
        out.append(moved.reshape(shard.shape[:dim] + (n * shard.shape[dim],) + shard.shape[dim + 1:]))
    return out


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
