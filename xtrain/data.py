"""Global batches (torch tensors or numpy) -> arrays sharded over the mesh.

Every process passes the same global batch; each process materialises only the slices of its
own devices (`jax.make_array_from_callback` asks for addressable shards only). Arrays already
placed with the batch's sharding (by `xtrain.loader`'s prefetch or per-process loading) pass
through untouched.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from xtrain.errors import InputError
from xtrain.frontend.tensors import to_numpy
from xtrain.sharding.plan import Spec, axes_of


def batch_sharding(mesh: jax.sharding.Mesh, spec: Spec, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*spec[:ndim]))


def check_divisible(index: int, shape: tuple[int, ...], spec: Spec, mesh: jax.sharding.Mesh) -> None:
    for dim, entry in enumerate(spec[: len(shape)]):
        size = math.prod(mesh.shape[a] for a in axes_of(entry))
        if shape[dim] % size:
            axes = " x ".join(f"{a}={mesh.shape[a]}" for a in axes_of(entry))
            what = "global batch" if dim == 0 else f"dimension {dim}"
            raise InputError(
                f"batch argument {index} has shape {tuple(shape)}: {what} {shape[dim]} is not "
                f"divisible by mesh axis {axes}; use a {what} that is a multiple of {size}")


def process_rows(global_shape: tuple[int, ...], sharding: NamedSharding) -> list[int]:
    """The global-batch rows (dimension 0) that this process's devices hold, in order."""
    rows: set[int] = set()
    for index in sharding.addressable_devices_indices_map(tuple(global_shape)).values():
        rows.update(range(*index[0].indices(global_shape[0])) if index else range(global_shape[0]))
    return sorted(rows)


def _placed(index: int, x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """A jax.Array argument: kept if already laid out as the batch spec says, else re-placed."""
    if x.sharding.is_equivalent_to(sharding, x.ndim):
        return x
    if not x.is_fully_addressable:
        raise InputError(
            f"batch argument {index} is a multi-process jax.Array of shape {tuple(x.shape)} laid out as "
            f"{x.sharding}, but the step's batch layout is {sharding.spec}; place it with "
            f"xtrain.loader (or jax.make_array_from_process_local_data) under the step's batch sharding")
    return jax.device_put(x, sharding)


def shard_batch(batch: Sequence[Any], mesh: jax.sharding.Mesh, spec: Spec, own: Mapping[int, Spec] | None = None
                ) -> tuple:
    """Places each array-like batch argument on the mesh, split by `spec` or its own spec in
    `own` (argument position -> spec); others pass through."""
    out, default = [], spec
    for index, x in enumerate(batch):
        spec = (own or {}).get(index, default)
        if x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
            continue
        if isinstance(x, jax.Array) and x.ndim:
            check_divisible(index, x.shape, spec, mesh)
            out.append(_placed(index, x, batch_sharding(mesh, spec, x.ndim)))
            continue
        arr = to_numpy(x)
        if arr.ndim == 0:
            out.append(jax.device_put(arr, NamedSharding(mesh, PartitionSpec())))
            continue
        check_divisible(index, arr.shape, spec, mesh)
        sharding = batch_sharding(mesh, spec, arr.ndim)
        out.append(jax.make_array_from_callback(arr.shape, sharding, lambda idx, a=arr: a[idx]))
    return tuple(out)
