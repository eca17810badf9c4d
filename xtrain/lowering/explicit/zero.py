"""The optimizer update on each device, with ZeRO's sharded optimizer state.

    stage 0, 3   update the local parameter (whole, or already a ZeRO-3 shard) in place
    stage 1      gradients all-reduced; each device updates its slice of every tensor
                 (its optimizer-state shard), then all-gathers the new parameter
    stage 2      as 1, but gradients are reduce-scattered straight to the slice

Stages 1 and 2 bucket their collectives as the gradient all-reduce does (`bucket_bytes`):
each tensor is cut into one block per device along its split dimension, laid out as rows
(n, block), the rows of a bucket's tensors side by side, and one reduce-scatter / all-gather
moves the whole bucket. A collective has a fixed cost on every backend (a launch; on XLA:CPU
with gloo about 1-4 ms), so one per tensor per layer made ZeRO-1 on the 4-layer GPT unrolled
over 2 processes 1.7x slower than data parallel. The price is memory: a ZeRO-2 bucket's
gradients all exist whole before its reduce-scatter (at most `bucket_bytes` more than
scattering tensor by tensor; a smaller `GradSync(bucket_bytes=...)` trades collectives back
for memory).
"""
from __future__ import annotations

import math
from typing import Mapping

import jax
import jax.numpy as jnp
import optax
from jax import lax

from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.sharding.plan import Spec, _axes_of

from xtrain.lowering.explicit.collectives import all_gather_invariant, vma  # gathered: same on every device
from xtrain.lowering.explicit.gradient_sync import buckets


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


def _split_dim(param_spec: Spec, opt_spec: Spec, data_axes) -> int | None:
    """The dimension the optimizer state is split on beyond the parameter's own split."""
    for dim, entry in enumerate(opt_spec):
        extra = set(_axes_of(entry)) - set(_axes_of(param_spec[dim] if dim < len(param_spec) else None))
        if extra & set(data_axes):
            return dim
    return None


class Update:
    """Applies the optax transformation to local shards for a ZeRO stage."""

    def __init__(self, sizes: Mapping[str, int], data_axes: tuple[str, ...], param_specs: Mapping[str, Spec],
                 optimizer_specs: Mapping[str, Spec], stage: int, tx: optax.GradientTransformation,
                 grad_tx: GradTransforms = GradTransforms(), bucket_bytes: int | None = 25 * 2**20):
        self.sizes, self.data_axes, self.stage, self.tx, self.grad_tx = sizes, data_axes, stage, tx, grad_tx
        self.bucket_bytes = bucket_bytes
        self.n = math.prod(sizes[a] for a in data_axes)
        self.param_axes = {n: tuple(a for e in s for a in _axes_of(e)) for n, s in param_specs.items()}
        self.dims = {n: _split_dim(param_specs[n], optimizer_specs[n], data_axes) if stage in (1, 2) else None
                     for n in param_specs}

    def scatters(self, name: str) -> bool:
        return self.stage == 2 and self.dims.get(name) is not None

    def _offset(self):
        index = 0
        for a in self.data_axes:
            index = index * self.sizes[a] + lax.axis_index(a)
        return index

    def _slice(self, x, dim):
        local = x.shape[dim] // self.n
        return lax.dynamic_slice_in_dim(x, self._offset() * local, local, axis=dim)

    def _buckets(self, values: Mapping[str, jax.Array], whole_bytes) -> list[list[str]]:
        """Names in buckets of about `bucket_bytes` (whole-tensor bytes); one bucket holds
        tensors of one dtype that vary over the same mesh axes."""
        groups: dict[tuple, dict[str, int]] = {}
        for name, v in values.items():
            key = (v.dtype, tuple(sorted(vma(v))))
            groups.setdefault(key, {})[name] = whole_bytes(v)
        return [b for sizes in groups.values() for b in buckets(sizes, self.bucket_bytes)]

    def _reduce_scatter(self, grads: Mapping[str, jax.Array], split: Mapping[str, int]) -> dict:
        """Each gradient summed over the data axes, this device keeping its block (ZeRO-2)."""
        out = {}
        for index, bucket in enumerate(self._buckets(grads, lambda g: g.size * g.dtype.itemsize)):
            with jax.named_scope(f"xtrain.zero.reduce_scatter.bucket{index}[{bucket[0]}..{bucket[-1]}]"):
                rows = [_rows(grads[n], split[n], self.n) for n in bucket]
                mine = lax.psum_scatter(jnp.concatenate(rows, axis=1), self.data_axes, scatter_dimension=0)
                for n, block in zip(bucket, _split_columns(mine, [r.shape[1] for r in rows])):
                    shape = list(grads[n].shape)
                    shape[split[n]] //= self.n
                    out[n] = block.reshape(shape)
        return out

    def _all_gather(self, shards: Mapping[str, jax.Array], split: Mapping[str, int]) -> dict:
        """Every device's block of each updated parameter, joined: the whole parameter."""
        out = {}
        for index, bucket in enumerate(self._buckets(shards, lambda v: v.size * v.dtype.itemsize * self.n)):
            with jax.named_scope(f"xtrain.zero.all_gather.bucket{index}[{bucket[0]}..{bucket[-1]}]"):
                flat = jnp.concatenate([shards[n].ravel() for n in bucket])
                rows = all_gather_invariant(flat, self.data_axes, axis=0, tiled=False)  # (n, bucket)
                for n, block in zip(bucket, _split_columns(rows, [shards[n].size for n in bucket])):
                    out[n] = _unrows(block, split[n], shards[n].shape)
        return out

    def _split_axes(self, split: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
        """Mesh axes each (local) gradient is split over: its parameter's own, plus the data
        axes where the optimizer works on a slice (ZeRO-1/2)."""
        return {n: axes + (self.data_axes if n in split else ()) for n, axes in self.param_axes.items()}

    def __call__(self, grads: dict, opt_state, params: dict, lrs=None, scale=None):
        """(new parameters, new optimizer state, global gradient norm or None) from
        synchronised (or, ZeRO-2, raw) gradients; `lrs` per param group, `scale` fp16's."""
        split = {n: d for n, d in self.dims.items() if d is not None and n in params}
        shard_p = {n: self._slice(p, split[n]) if n in split else p for n, p in params.items()}
        if self.stage == 2:  # last layers' gradients first, as the backward pass makes them
            scattered = self._reduce_scatter({n: grads[n] for n in reversed(list(grads)) if n in split}, split)
        else:
            scattered = {n: self._slice(g, split[n]) for n, g in grads.items() if n in split}
        shard_g = {n: scattered.get(n, g) for n, g in grads.items()}
        shard_g, norm = self.grad_tx.before_update(shard_g, self._split_axes(split), scale)
        updates, opt_state = self.tx.update(shard_g, opt_state, shard_p)
        new = optax.apply_updates(shard_p, self.grad_tx.scale_lr(updates, lrs))
        gathered = self._all_gather({n: v for n, v in new.items() if n in split}, split)
        return {n: gathered.get(n, v) for n, v in new.items()}, opt_state, norm
