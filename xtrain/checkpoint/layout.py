"""Logical names and regions: how a sharded array maps onto checkpoint files and back.

Every array is stored under a logical name (its key path in the TrainState) with its global
shape; each stored piece records the region (start/stop per dimension) of the global array it
holds. A checkpoint is therefore independent of the mesh and plan it was written under: a
reader assembles any region it needs from the pieces that overlap it.
"""
from __future__ import annotations

import collections
from typing import Callable, Iterable, Sequence

import jax
import numpy as np
from safetensors import SafetensorError, safe_open

from xtrain.errors import CheckpointError  # re-exported: defined with the other errors

Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension of the global array


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """A device's index (slices, possibly open) as explicit (start, stop) pairs."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape)) + tuple((0, n) for n in shape[len(index):])


def _overlap(a: Region, b: Region) -> Region | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out  # a scalar's () always overlaps


def _size(region: Region) -> int:
    return int(np.prod([hi - lo for lo, hi in region], dtype=np.int64))


def read_slice(file: str, key: str, region: Region) -> np.ndarray:
    """Reads only `region` of tensor `key` from a safetensors file. The file is opened per read,
    so at most one region of it is mapped at a time (host memory stays bounded)."""
    try:
        with safe_open(file, framework="np") as f:
            if not region:
                return np.asarray(f.get_tensor(key))
            return np.asarray(f.get_slice(key)[tuple(slice(lo, hi) for lo, hi in region)])
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: cannot read tensor {key!r} ({type(err).__name__}: {err}); the file is "
                              "truncated, corrupt or not a safetensors file") from None


def assemble(name: str, want: Region, dtype: np.dtype, pieces: Iterable[dict],
             read: Callable[[dict, Region], np.ndarray]) -> np.ndarray:
    """The `want` region of tensor `name` from the stored pieces overlapping it.

    Each piece is {"region": [[start, stop], ...], ...}; `read(piece, local_region)` returns the
    part of that piece at `local_region` (relative to the piece's own origin)."""
    out = np.empty([hi - lo for lo, hi in want], dtype=dtype)
    filled = 0
    for piece in pieces:
        have = tuple(tuple(r) for r in piece["region"])
        both = _overlap(want, have)
        if both is None:
            continue
        local = tuple((lo - h0, hi - h0) for (lo, hi), (h0, _) in zip(both, have))
        dest = tuple(slice(lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(both, want))
        out[dest] = read(piece, local)
        filled += _size(both)
    if filled != _size(want):
        raise CheckpointError(f"the stored pieces of {name} cover {filled} of the {_size(want)} elements of "
                              f"region {want}: the checkpoint is missing part of this tensor")
    return out


def stacked_reader(layers: Sequence[Callable[[Region], np.ndarray]], dtype: np.dtype) -> Callable[[Region], np.ndarray]:
    """Region reader of a stacked (L, ...) tensor stored as L per-layer tensors: row k of the
    region comes from `layers[k]` (a reader of layer k's own regions)."""
    def read(want: Region) -> np.ndarray:
        (lo, hi), rest = want[0], want[1:]
        return np.stack([layers[k](rest) for k in range(lo, hi)]).astype(dtype, copy=False)
    return read


def make_array(name: str, shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding,
               read_region: Callable[[Region], np.ndarray]) -> jax.Array:
    """A global array on `sharding` whose local shards are read region by region: each distinct
    region once (devices holding replicas share the read) and placed before the next is read,
    so at most one region is on the host beside what the devices already hold."""
    indices = sharding.addressable_devices_indices_map(shape)
    regions = {device: region_of(index, shape) for device, index in indices.items()}
    left = collections.Counter(regions.values())
    held: dict[Region, np.ndarray] = {}
    shards = []
    for device, region in regions.items():
        if region not in held:
            held[region] = np.asarray(read_region(region), dtype=dtype)
        # into the memory the sharding names (host memory for an offloaded optimizer state)
        place = jax.sharding.SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
        shards.append(jax.device_put(held[region], place))
        left[region] -= 1
        if not left[region]:
            del held[region]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)
