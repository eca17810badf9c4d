"""The optimizer update on each device, with ZeRO's sharded optimizer state.

    stage 0, 3   update the local parameter (whole, or already a ZeRO-3 shard) in place
    stage 1      gradients all-reduced; each device updates its slice of every tensor
                 (its optimizer-state shard), then all-gathers the new parameter
    stage 2      as 1, but gradients are reduce-scattered straight to the slice
"""
from __future__ import annotations

import math
from typing import Mapping

import optax
from jax import lax

from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.sharding.plan import Spec, _axes_of

from xtrain.lowering.explicit.collectives import all_gather_invariant  # every device: same new parameter


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
                 grad_tx: GradTransforms = GradTransforms()):
        self.sizes, self.data_axes, self.stage, self.tx, self.grad_tx = sizes, data_axes, stage, tx, grad_tx
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
        local = x.shape[dim] // math.prod(self.sizes[a] for a in self.data_axes)
        return lax.dynamic_slice_in_dim(x, self._offset() * local, local, axis=dim)

    def _shard_grad(self, g, dim):
        if self.stage == 2:
            return lax.psum_scatter(g, self.data_axes, scatter_dimension=dim, tiled=True)
        return self._slice(g, dim)

    def _split_axes(self, split: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
        """Mesh axes each (local) gradient is split over: its parameter's own, plus the data
        axes where the optimizer works on a slice (ZeRO-1/2)."""
        return {n: axes + (self.data_axes if n in split else ()) for n, axes in self.param_axes.items()}

    def __call__(self, grads: dict, opt_state, params: dict, lrs=None, scale=None):
        """(new parameters, new optimizer state, global gradient norm or None) from
        synchronised (or, ZeRO-2, raw) gradients; `lrs` per param group, `scale` fp16's."""
        split = {n: d for n, d in self.dims.items() if d is not None and n in params}
        shard_p = {n: self._slice(p, split[n]) if n in split else p for n, p in params.items()}
        shard_g = {n: self._shard_grad(g, split[n]) if n in split else g for n, g in grads.items()}
        shard_g, norm = self.grad_tx.before_update(shard_g, self._split_axes(split), scale)
        updates, opt_state = self.tx.update(shard_g, opt_state, shard_p)
        new = optax.apply_updates(shard_p, self.grad_tx.scale_lr(updates, lrs))
        return {n: all_gather_invariant(v, self.data_axes, axis=split[n], tiled=True) if n in split else v
                for n, v in new.items()}, opt_state, norm
