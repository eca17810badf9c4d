"""The on-disk checkpoint: write (atomic, every process its own shards) and read (any layout).

    <path>/manifest.json            tensors (logical name -> shape, dtype, stored pieces), step, extra
    <path>/shards-00000.safetensors  the pieces process 0 holds (one per distinct shard)
    <path>/index-00000.json         what process 0 wrote (written after its shards are on disk)
    <path>/COMMITTED                written last: the checkpoint is complete
    <path>/begin.json               written first: how many processes write (names what is missing)

A save writes into `<path>.partial`, waits for every process, and only then process 0 writes
the manifest and the marker and renames the directory to `<path>`. A crash at any point leaves
at most a `.partial` directory, which loading rejects.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from xtrain.checkpoint.layout import CheckpointError, assemble, make_array, read_slice, region_of, stacked_reader
from xtrain.ir import stacked
from xtrain.ir.tree import named_leaves

FORMAT = "xtrain-checkpoint"
VERSION = 1
MANIFEST, MARKER, PARTIAL, BEGIN = "manifest.json", "COMMITTED", ".partial", "begin.json"
BARRIER_TIMEOUT_MS = 30 * 60 * 1000  # a slow filesystem may take long; a dead peer fails the job sooner
_barriers = itertools.count()


def _shard_file(process: int) -> str:
    return f"shards-{process:05d}.safetensors"


def _index_file(process: int) -> str:
    return f"index-{process:05d}.json"


def partial_of(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL)


# -- processes -------------------------------------------------------------------------------
def _barrier(tag: str) -> None:
    """Waits for every process (through the jax.distributed key-value service, not a device
    collective, so that it also works from the background thread of an async save)."""
    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the key-value client has no public name in jax 0.10

    distributed.global_state.client.wait_at_barrier(f"xtrain-ckpt-{tag}", BARRIER_TIMEOUT_MS)


def _fsync_write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- writing ---------------------------------------------------------------------------------
def _rows(name: str, length: int, rows: Mapping[str, tuple] | None) -> tuple:
    """The layer each row of stacked leaf `name` holds (its parameter is the last path part)."""
    return tuple((rows or {}).get(name.rsplit("/", 1)[-1], range(length)))


def host_pieces(tree: Any, rows: Mapping[str, tuple] | None = None
                ) -> tuple[dict[str, np.ndarray], dict[str, dict], dict[str, dict]]:
    """Host copies of this process's pieces: one per distinct shard (replica 0 only), so each
    element is written once in the whole job. Returns (arrays by key, piece index, tensor info)."""
    arrays, pieces, tensors = {}, {}, {}
    for name, leaf in named_leaves(tree).items():
        leaf = leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf)
        for k, shard in enumerate(leaf.addressable_shards):
            if shard.replica_id != 0:
                continue
            # a copy: the step donates its state, so the device buffer is reused by the next step
            data, region = np.array(shard.data, copy=True), region_of(shard.index, leaf.shape)
            for tensor, piece, where in _per_layer(name, data, region, rows):
                arrays[f"{tensor}#{k}"] = piece
                pieces[f"{tensor}#{k}"] = {"tensor": tensor, "region": [list(r) for r in where]}
        for tensor, (shape, dtype) in _per_layer_info(name, leaf, rows).items():
            tensors[tensor] = {"shape": shape, "dtype": dtype}
    return arrays, pieces, tensors


def _per_layer(name: str, data: np.ndarray, region, rows) -> list:
    """A shard of a stacked leaf (`params/model.layers.*.w`) as one piece per layer, stored
    under the layers' own names (padding rows dropped), so checkpoints do not depend on how
    the step stores blocks."""
    if not stacked.is_stacked(name):
        return [(name, data, region)]
    (lo, hi), rest = region[0], tuple(region[1:])
    layer_of = _rows(name, region[0][1], rows) if rows else None
    return [(stacked.member(name, layer_of[i] if layer_of else i), np.ascontiguousarray(data[i - lo]), rest)
            for i in range(lo, hi) if not layer_of or layer_of[i] is not None]


def _per_layer_info(name: str, leaf, rows) -> dict[str, tuple[list, str]]:
    dtype = jnp.dtype(leaf.dtype).name
    if not stacked.is_stacked(name):
        return {name: (list(leaf.shape), dtype)}
    return {stacked.member(name, k): (list(leaf.shape[1:]), dtype)
            for k in _rows(name, leaf.shape[0], rows) if k is not None}


class SaveHandle:
    """A save in progress (async) or done. `wait()` returns the committed path or raises."""

    def __init__(self, path: Path, thread: threading.Thread | None = None):
        self.path, self._thread, self.error = path, thread, None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.path


def save(tree: Any, path: str | os.PathLike, *, step: int, extra: dict | None = None,
         blocking: bool = True, rows: Mapping[str, tuple] | None = None) -> SaveHandle:
    """Writes `tree` (a TrainState) to `path` atomically; every process must call it.
    `rows`: {stacked parameter name: layer of each row} where rows are not layers 0..L-1 in
    order (xtrain.ir.stacked.Stacking.row_table).

    The device-to-host copies happen now; with `blocking=False` the files are written by a
    background thread (`handle.wait()` joins it)."""
    path = Path(path).absolute()
    try:
        meta = json.dumps({"step": int(step), "extra": extra or {}})
    except TypeError as err:
        raise ValueError(f"checkpoint extra must be JSON-serialisable (numbers, strings, lists, dicts): {err}") from None
    arrays, pieces, tensors = host_pieces(tree, rows)
    tag = f"{next(_barriers)}-{path}"
    handle = SaveHandle(path)
    job = lambda: _write(path, arrays, pieces, tensors, json.loads(meta), tag)
    if blocking:
        job()
        return handle

    def run():
        try:
            job()
        except BaseException as err:  # surfaced by wait()
            handle.error = err

    handle._thread = threading.Thread(target=run, name=f"xtrain-save-{path.name}", daemon=False)
    handle._thread.start()
    return handle


def _write(path: Path, arrays: dict, pieces: dict, tensors: dict, meta: dict, tag: str) -> None:
    me, tmp = jax.process_index(), partial_of(path)
    if me == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _fsync_write(tmp / BEGIN, json.dumps({"processes": jax.process_count(), "step": meta["step"]}))
    _barrier(f"{tag}-begin")
    save_file(arrays, str(tmp / _shard_file(me)))
    with open(tmp / _shard_file(me), "rb+") as f:
        os.fsync(f.fileno())
    _fsync_write(tmp / _index_file(me), json.dumps({"pieces": pieces, "tensors": tensors}))
    _barrier(f"{tag}-written")
    if me == 0:
        _commit(path, tmp, meta)
    _barrier(f"{tag}-committed")


def _commit(path: Path, tmp: Path, meta: dict) -> None:
    tensors, placed = {}, {}
    for p in range(jax.process_count()):
        if not (tmp / _index_file(p)).exists():
            raise CheckpointError(
                f"process {p} wrote {_index_file(p)} into {tmp} but process 0 cannot see it: the checkpoint "
                "directory must be on a filesystem every process shares (NFS, EFS, FSx for Lustre)")
        index = json.loads((tmp / _index_file(p)).read_text())
        tensors.update(index["tensors"])
        for key, piece in index["pieces"].items():
            placed.setdefault(piece["tensor"], []).append({"file": _shard_file(p), "key": key,
                                                           "region": piece["region"]})
    for name, info in tensors.items():
        info["pieces"] = placed.get(name, [])
    manifest = {"format": FORMAT, "version": VERSION, "processes": jax.process_count(), **meta,
                "tensors": tensors}
    _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_write(tmp / MARKER, "")
    _fsync_dir(tmp)
    if path.exists():  # replacing a checkpoint of the same name: keep one complete copy at all times
        old = path.with_name(path.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old)
    else:
        tmp.rename(path)
    _fsync_dir(path.parent)


# -- reading ---------------------------------------------------------------------------------
def _missing_parts(path: Path) -> list[str]:
    if not (path / BEGIN).exists():
        return [f"{BEGIN} (not written by xtrain, or the save died at once)"]
    missing = []
    for p in range(json.loads((path / BEGIN).read_text())["processes"]):
        lacking = [f for f in (_shard_file(p), _index_file(p)) if not (path / f).exists()]
        if lacking:
            missing.append(f"{' and '.join(lacking)} (process {p} did not finish writing its shards)")
    return missing + [n for n in (MANIFEST, MARKER) if not (path / n).exists()]


def check_complete(path: str | os.PathLike) -> Path:
    """`path` as a Path if it holds a complete checkpoint, else a CheckpointError saying why."""
    path = Path(path)
    if not path.is_dir():
        hint = f"; an unfinished save of it is at {partial_of(path)}" if partial_of(path).exists() else ""
        raise CheckpointError(f"no checkpoint at {path}{hint}")
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
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST} is not an xtrain checkpoint manifest (format {manifest.get('format')!r})")
    return manifest


def _per_device(path: Path, name: str, info: dict | None, want: tuple, dtype) -> tuple[list, str, Any]:
    """(shape, dtype, reader) of a per-device tensor (one row per data-parallel device on its
    first dimension: GradSync(comm_dtype="int8")'s error-feedback residuals) for a step holding
    `want`: as stored when the device counts agree; else the stored rows summed into row 0
    and the other rows zero (only their sum over the devices enters the next step's
    gradient, so it is kept exactly); zero when the checkpoint holds none (saved without int8)."""
    zeros = lambda region: np.zeros([hi - lo for lo, hi in region], dtype)
    name_dtype = jnp.dtype(dtype).name
    if info is None:
        return list(want), name_dtype, zeros
    read = _reader(path, name, info)
    _check_leaf(path, f"{name} (per device)", info["shape"][1:], info["dtype"], want[1:], dtype)
    if info["shape"][0] == want[0]:
        return list(want), name_dtype, read

    def summed(region):
        out = zeros(region)
        if region[0][0] == 0:  # row 0 holds the sum of the stored devices' rows
            out[0] = read(((0, info["shape"][0]),) + tuple(region[1:])).sum(0)
        return out
    return list(want), name_dtype, summed


def _sources(path: Path, manifest: dict, target: dict[str, Any], rows,
             per_device: tuple[str, ...] = ()) -> dict[str, tuple[list, str, Any]]:
    """For each target leaf: (global shape, dtype, region reader) from the checkpoint. A leaf the
    step stores stacked (`model.layers.*.w`) reads its rows from the per-layer tensors
    checkpoints hold (padding rows: zeros). Leaves under a `per_device` prefix: `_per_device`
    (stored ones the step does not hold are dropped)."""
    saved = manifest["tensors"]
    device_row = lambda name: name.startswith(per_device) if per_device else False
    stored = lambda name: (list(saved[name]["shape"]), saved[name]["dtype"], _reader(path, name, saved[name]))
    out, used = {}, {n for n in saved if device_row(n)}
    for name, leaf in target.items():
        if device_row(name) and not stacked.is_stacked(name):
            out[name] = _per_device(path, name, saved.get(name), tuple(leaf.shape), leaf.dtype)
            continue
        if name in saved:
            out[name], _ = stored(name), used.add(name)
            continue
        layer_of = _rows(name, leaf.shape[0], rows) if stacked.is_stacked(name) and leaf.ndim else ()
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
                readers.append(_per_device(path, member, saved.get(member), tuple(leaf.shape[1:]), leaf.dtype)[2])
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


def restore(path: str | os.PathLike, target: Any, rows: Mapping[str, tuple] | None = None,
            per_device: tuple[str, ...] = ()) -> tuple[dict[str, jax.Array], dict]:
    """Reads a checkpoint onto the shardings of `target` (a TrainState of placed arrays, any
    mesh and plan, block parameters stacked or per layer; `rows` as for `save`). Each process
    reads only the regions its devices hold. `per_device`: name prefixes of leaves with one
    row per data-parallel device (`_per_device` says what they become on another device
    count). Returns ({logical name: array}, manifest)."""
    path = Path(path)
    manifest = read_manifest(path)
    leaves = named_leaves(target)
    sources = _sources(path, manifest, leaves, rows, per_device)
    return {name: make_array(name, tuple(leaf.shape), jnp.dtype(leaf.dtype), leaf.sharding, sources[name][2])
            for name, leaf in leaves.items()}, manifest


def _reader(path: Path, name: str, info: dict):
    dtype = jnp.dtype(info["dtype"])
    read_piece = lambda piece, local: read_slice(str(path / piece["file"]), piece["key"], local)
    return lambda want: assemble(name, want, dtype, info["pieces"], read_piece)
