"""ZeRO in the lowering: everything that depends on the stage lives here (the specs and the
dimension each tensor is split on: xtrain.sharding.zero, shared with the presets).

    stage 0      every device updates its whole parameter copy
    stage 1      gradients all-reduced; each device updates its slice of every tensor (its
                 optimizer-state shard), then all-gathers the new parameters (`Update`)
    stage 2      as 1, but gradients are reduce-scattered straight to the slice (in the layer
                 scan, per layer inside the backward pass: `scatter_in_layer`)
    stage 3      parameters stored split: each use gathers the shards (`gather_flat`: one flat
                 all-gather per layer in the repeated blocks, FSDP's flat parameter), and the
                 backward pass gathers them again (`RegatherPolicy`); the gradients leave as
                 the gathers' transpose, a reduce-scatter. The update is local.

Stages 1 and 2 bucket their collectives as the gradient all-reduce does (`bucket_bytes`):
each tensor is cut into one block per device along its split dimension, laid out as rows
(n, block), the rows of a bucket's tensors side by side, and one reduce-scatter / all-gather
moves the whole bucket: a collective has a fixed cost on every backend (a launch), so one per
tensor per layer costs more than the bytes. The price is memory: a ZeRO-2 bucket's gradients
all exist whole before its reduce-scatter (at most `bucket_bytes` more than scattering tensor
by tensor; a smaller `GradSync(bucket_bytes=...)` trades collectives back for memory).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import optax
from jax import lax

from xtrain.ir.stacked import is_stacked
from xtrain.ir.trust_ratio import SUM_SQUARES
from xtrain.lowering import clipping, collectives, fp8, int8_sync
from xtrain.lowering.sharded import Axes
from xtrain.lowering.collectives import vma
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded
from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.lowering.gradient_sync import GradSync, buckets
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.plan import Spec, axes_of


def _rows(x, dim: int, n: int):
    """x cut into n blocks along `dim`, as (n, block size): row d is block d, flattened."""
    x = x.reshape(x.shape[:dim] + (n, x.shape[dim] // n) + x.shape[dim + 1:])
    return jnp.moveaxis(x, dim, 0).reshape(n, -1)


def _unrows(rows, dim: int, block_shape: tuple[int, ...]):
    """Inverse of `_rows`: (n, block size) -> the whole tensor, the n blocks joined along `dim`."""
    n = rows.shape[0]
    x = jnp.moveaxis(rows.reshape((n,) + block_shape), 0, dim)
    return x.reshape(block_shape[:dim] + (n * block_shape[dim],) + block_shape[dim + 1:])


def _split_columns(flat, sizes: list[int]) -> list:
    out, offset = [], 0
    for size in sizes:
        out.append(flat[..., offset:offset + size])
        offset += size
    return out


def _split_dim(param_spec: Spec, opt_spec: Spec, data_axes) -> tuple[int | None, tuple[str, ...]]:
    """(the dimension the optimizer state is split on beyond the parameter's own split, the data
    axes of that split): all of them, or those the parameter leaves free (an expert weight split
    over `expert` has its ZeRO split over `data` alone); (None, ()) when it is not split."""
    for dim, entry in enumerate(opt_spec):
        extra = set(axes_of(entry)) - set(axes_of(param_spec[dim] if dim < len(param_spec) else None))
        if extra & set(data_axes):
            return dim, tuple(a for a in data_axes if a in extra)
    return None, ()


# -- ZeRO-1/2: the sharded update -----------------------------------------------------------------
class Update:
    """Applies the optax transformation to local shards for a ZeRO stage (every stage: stages
    0 and 3 update the local parameter, whole or already a shard, in place)."""

    def __init__(self, sizes: Mapping[str, int], data_axes: tuple[str, ...], param_specs: Mapping[str, Spec],
                 optimizer_specs: Mapping[str, Spec], stage: int, tx: optax.GradientTransformation,
                 grad_tx: GradTransforms = GradTransforms(), sync: GradSync = GradSync()):
        self.sizes, self.data_axes, self.stage, self.tx, self.grad_tx = sizes, data_axes, stage, tx, grad_tx
        self.sync, self.bucket_bytes = sync, sync.bucket_bytes
        self.param_axes = {n: tuple(a for e in s for a in axes_of(e)) for n, s in param_specs.items()}
        # a stacked array's rows are layers (split over the pipeline axis, if at all), not parts of one tensor
        self.row_axes = {n: tuple(axes_of(s[0])) if is_stacked(n) and s else () for n, s in param_specs.items()}
        splits = {n: _split_dim(param_specs[n], optimizer_specs[n], data_axes) if stage in (1, 2) else (None, ())
                  for n in param_specs}
        self.dims = {n: d for n, (d, _) in splits.items()}
        self.axes = {n: a for n, (_, a) in splits.items()}  # each tensor's ZeRO axes

    def parts(self, name: str) -> int:
        """How many blocks tensor `name` is cut into (the size of its ZeRO axes)."""
        return math.prod(self.sizes[a] for a in self.axes[name])

    @classmethod
    def of_layout(cls, layout: StateLayout, tx: optax.GradientTransformation, grad_tx: GradTransforms,
                  sync: GradSync) -> "Update":
        """The update of a step laid out by `layout` (per-device program); ZeRO-2's reduce-scatter
        buckets and wire dtype are the gradient sync's (`sync`)."""
        return cls(layout.sizes, layout.batch_axes, layout.param_specs, layout.optimizer_specs, layout.zero, tx,
                   grad_tx, sync)

    @classmethod
    def global_view(cls, names, tx: optax.GradientTransformation, grad_tx: GradTransforms) -> "Update":
        """The update of a global-view program (XLA's partitioner): every tensor whole, no axes."""
        whole = {n: () for n in names}
        return cls({}, (), whole, whole, 0, tx, grad_tx, GradSync(bucket_bytes=None))

    def scatters(self, name: str) -> bool:
        return self.stage == 2 and self.dims.get(name) is not None

    def shard(self, name: str, x):
        """This device's block of `x` (parameter `name`, local) on its ZeRO dimension: the
        block its ZeRO-2 gradient and optimizer state hold. No communication."""
        return self._slice(x, name)

    def _slice(self, x, name: str):
        dim, axes = self.dims[name], self.axes[name]
        local = x.shape[dim] // self.parts(name)
        return lax.dynamic_slice_in_dim(x, collectives.axis_offset(self.sizes, axes) * local, local, axis=dim)

    def _buckets(self, values: Mapping[str, jax.Array], whole_bytes) -> list[list[str]]:
        """Names in buckets of about `bucket_bytes` (whole-tensor bytes); one bucket holds
        tensors of one dtype that vary over the same mesh axes and are split over the same ZeRO axes."""
        groups: dict[tuple, dict[str, int]] = {}
        for name, v in values.items():
            key = (v.dtype, tuple(sorted(vma(v))), self.axes.get(name, ()))
            groups.setdefault(key, {})[name] = whole_bytes(name, v)
        return [b for sizes in groups.values() for b in buckets(sizes, self.bucket_bytes)]

    def _reduce_scatter(self, grads: Mapping[str, jax.Array], split: Mapping[str, int]) -> tuple[dict, dict]:
        """(each gradient summed over the data axes, this device keeping its block (ZeRO-2), on the
        wire in the gradient sync's dtype (bfloat16 under a bf16 precision policy); the int8
        residual of each gradient, empty unless GradSync(comm_dtype="int8"))."""
        out, dropped = {}, {}
        for index, bucket in enumerate(self._buckets(grads, lambda _, g: g.size * g.dtype.itemsize)):
            with jax.named_scope(f"xtrain.zero.reduce_scatter.bucket{index}[{bucket[0]}..{bucket[-1]}]"):
                dtype = grads[bucket[0]].dtype
                wire = dtype if self.sync.int8 else (self.sync.comm_dtype or dtype)  # int8 quantizes per chunk
                axes, parts = self.axes[bucket[0]], self.parts(bucket[0])
                rows = [_rows(grads[n].astype(wire), split[n], parts) for n in bucket]
                widths, blocks = [r.shape[1] for r in rows], {}
                for n in bucket:
                    blocks[n] = list(grads[n].shape)
                    blocks[n][split[n]] //= parts
                if self.sync.int8:  # all-to-all of int8 rows, summed in fp32 (xtrain.lowering.int8_sync)
                    mine, left = int8_sync.reduce_scatter(jnp.concatenate(rows, axis=1), axes, self.sync.int8_chunk)
                    dropped.update({n: _unrows(r, split[n], tuple(blocks[n]))
                                    for n, r in zip(bucket, _split_columns(left, widths))})
                else:
                    mine = collectives.reduce_scatter(jnp.concatenate(rows, axis=1), axes, 0, tiled=False)
                out.update({n: b.astype(dtype).reshape(blocks[n])
                            for n, b in zip(bucket, _split_columns(mine, widths))})
        return out, dropped

    def _all_gather(self, shards: Mapping[str, jax.Array], split: Mapping[str, int]) -> dict:
        """Every device's block of each updated parameter, joined: the whole parameter."""
        out = {}
        for index, bucket in enumerate(self._buckets(shards, lambda n, v: v.size * v.dtype.itemsize * self.parts(n))):
            with jax.named_scope(f"xtrain.zero.all_gather.bucket{index}[{bucket[0]}..{bucket[-1]}]"):
                flat = jnp.concatenate([shards[n].ravel() for n in bucket])
                rows = collectives.all_gather(flat, self.axes[bucket[0]], 0, tiled=False, invariant=True)  # (n, bucket)
                for n, block in zip(bucket, _split_columns(rows, [shards[n].size for n in bucket])):
                    out[n] = _unrows(block, split[n], shards[n].shape)
        return out

    def _split_axes(self, split: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
        """Mesh axes each (local) gradient is split over: its parameter's own, plus the data
        axes where the optimizer works on a slice (ZeRO-1/2)."""
        return {n: axes + (self.axes[n] if n in split else ()) for n, axes in self.param_axes.items()}

    def _sum_squares(self, split: Mapping[str, int]):
        """Per-tensor (per-layer) sums over the shards, for transformations that need whole
        norms (LARS / LAMB's trust ratios: xtrain.ir.trust_ratio)."""
        axes = {n: tuple(a for a in ax if a not in self.row_axes[n]) for n, ax in self._split_axes(split).items()}
        return lambda partial: clipping.sum_over_shards(partial, axes)

    def __call__(self, grads: dict, opt_state, params: dict, lrs=None, scale=None, shards=frozenset()):
        """(new parameters, new optimizer state, global gradient norm or None, int8 residuals of
        ZeRO-2's reduce-scatter) from synchronised (or, ZeRO-2, raw) gradients; `lrs` per param
        group, `scale` fp16's. `shards`: ZeRO-2 gradients already reduce-scattered to this
        device's block (by the layer scan's backward pass: `scatter_in_layer`)."""
        split = {n: d for n, d in self.dims.items() if d is not None and n in params}
        shard_p = {n: self._slice(p, n) if n in split else p for n, p in params.items()}
        dropped = {}
        if self.stage == 2:  # last layers' gradients first, as the backward pass makes them
            order = [n for n in reversed(list(grads)) if n in split and n not in shards]
            scattered, dropped = self._reduce_scatter({n: grads[n] for n in order}, split)
            scattered.update({n: grads[n] for n in shards})
        else:
            scattered = {n: self._slice(g, n) for n, g in grads.items() if n in split}
        shard_g = {n: scattered.get(n, g) for n, g in grads.items()}
        shard_g, norm = self.grad_tx.before_update(shard_g, self._split_axes(split), scale)
        updates, opt_state = optax.with_extra_args_support(self.tx).update(
            shard_g, opt_state, shard_p, **{SUM_SQUARES: self._sum_squares(split)})
        new = optax.apply_updates(shard_p, self.grad_tx.scale_lr(updates, lrs))
        gathered = self._all_gather({n: v for n, v in new.items() if n in split}, split)
        return {n: gathered.get(n, v) for n, v in new.items()}, opt_state, norm, dropped


def scatter_in_layer(shards: list, wholes: list, dims: list[int], axes: Axes, sync: GradSync, label: str) -> list:
    """ZeRO-2 in the layer scan: one layer's parameters (`wholes`, the same on every device of
    `axes`) cast to varying over `axes` by an identity whose derivative reduce-scatters their
    gradients as one bucket where the backward pass reaches this layer (named
    `xtrain.grad_sync.in_backward[label]`), each device keeping its block of dimension `dims[i]`:
    the block `Update` keeps. A derivative has its primal's shape, so it goes to `shards` (this
    device's blocks of the parameters, the differentiated inputs); `wholes` get zeros."""
    n = math.prod(lax.axis_size(a) for a in axes)
    like = [(s.shape, s.dtype) for s in shards]
    kinds = [(w.shape, w.dtype, tuple(sorted(vma(w)))) for w in wholes]

    @jax.custom_vjp
    def identity(shards, wholes):
        return [lax.pcast(w, axes, to="varying") for w in wholes]

    def forward(shards, wholes):
        return identity(shards, wholes), None

    def backward(_, grads):
        with jax.named_scope(f"xtrain.grad_sync.in_backward[{label}]"):
            wire = sync.comm_dtype or grads[0].dtype
            rows = [_rows(g.astype(wire), d, n) for g, d in zip(grads, dims)]
            mine = collectives.reduce_scatter(jnp.concatenate(rows, axis=1), axes, 0, tiled=False)
            out = [b.astype(dtype).reshape(shape)
                   for (shape, dtype), b in zip(like, _split_columns(mine, [r.shape[1] for r in rows]))]
        zeros = [jnp.zeros(shape, dtype) for shape, dtype, _ in kinds]
        zeros = [lax.pcast(z, v, to="varying") if v else z for z, (_, _, v) in zip(zeros, kinds)]
        return out, zeros

    identity.defvjp(forward, backward)
    return identity(list(shards), list(wholes))


# -- ZeRO-3: gathering parameter shards ---------------------------------------------------------
class RegatherPolicy:
    """jax.checkpoint policy of ZeRO-3's re-gather: keep every value but the all-gathers over
    the batch axes (ZeRO-3's gathered parameters: activations are never gathered over them),
    which the backward pass then gathers again; nothing else is recomputed.

    A layer scan gathers each layer's shards as one flat buffer (`gather_flat`) and cuts it
    back into tensors (and, gathered in the compute dtype, casts them back to the traced
    dtype); the ops of that unpacking must not be saved either (their outputs are the gathered
    weights), nor the compute-dtype casts that read them. A policy sees an operation and its
    operands' types, not where the operands come from, so `gather_flat` records the (shape,
    dtype) of every operand it unpacks in `unpacking` (Context.unpacked), and reshapes,
    transposes, splits, concatenations and casts of such operands are recomputed. An activation of the same type is then recomputed from its own
    saved input: the same bytes kept, never a wrong value."""

    _UNPACK_OPS = frozenset({"reshape", "transpose", "split", "concatenate", "convert_element_type"})

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


def _zero3_dim(ctx: Context, x: Sharded) -> tuple[int, Axes] | None:
    """(dim, batch axes) of a ZeRO-3 parameter shard whose batch axes can be gathered alone
    (the minor axes of its dim), else None."""
    if not x.zero:
        return None
    for dim, have in enumerate(x.layout.dims):
        axes = tuple(a for a in have if a in x.zero)
        if axes:
            return (dim, axes) if have[len(have) - len(axes):] == axes else None
    return None


AT_USE = "at use"  # `narrowed`: gathered by its uses, after their own cast (FP8 matmuls' weights)


def narrowed(jaxpr, index: int):
    """How ZeRO-3 gathers `jaxpr.invars[index]`: in the dtype every use casts it to, when every
    use is one cast to one narrower float dtype (a weight read only by the compute dtype's
    matmuls: bf16 under Plan(precision="bf16")); AT_USE when every use is an FP8 matmul (which
    quantizes the shard with the whole tensor's scale and gathers the e4m3 bytes: the values
    quantizing the gathered weight gives, a quarter of float32's bytes); else None (as stored)."""
    var = jaxpr.invars[index]
    if not jnp.issubdtype(var.aval.dtype, jnp.floating) or any(v is var for v in jaxpr.outvars):
        return None
    uses = [e for e in jaxpr.eqns if any(v is var for v in e.invars)]
    if uses and all(fp8.is_matmul(e) and e.invars[1] is var and e.invars[0] is not var for e in uses):
        return AT_USE
    casts = {jnp.dtype(e.params["new_dtype"]) for e in uses if e.primitive.name == "convert_element_type"}
    if not uses or len(casts) != 1 or any(e.primitive.name != "convert_element_type" for e in uses):
        return None
    (dtype,) = casts
    return dtype if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < var.aval.dtype.itemsize else None


def gather_flat(ctx: Context, params: list[Sharded], vectors_apart: bool = False,
                narrow: list | None = None) -> list[Sharded]:
    """ZeRO-3 in repeated blocks: gathers one layer's parameter shards over the batch axes with
    one all-gather (FSDP's flat parameter) per group of shards that share dtype, batch axes and
    varying axes, then cuts the result back into tensors. Its transpose is one reduce-scatter
    of the layer's gradients. Parameters that are not ZeRO-3 shards pass through.
    `vectors_apart`: 1-D parameters (norm weights, biases) form groups of their own.
    `narrow`: per parameter, a dtype to gather it in (`narrowed`: the one its every use casts
    it to; cast first, the gather and its reduce-scatter move that dtype's bytes) or None."""
    out, groups = list(params), {}
    narrow = narrow or [None] * len(params)
    for index, x in enumerate(params):
        found = _zero3_dim(ctx, x) if narrow[index] != AT_USE else None
        if found is not None:
            dtype = narrow[index] or x.dtype
            key = (found[1], str(dtype), vma(x.value), vectors_apart and len(x.shape) <= 1)
            groups.setdefault(key, []).append((index, found[0]))
    for (axes, dtype, _, _), members in groups.items():
        values = _gather_flat(ctx, [params[i].value.astype(dtype) for i, _ in members], [d for _, d in members], axes)
        for (index, dim), value in zip(members, values):
            x = params[index]
            if value.dtype != x.dtype:  # the traced dtype again (exact): the body's cast undoes it
                ctx.unpacked(value)
                value = value.astype(x.dtype)
                ctx.unpacked(value)
            dims = list(x.layout.dims)
            dims[dim] = dims[dim][: len(dims[dim]) - len(axes)]
            out[index] = dataclasses.replace(x, value=value, layout=x.layout.with_dims(dims))
    return out


def _gather_flat(ctx: Context, shards: list, dims: list[int], axes: Axes) -> list:
    if len(shards) == 1:
        return [collectives.all_gather(shards[0], axes, dims[0])]
    n = math.prod(ctx.sizes[a] for a in axes)
    flat = [s.reshape(-1) for s in shards]
    ctx.unpacked(*shards, *flat)
    whole = collectives.all_gather(jnp.concatenate(flat), axes, 0, tiled=False)  # (n, sum of sizes): device-major
    ctx.unpacked(whole)
    out = []
    for shard, dim, piece in zip(shards, dims, lax.split(whole, [s.size for s in shards], axis=1)):
        blocks = piece.reshape((n,) + shard.shape)
        moved = jnp.moveaxis(blocks, 0, dim)  # device index next to the local rows of `dim`
        ctx.unpacked(piece, blocks, moved)
        out.append(moved.reshape(shard.shape[:dim] + (n * shard.shape[dim],) + shard.shape[dim + 1:]))
    return out
