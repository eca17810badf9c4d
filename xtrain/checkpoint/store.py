"""The on-disk checkpoint: its format, and reading it onto any layout (writing:
xtrain.checkpoint.writer).

    <path>/manifest.json            tensors (logical name -> shape, dtype, stored pieces with their
                                    regions and checksums), step, extra
    <path>/shards-00000.safetensors  the pieces process 0 holds (one per distinct shard)
    <path>/index-00000.json         what process 0 wrote (written after its shards are on disk)
    <path>/COMMITTED                written last: the checkpoint is complete
    <path>/begin.json               written first: how many processes write (names what is missing)

Every reader checks what it reads: a tensor's pieces must tile it exactly (no overlap, no gap),
each piece must have the shape the manifest gives it, and the rows read must match the
checksums written with them (xtrain.checkpoint.integrity; `verify=False` skips the checksums).
Checkpoints written before checksums existed (manifest version 1) load with a warning that
they are unverified. A load that fails on any process fails on every process.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from xtrain.checkpoint import integrity
from xtrain.checkpoint.layout import CheckpointError, assemble, make_array, stacked_reader
from xtrain.ir import stacked
from xtrain.ir.tree import named_leaves

FORMAT = "xtrain-checkpoint"
VERSION = 2  # 2: every piece has a checksum
MANIFEST, MARKER, PARTIAL, BEGIN, OLD = "manifest.json", "COMMITTED", ".partial", "begin.json", ".old"


def shard_file(process: int) -> str:
    return f"shards-{process:05d}.safetensors"


def index_file(process: int) -> str:
    return f"index-{process:05d}.json"


def partial_of(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL)


def old_of(path: Path) -> Path:
    """Where a checkpoint being replaced by a save of the same name waits until the new one is in place."""
    return path.with_name(path.name + OLD)


def stacked_rows(name: str, length: int, rows: Mapping[str, tuple] | None) -> tuple:
    """The layer each row of stacked leaf `name` holds (its parameter is the last path part)."""
    return tuple((rows or {}).get(name.rsplit("/", 1)[-1], range(length)))


# -- reading ---------------------------------------------------------------------------------
def _json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: cannot be read as JSON ({err}): the checkpoint is corrupt") from None


def _missing_parts(path: Path) -> list[str]:
    if not (path / BEGIN).exists():
        return [f"{BEGIN} (not written by xtrain, or the save died at once)"]
    missing = []
    for p in range(_json(path / BEGIN)["processes"]):
        lacking = [f for f in (shard_file(p), index_file(p)) if not (path / f).exists()]
        if lacking:
            missing.append(f"{' and '.join(lacking)} (process {p} did not finish writing its shards)")
    return missing + [n for n in (MANIFEST, MARKER) if not (path / n).exists()]


def _absent(path: Path) -> CheckpointError:
    old, hint = old_of(path), ""
    if old.is_dir() and not _missing_parts(old):
        hint = (f"; a save replacing it stopped between its two renames: the checkpoint it replaced is complete "
                f"at {old} (step {_json(old / MANIFEST).get('step')}): load that (CheckpointManager.restore does)")
    elif partial_of(path).exists():
        hint = f"; an unfinished save of it is at {partial_of(path)}"
    return CheckpointError(f"no checkpoint at {path}{hint}")


def check_complete(path: str | os.PathLike) -> Path:
    """`path` as a Path if it holds a complete checkpoint, else a CheckpointError saying why."""
    path = Path(path)
    if not path.is_dir():
        raise _absent(path)
    missing = _missing_parts(path)
    if path.name.endswith(PARTIAL) and not missing:  # the rename to the final name is the commit
        missing = [f"the rename to {path.name[:-len(PARTIAL)]} that commits it"]
    if missing:
        raise CheckpointError(
            f"{path} is a partial checkpoint (a save that did not finish, e.g. killed mid-write): missing "
            f"{'; '.join(missing)}. Load the previous complete checkpoint instead "
            "(CheckpointManager.latest() finds it)")
    return path


def read_manifest(path: str | os.PathLike) -> dict:
    path = check_complete(path)
    manifest = _json(path / MANIFEST)
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST} is not an xtrain checkpoint manifest (format {manifest.get('format')!r})")
    return manifest


def verified(manifest: dict) -> bool:
    """Whether the checkpoint has checksums for its pieces (those written before had none)."""
    return all("checksum" in p for t in manifest["tensors"].values() for p in t["pieces"])


def _per_device(path: Path, name: str, info: dict | None, want: tuple, dtype, verify: bool) -> tuple[list, str, Any]:
    """(shape, dtype, reader) of a per-device tensor (one row per data-parallel device on its
    first dimension: GradSync(comm_dtype="int8")'s error-feedback residuals) for a step holding
    `want`: as stored when the device counts agree; else the stored rows summed into row 0
    and the other rows zero (only their sum over the devices enters the next step's
    gradient, so it is kept exactly); zero when the checkpoint holds none (saved without int8)."""
    zeros = lambda region: np.zeros([hi - lo for lo, hi in region], dtype)
    name_dtype = jnp.dtype(dtype).name
    if info is None:
        return list(want), name_dtype, zeros
    read = _reader(path, name, info, verify)
    _check_leaf(path, f"{name} (per device)", info["shape"][1:], info["dtype"], want[1:], dtype)
    if info["shape"][0] == want[0]:
        return list(want), name_dtype, read

    def summed(region):
        out = zeros(region)
        if region[0][0] == 0:  # row 0 holds the sum of the stored devices' rows
            out[0] = read(((0, info["shape"][0]),) + tuple(region[1:])).sum(0)
        return out
    return list(want), name_dtype, summed


def _sources(path: Path, manifest: dict, target: dict[str, Any], rows, verify: bool,
             per_device: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> dict[str, tuple[list, str, Any]]:
    """For each target leaf: (global shape, dtype, region reader) from the checkpoint. A leaf the
    step stores stacked (`model.layers.*.w`) reads its rows from the per-layer tensors
    checkpoints hold (padding rows: zeros). Leaves under a `per_device` prefix: `_per_device`
    (stored ones the step does not hold are dropped). Leaves named with an `optional` suffix
    (delayed FP8 scaling's amax histories): zeros when the checkpoint has none, dropped when the
    step holds none."""
    saved = manifest["tensors"]
    device_row = lambda name: name.startswith(per_device) if per_device else False
    stored = lambda name: (list(saved[name]["shape"]), saved[name]["dtype"], _reader(path, name, saved[name], verify))
    out, used = {}, {n for n in saved if device_row(n) or (optional and n.endswith(optional))}
    for name, leaf in target.items():
        if optional and name.endswith(optional) and name not in saved:
            out[name] = (list(leaf.shape), jnp.dtype(leaf.dtype).name,
                         lambda region, dtype=leaf.dtype: np.zeros([hi - lo for lo, hi in region], dtype))
            continue
        if device_row(name) and not stacked.is_stacked(name):
            out[name] = _per_device(path, name, saved.get(name), tuple(leaf.shape), leaf.dtype, verify)
            continue
        if name in saved:
            out[name], _ = stored(name), used.add(name)
            continue
        layer_of = stacked_rows(name, leaf.shape[0], rows) if stacked.is_stacked(name) and leaf.ndim else ()
        members = [stacked.member(name, k) for k in layer_of if k is not None]
        if not members or not (device_row(name) or all(m in saved for m in members)):
            continue
        readers = []
        for k in layer_of:
            if k is None:
                readers.append(lambda want, dtype=leaf.dtype: np.zeros([hi - lo for lo, hi in want], dtype))
                continue
            member = stacked.member(name, k)
            if device_row(name):
                per_layer = _per_device(path, member, saved.get(member), tuple(leaf.shape[1:]), leaf.dtype, verify)
                readers.append(per_layer[2])
                continue
            shape, dtype, read = stored(member)
            _check_leaf(path, member, shape, dtype, leaf.shape[1:], leaf.dtype)
            readers.append(read)
        used.update(members)
        out[name] = (list(leaf.shape), jnp.dtype(leaf.dtype).name, stacked_reader(readers, jnp.dtype(leaf.dtype)))
    missing, unexpected = sorted(set(target) - set(out)), sorted(set(saved) - used)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not hold this step's state: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]} (saved from a different model or optimizer?)")
    for name, leaf in target.items():
        _check_leaf(path, name, out[name][0], out[name][1], leaf.shape, leaf.dtype)
    return out


def _check_leaf(path: Path, name: str, shape: list, dtype: str, want_shape, want_dtype) -> None:
    if shape != list(want_shape) or dtype != jnp.dtype(want_dtype).name:
        raise CheckpointError(f"checkpoint {path}: {name} was saved as {dtype}{shape} but this step "
                              f"holds {jnp.dtype(want_dtype).name}{list(want_shape)}")


def _agreed(path: Path, error: CheckpointError | None) -> None:
    """Raises on every process when any process failed to read its part of `path`: each reads
    (and verifies) only its own regions, and a job whose processes loaded different states, or
    where some did not load at all, would silently diverge."""
    failed = [error is not None]
    if jax.process_count() > 1:
        failed = list(np.asarray(multihost_utils.process_allgather(np.int32(error is not None))).reshape(-1))
    if error is not None:
        raise error
    if any(failed):
        bad = [p for p, f in enumerate(failed) if f]
        raise CheckpointError(f"checkpoint {path}: process(es) {bad} could not read their part of it (their error "
                              "names the file and the problem); no process loaded it")


def restore(path: str | os.PathLike, target: Any, rows: Mapping[str, tuple] | None = None,
            per_device: tuple[str, ...] = (), *, verify: bool = True,
            optional: tuple[str, ...] = ()) -> tuple[dict[str, jax.Array], dict]:
    """Reads a checkpoint onto the shardings of `target` (a TrainState of placed arrays, any
    mesh and plan, block parameters stacked or per layer; `rows` as for `save`). Each process
    reads only the regions its devices hold, verifying their checksums unless `verify=False`.
    `per_device`: name prefixes of leaves with one row per data-parallel device (`_per_device`
    says what they become on another device count); `optional`: name suffixes of leaves that
    may be absent on either side (`_sources`). Returns ({logical name: array}, manifest)."""
    path = Path(path)
    manifest = read_manifest(path)
    if verify and not verified(manifest):
        integrity.warn_unverified(path, "has no checksums (written by an xtrain before checkpoints had them)")
    leaves, error, out = named_leaves(target), None, {}
    try:
        sources = _sources(path, manifest, leaves, rows, verify, per_device, optional)
        out = {name: make_array(name, tuple(leaf.shape), jnp.dtype(leaf.dtype), leaf.sharding, sources[name][2])
               for name, leaf in leaves.items()}
    except CheckpointError as err:
        error = err
    _agreed(path, error)
    return out, manifest


def verify_all(path: str | os.PathLike) -> dict:
    """Reads and verifies every piece of checkpoint `path` (shared out over the processes);
    returns its manifest. For a load that cannot read its regions yet (plan="auto" before its
    first step) but must know now whether the checkpoint is intact."""
    path = Path(path)
    manifest, error = read_manifest(path), None
    pieces = [(name, info, piece) for name, info in sorted(manifest["tensors"].items()) for piece in info["pieces"]]
    try:
        for name, info in manifest["tensors"].items():
            integrity.check_tiling(str(path / MANIFEST), name, info["shape"], info["pieces"])
        for name, info, piece in pieces[jax.process_index()::jax.process_count()]:
            extent = [hi - lo for lo, hi in piece["region"]]
            integrity.read_piece(str(path / piece["file"]), piece["key"], extent,
                                 tuple((0, n) for n in extent), piece.get("checksum"))
    except CheckpointError as err:
        error = err
    _agreed(path, error)
    return manifest


def _reader(path: Path, name: str, info: dict, verify: bool):
    integrity.check_tiling(str(path / MANIFEST), name, info["shape"], info["pieces"])
    dtype = jnp.dtype(info["dtype"])

    def read_piece(piece, local):
        extent = [hi - lo for lo, hi in piece["region"]]
        record = piece.get("checksum") if verify else None
        return integrity.read_piece(str(path / piece["file"]), piece["key"], extent, local, record)

    return lambda want: assemble(name, want, dtype, info["pieces"], read_piece)
