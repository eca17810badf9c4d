"""Checkpoint integrity: checksums of every stored piece, computed while a save writes it and
verified by each reader for the bytes it reads, and the check that a tensor's pieces tile it.

A piece is checksummed in chunks of whole rows (its leading dimension), ~4 MiB each, so a reader
that needs only some rows of a piece (sharded loading reads regions, not files) reads and
verifies only the chunks holding them:

    "checksum": {"algorithm": "crc32", "rows": 4096, "values": [crc of rows 0-4095, ...]}

CRC-32 (zlib) catches the corruption a filesystem or a truncated copy causes (flipped bits and
bytes, zeroed or missing blocks); it is not a defence against deliberate tampering.
"""
from __future__ import annotations

import math
import warnings
import zlib
from typing import Sequence

import numpy as np
from safetensors import SafetensorError, safe_open

from xtrain.checkpoint.layout import CheckpointError, Region

ALGORITHM = "crc32"
CHUNK_BYTES = 4 << 20


class CheckpointWarning(UserWarning):
    """A checkpoint loaded with less assurance than usual (no checksums), or a fallback taken."""


def _rows_per_chunk(shape: Sequence[int], itemsize: int) -> int:
    row_bytes = math.prod(shape[1:]) * itemsize if len(shape) > 1 else itemsize
    return max(1, CHUNK_BYTES // max(row_bytes, 1))


def _crc(block: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(block).reshape(-1).view(np.uint8))


def checksum(data: np.ndarray) -> dict:
    """The checksum record of one piece (its host copy, exactly the bytes written)."""
    if data.ndim == 0:
        return {"algorithm": ALGORITHM, "rows": 1, "values": [_crc(data)]}
    rows = _rows_per_chunk(data.shape, data.dtype.itemsize)
    return {"algorithm": ALGORITHM, "rows": rows,
            "values": [_crc(data[lo:lo + rows]) for lo in range(0, max(data.shape[0], 1), rows)]}


# -- reading -----------------------------------------------------------------------------------
def _open_error(file: str, key: str, err: BaseException) -> CheckpointError:
    return CheckpointError(f"{file}: cannot read piece {key!r} ({type(err).__name__}: {err}); the file is "
                           "truncated, corrupt or not a safetensors file. Load an earlier checkpoint "
                           "(CheckpointManager.restore falls back to the newest one that verifies)")


def read_piece(file: str, key: str, extent: Sequence[int], local: Region, record: dict | None) -> np.ndarray:
    """`local` (relative to the piece's origin) of piece `key`, whose manifest extent is
    `extent`; with a checksum `record`, the chunks of rows read are verified first."""
    try:
        with safe_open(file, framework="np") as f:
            stored = f.get_slice(key)
            if list(stored.get_shape()) != list(extent):
                raise CheckpointError(f"{file}: piece {key!r} has shape {list(stored.get_shape())} but the manifest "
                                      f"says it holds a region of shape {list(extent)}: the manifest does not "
                                      "describe this file")
            if not local:
                block, first = np.asarray(f.get_tensor(key)), 0
            else:
                first, stop = _aligned(local[0], record, extent[0])
                block = np.asarray(stored[first:stop])
    except (SafetensorError, OSError, ValueError) as err:
        raise _open_error(file, key, err) from None
    if record is not None:
        _verify(file, key, block, first, record)
    if not local:
        return block
    return block[(slice(local[0][0] - first, local[0][1] - first),) + tuple(slice(lo, hi) for lo, hi in local[1:])]


def _aligned(rows: tuple[int, int], record: dict | None, length: int) -> tuple[int, int]:
    """Rows [lo, hi) widened to whole checksum chunks."""
    if record is None:
        return rows
    step = record["rows"]
    return rows[0] // step * step, min(-(-rows[1] // step) * step, length)


def _verify(file: str, key: str, block: np.ndarray, first: int, record: dict) -> None:
    if record.get("algorithm") != ALGORITHM:
        raise CheckpointError(f"{file}: piece {key!r} has a checksum of unknown algorithm "
                              f"{record.get('algorithm')!r} (this xtrain knows {ALGORITHM})")
    step, values = record["rows"], record["values"]
    if block.ndim == 0:
        chunks = [(0, block)]
    else:
        chunks = [(first // step + k, block[lo:lo + step]) for k, lo in enumerate(range(0, block.shape[0], step))]
    for index, chunk in chunks:
        if index >= len(values) or _crc(chunk) != values[index]:
            rows = "" if block.ndim == 0 else f" rows {index * step}-{index * step + len(chunk) - 1}"
            raise CheckpointError(
                f"{file}: piece {key!r}{rows} fails its {ALGORITHM} checksum: the bytes on disk are not those "
                "that were saved (corrupted or overwritten). Load an earlier checkpoint (CheckpointManager."
                "restore falls back to the newest one that verifies), or pass verify=False to load it anyway")


def warn_unverified(path, why: str) -> None:
    warnings.warn(f"checkpoint {path} {why}: its data is loaded unverified", CheckpointWarning, stacklevel=4)


# -- pieces ------------------------------------------------------------------------------------
def _overlap(a: Region, b: Region) -> bool:
    return all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(a, b))


def check_tiling(where: str, name: str, shape: Sequence[int], pieces: list[dict]) -> None:
    """The pieces of tensor `name` cover its `shape` exactly once: inside its bounds, no two
    overlapping, no element left out. Pieces form a grid in practice, so each is compared only
    with those whose leading-dimension range it meets."""
    if any(n == 0 for n in shape):
        return  # nothing to cover
    regions = [tuple(tuple(r) for r in piece["region"]) for piece in pieces]
    for region in regions:
        if len(region) != len(shape) or any(not 0 <= lo < hi <= n for (lo, hi), n in zip(region, shape)):
            raise CheckpointError(f"{where}: a piece of {name} holds region {list(map(list, region))}, outside "
                                  f"its shape {list(shape)}: the manifest is corrupt")
    _check_disjoint(where, name, regions)
    covered = sum(math.prod(hi - lo for lo, hi in r) for r in regions)
    if covered != math.prod(shape):
        raise CheckpointError(f"{where}: the stored pieces of {name} cover {covered} of the {math.prod(shape)} "
                              f"elements of its shape {list(shape)}: the checkpoint is missing part of this tensor")


def _check_disjoint(where: str, name: str, regions: list[Region]) -> None:
    if not regions or not regions[0]:
        if len(regions) > 1:
            raise CheckpointError(f"{where}: scalar {name} is stored in {len(regions)} pieces: the manifest is corrupt")
        return
    active: list[Region] = []
    for region in sorted(regions):
        active = [r for r in active if r[0][1] > region[0][0]]
        for other in active:
            if _overlap(region, other):
                raise CheckpointError(
                    f"{where}: pieces of {name} overlap (regions {list(map(list, other))} and "
                    f"{list(map(list, region))}): the manifest is corrupt; two pieces must never hold the same "
                    "elements")
        active.append(region)
