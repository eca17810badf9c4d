"""Writing a checkpoint: every process its own shards, checksummed as they are written, then
one commit (the format and the reading side: xtrain.checkpoint.store).

A save writes into `<path>.partial`, waits for every process, and only then process 0 writes
the manifest and the marker and renames the directory to `<path>`; replacing a checkpoint of
the same name first moves the old one to `<path>.old` and deletes it after the rename. So a
crash at any point leaves `<path>` complete (old or new), or `<path>.old` complete and named in
the errors (CheckpointManager.restore loads it), and at most a `.partial` directory, which
loading rejects.

Saves to one path run one at a time in a process: a save started while another to the same
path is still writing (an async save) waits for it, so the later save is the one that stays and
each checkpoint's weights, state and `extra` come from one save. A save of another job into the
same directory is detected at the commit (each save stamps its staging directory) and refused.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from xtrain.checkpoint import integrity
from xtrain.checkpoint.layout import CheckpointError, region_of
from xtrain.checkpoint.store import (BEGIN, FORMAT, MANIFEST, MARKER, VERSION, index_file, old_of, partial_of,
                                     shard_file, stacked_rows)
from xtrain.errors import OptionsError
from xtrain.ir import stacked
from xtrain.ir.tree import named_leaves

BARRIER_TIMEOUT_MS = 30 * 60 * 1000  # a slow filesystem may take long; a dead peer fails the job sooner
_barriers = itertools.count()

# Test hook: process 0 calls commit_hook(stage, path) at "commit" (every process has written its
# shards; nothing is committed yet) and at "swap" (replacing a checkpoint of the same name: the
# old one has been moved to `<path>.old`, the new one not yet renamed). Tests pause a save there,
# or fail it, to force each interleaving deterministically.
commit_hook: Callable[[str, Path], None] | None = None

_inflight: dict[Path, "SaveHandle"] = {}  # the latest save started per path, until it ends
_inflight_lock = threading.Lock()


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


# -- host copies -----------------------------------------------------------------------------
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
    layer_of = stacked_rows(name, region[0][1], rows) if rows else None
    return [(stacked.member(name, layer_of[i] if layer_of else i), np.ascontiguousarray(data[i - lo]), rest)
            for i in range(lo, hi) if not layer_of or layer_of[i] is not None]


def _per_layer_info(name: str, leaf, rows) -> dict[str, tuple[list, str]]:
    dtype = jnp.dtype(leaf.dtype).name
    if not stacked.is_stacked(name):
        return {name: (list(leaf.shape), dtype)}
    return {stacked.member(name, k): (list(leaf.shape[1:]), dtype)
            for k in stacked_rows(name, leaf.shape[0], rows) if k is not None}


# -- saving ----------------------------------------------------------------------------------
class SaveHandle:
    """A save in progress (async) or done. `wait()` returns the committed path or raises."""

    def __init__(self, path: Path):
        self.path, self.error = path, None
        self._finished = threading.Event()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> Path:
        self._finished.wait()
        if self.error is not None:
            raise self.error
        return self.path


def _claim(path: Path, handle: SaveHandle) -> SaveHandle | None:
    """Registers `handle` as the latest save of `path`; returns the save it must wait for."""
    with _inflight_lock:
        previous = _inflight.get(path)
        _inflight[path] = handle
    return None if previous is None or previous.done() else previous


def _release(path: Path, handle: SaveHandle) -> None:
    with _inflight_lock:
        if _inflight.get(path) is handle:
            del _inflight[path]
    handle._finished.set()


def save(tree: Any, path: str | os.PathLike, *, step: int, extra: dict | None = None,
         blocking: bool = True, rows: Mapping[str, tuple] | None = None) -> SaveHandle:
    """Writes `tree` (a TrainState) to `path` atomically; every process must call it.
    `rows`: {stacked parameter name: layer of each row} where rows are not layers 0..L-1 in
    order (xtrain.ir.stacked.Stacking.row_table).

    The device-to-host copies happen now; with `blocking=False` the files are written by a
    background thread (`handle.wait()` joins it). A save to a path another save of this
    process is still writing starts once that one has ended (a blocking save waits here)."""
    path = Path(path).absolute()
    try:
        meta = json.dumps({"step": int(step), "extra": extra or {}})
    except TypeError as err:
        raise OptionsError(
            f"checkpoint extra must be JSON-serialisable (numbers, strings, lists, dicts): {err}") from None
    arrays, pieces, tensors = host_pieces(tree, rows)
    tag = f"{next(_barriers)}-{path}"
    handle = SaveHandle(path)
    previous = _claim(path, handle)

    def job():
        try:
            if previous is not None:
                previous._finished.wait()  # its outcome is its own handle's
            _write(path, arrays, pieces, tensors, json.loads(meta), tag)
        except BaseException as err:
            handle.error = err
        finally:
            _release(path, handle)

    if blocking:
        job()
        handle.wait()  # raises what the save raised
        return handle
    threading.Thread(target=job, name=f"xtrain-save-{path.name}", daemon=False).start()
    return handle


def _write(path: Path, arrays: dict, pieces: dict, tensors: dict, meta: dict, tag: str) -> None:
    me, tmp = jax.process_index(), partial_of(path)
    if me == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _fsync_write(tmp / BEGIN, json.dumps({"processes": jax.process_count(), "step": meta["step"],
                                              "save": uuid.uuid4().hex}))
    _barrier(f"{tag}-begin")
    stamp = _stamp(tmp)
    for key, piece in pieces.items():  # hashed from the very host copies being written
        piece["checksum"] = integrity.checksum(arrays[key])
    save_file(arrays, str(tmp / shard_file(me)))
    with open(tmp / shard_file(me), "rb+") as f:
        os.fsync(f.fileno())
    _fsync_write(tmp / index_file(me), json.dumps({"save": stamp, "pieces": pieces, "tensors": tensors}))
    _barrier(f"{tag}-written")
    if me == 0:
        _commit(path, tmp, meta, stamp)
    _barrier(f"{tag}-committed")


def _stamp(tmp: Path) -> str | None:
    try:
        return json.loads((tmp / BEGIN).read_text())["save"]
    except (OSError, ValueError, KeyError):
        return None


def _indexes(tmp: Path, stamp: str | None) -> list[dict]:
    """Every process's index of this save, or an error naming what is wrong."""
    out = []
    for p in range(jax.process_count()):
        if not (tmp / index_file(p)).exists():
            raise CheckpointError(
                f"process {p} wrote {index_file(p)} into {tmp} but process 0 cannot see it: the checkpoint "
                "directory must be on a filesystem every process shares (NFS, EFS, FSx for Lustre)")
        out.append(json.loads((tmp / index_file(p)).read_text()))
    if stamp is None or _stamp(tmp) != stamp or any(i.get("save") != stamp for i in out):
        raise CheckpointError(
            f"another save into {tmp} started while this one was writing (two jobs saving to the same path?): "
            "this save was not committed. Give each run its own checkpoint directory")
    return out


def _commit(path: Path, tmp: Path, meta: dict, stamp: str | None) -> None:
    if commit_hook is not None:
        commit_hook("commit", path)
    tensors, placed = {}, {}
    for p, index in enumerate(_indexes(tmp, stamp)):
        tensors.update(index["tensors"])
        for key, piece in index["pieces"].items():
            placed.setdefault(piece["tensor"], []).append({"file": shard_file(p), "key": key,
                                                           "region": piece["region"],
                                                           "checksum": piece["checksum"]})
    for name, info in tensors.items():
        info["pieces"] = placed.get(name, [])
    manifest = {"format": FORMAT, "version": VERSION, "processes": jax.process_count(), **meta,
                "tensors": tensors}
    _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=1))
    _fsync_write(tmp / MARKER, "")
    _fsync_dir(tmp)
    _swap(path, tmp)


def _swap(path: Path, tmp: Path) -> None:
    """`tmp` becomes `path`. A checkpoint already there is moved to `<path>.old` first (a
    directory cannot be renamed over a non-empty one) and deleted after."""
    old = old_of(path)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        _fsync_dir(path.parent)
        if commit_hook is not None:
            commit_hook("swap", path)
    tmp.rename(path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)
