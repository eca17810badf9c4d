"""Norms of tensors split over mesh axes: gradient clipping by global norm, and the per-tensor
(per-layer) norms of LARS / LAMB's trust ratios (`sum_over_shards`).

Each gradient's local sum of squares is summed over exactly the mesh axes its tensor is
split over (tensor-parallel shards, ZeRO-3 shards, ZeRO-1/2 optimizer-state slices); a
replicated gradient is counted once, not once per device. Local sums that share a set of axes
are added first, so there is one all-reduce per distinct set. In the global view (XLA's
partitioner) every tensor is whole and no axis is named.

The clip factor is torch's (`torch.nn.utils.clip_grad_norm_`): max_norm / (norm + 1e-6),
at most 1.
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from xtrain.lowering import collectives

TORCH_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ adds it to the norm


def global_norm(grads: Mapping[str, jnp.ndarray], split_axes: Mapping[str, tuple[str, ...]]) -> jnp.ndarray:
    """sqrt(sum of every gradient's squares), each tensor counted once across the mesh.

    Args:
        grads: local gradient values (shards where split).
        split_axes: name -> the mesh axes that gradient's tensor is split over ({} = whole).
    """
    by_axes: dict[tuple[str, ...], jnp.ndarray] = {}
    for name, g in grads.items():
        axes = tuple(sorted(split_axes.get(name, ())))
        square = jnp.sum(jnp.square(g.astype(jnp.float32)))
        by_axes[axes] = by_axes[axes] + square if axes in by_axes else square
    total = jnp.float32(0)
    for axes, value in sorted(by_axes.items()):
        total = total + (collectives.all_reduce(value, axes) if axes else value)
    return jnp.sqrt(total)


def clip(grads: Mapping[str, jnp.ndarray], norm: jnp.ndarray, max_norm: float) -> dict:
    """Gradients scaled by min(1, max_norm / (norm + 1e-6)), as torch clips them."""
    factor = jnp.minimum(jnp.float32(max_norm) / (norm + TORCH_EPS), 1.0)
    return {n: (g * factor).astype(g.dtype) for n, g in grads.items()}


def sum_over_shards(partial: Mapping[str, jnp.ndarray], split_axes: Mapping[str, tuple[str, ...]]) -> dict:
    """Each tensor's local sums (of squares) summed over the mesh axes it is split over: the
    whole tensor's. Sums that share axes (and vary over the same axes) travel in one
    all-reduce, scoped `xtrain.trust_ratio.norms` for the report.

    Args:
        partial: name -> this device's sums (any shape, e.g. (2,) or (2, L) per layer).
        split_axes: name -> the mesh axes its tensor's shards are spread over (excluding a
            stacked array's row axis: rows are different layers, not parts of one).
    """
    out, groups = dict(partial), {}
    for name, value in partial.items():
        axes = tuple(sorted(split_axes.get(name, ())))
        if axes:
            groups.setdefault((axes, tuple(sorted(collectives.vma(value)))), []).append(name)
    for index, ((axes, _), names) in enumerate(sorted(groups.items())):
        with jax.named_scope(f"xtrain.trust_ratio.norms{index}[{len(names)} tensors]"):
            flat = collectives.all_reduce(jnp.concatenate([partial[n].ravel() for n in names]), axes)
        offset = 0
        for n in names:
            out[n] = flat[offset:offset + partial[n].size].reshape(partial[n].shape)
            offset += partial[n].size
    return out
