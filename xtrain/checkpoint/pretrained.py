"""Plain state dicts: export a step's weights under the module's own names, and load an
HF-style safetensors checkpoint straight into the shards each process holds (sharded init).

Sharded loading never builds a whole tensor on the host: for each parameter, every process
reads only the regions its devices hold (`safe_open(...).get_slice`), so a model built on the
torch meta device can be trained without ever being materialised whole in one process.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open

from xtrain.checkpoint.layout import CheckpointError, make_array, read_slice, stacked_reader
from xtrain.frontend import tensors
from xtrain.ir import stacked

INDEX_SUFFIX = ".index.json"  # HF's sharded checkpoints: model.safetensors.index.json


def _files(source: str | os.PathLike) -> list[Path]:
    """The safetensors files of `source`: a file, an HF index file, or a directory with either."""
    source = Path(source)
    if source.is_dir():
        index = sorted(source.glob(f"*.safetensors{INDEX_SUFFIX}"))
        found = index or sorted(source.glob("*.safetensors"))
        if not found:
            raise FileNotFoundError(f"no *.safetensors file in {source}")
        return _files(found[0]) if index else found
    if source.name.endswith(INDEX_SUFFIX):
        shards = sorted(set(json.loads(source.read_text())["weight_map"].values()))
        return [source.parent / s for s in shards]
    if not source.exists():
        raise FileNotFoundError(f"no safetensors file at {source}")
    return [source]


def tensor_locations(source: str | os.PathLike) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """{tensor name: (file, shape, safetensors dtype)} from the files' headers only."""
    out = {}
    for file in _files(source):
        try:
            with safe_open(str(file), framework="np") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    out[key] = (file, tuple(piece.get_shape()), piece.get_dtype())
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{file}: cannot read its safetensors header ({type(err).__name__}: {err}); the "
                                  "file is truncated, corrupt or not a safetensors file") from None
    return out


def _find(name: str, aliases: list[str], where: dict, source) -> str:
    for candidate in (name, *aliases):
        if candidate in where:
            return candidate
    raise CheckpointError(f"{source} has no tensor {name!r}{f' (nor its tied names {aliases})' if aliases else ''}; "
                          f"it has {len(where)} tensors, e.g. {sorted(where)[:6]}")


def load_sharded(source: str | os.PathLike, shapes: Mapping[str, jax.ShapeDtypeStruct],
                 shardings: Mapping[str, jax.sharding.Sharding],
                 aliases: Mapping[str, list[str]] | None = None) -> dict[str, jax.Array]:
    """Each named tensor of `source` placed on its sharding, read region by region.

    Args:
        source: a .safetensors file, an HF `*.safetensors.index.json`, or a directory of them.
        shapes: the expected global shape and dtype per name (e.g. from a meta-device module).
        shardings: where each tensor goes.
        aliases: other names a tensor may be stored under (tied weights saved once).
    """
    where = tensor_locations(source)
    out = {}
    for name, want in shapes.items():
        dtype = jnp.dtype(want.dtype)
        if stacked.is_stacked(name):  # files hold the layers under their own names
            layers = [_region_reader(stacked.member(name, k), tuple(want.shape[1:]), dtype, aliases, where, source)
                      for k in range(want.shape[0])]
            read = stacked_reader(layers, dtype)
        else:
            read = _region_reader(name, tuple(want.shape), dtype, aliases, where, source)
        out[name] = make_array(name, tuple(want.shape), dtype, shardings[name], read)
    return out


def _region_reader(name: str, shape: tuple, dtype: np.dtype, aliases, where: dict, source):
    key = _find(name, list((aliases or {}).get(name, [])), where, source)
    file, stored, _ = where[key]
    if stored != shape:
        raise CheckpointError(f"{file}: tensor {key!r} has shape {list(stored)} but the model's {name} has "
                              f"{list(shape)}")
    return lambda region: read_slice(str(file), key, region).astype(dtype, copy=False)


def export(state: Mapping[str, "object"], path: str | os.PathLike) -> Path:
    """Writes a full torch state dict (name -> tensor) as `.safetensors` or a torch file
    (`.pt`/`.pth`/`.bin`), from process 0 only (the front end writes it: xtrain.frontend.tensors)."""
    path = Path(path)
    if jax.process_index() != 0:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors.save(state, path)
    return path


def read_stored(source: str | os.PathLike, names) -> dict[str, np.ndarray]:
    """The tensors among `names` that a safetensors checkpoint (file, directory or HF index)
    holds, read whole: small ones, such as buffers (replicated)."""
    where = tensor_locations(source)
    return {n: read_slice(str(where[n][0]), n, ()) for n in names if n in where}


meta_params = tensors.meta_params
