"""ZeRO: where each tensor is split over the data-parallel axes.

One rule for every stage: a tensor is split over the data axes it is not already split over
(all of them; an expert weight split over `expert`, which is a data axis for every other
tensor, over the rest) on its largest dimension that is not already split and that their size
divides; a tensor with no such dimension stays whole. Stage 3 applies it to parameters; stages
1 and 2 to optimizer state only.
"""
from __future__ import annotations

import math
from typing import Mapping

from xtrain.sharding.plan import Spec, axes_of
from xtrain.sharding.segments import Segments


def shard_dim(shape: tuple[int, ...], spec: Spec, mesh_axes: Mapping[str, int], data_axes: tuple[str, ...]) -> int | None:
    """The dimension ZeRO splits over the `data_axes` that `spec` leaves free, or None when none fits."""
    used = {a for e in spec for a in axes_of(e)}
    free = tuple(a for a in data_axes if a not in used)
    if not free:
        return None
    n = math.prod(mesh_axes[a] for a in free)
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    local = [shape[d] // math.prod(mesh_axes[a] for a in axes_of(padded[d])) for d in range(len(shape))]
    # never a per-segment dim: its shards are interleaved slices of the segments, not one block
    candidates = [d for d in range(len(shape)) if local[d] % n == 0 and local[d] >= n
                  and not isinstance(padded[d], Segments)]
    return max(candidates, key=lambda d: (local[d], -d)) if candidates else None


def with_data_split(shape, spec: Spec, mesh_axes, data_axes) -> Spec:
    """`spec` with the data axes added on the ZeRO dimension (unchanged if none fits)."""
    dim = shard_dim(shape, spec, mesh_axes, data_axes)
    if dim is None:
        return tuple(spec)
    padded = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in spec for a in axes_of(e)}
    padded[dim] = tuple(axes_of(padded[dim])) + tuple(a for a in data_axes if a not in used)
    padded[dim] = padded[dim][0] if len(padded[dim]) == 1 else padded[dim]
    return tuple(padded)


def specs_for_stage(shapes: Mapping[str, tuple], param_specs: Mapping[str, Spec], mesh_axes, data_axes,
                    stage: int) -> tuple[dict[str, Spec], dict[str, Spec], list[str]]:
    """(parameter specs, optimizer-state specs, names left whole) for a ZeRO stage."""
    split = {n: with_data_split(shapes[n], param_specs[n], mesh_axes, data_axes) for n in shapes}
    whole = [n for n in shapes if stage and split[n] == tuple(param_specs[n])
             and not {a for e in param_specs[n] for a in axes_of(e)} & set(data_axes)]
    params = split if stage == 3 else dict(param_specs)
    optimizer = split if stage >= 1 else dict(param_specs)
    return params, optimizer, whole
