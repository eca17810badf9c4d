"""torch tensors <-> numpy arrays: batches in, state dicts and exported files out, and models
built with their parameters on the meta device."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Mapping

import jax
import ml_dtypes
import numpy as np
import torch
from safetensors.torch import save_file

from xtrain.errors import OptionsError

# JAX runs without x64: 64-bit inputs become 32-bit, as torchax does for the model itself.
_NARROW = {np.dtype("int64"): np.int32, np.dtype("float64"): np.float32, np.dtype("uint64"): np.uint32}


def to_numpy(x: Any) -> np.ndarray:
    """A batch argument (torch tensor or array-like) as a numpy array, 64-bit types narrowed."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.float().numpy() if x.dtype == torch.bfloat16 else x.numpy()
    x = np.asarray(x)
    return x.astype(_NARROW[x.dtype]) if x.dtype in _NARROW else x


def shape_of(x: Any) -> jax.ShapeDtypeStruct:
    """A batch argument's shape and dtype as the step takes it (64-bit narrowed), without reading
    its values: a torch tensor on the meta device works."""
    if isinstance(x, torch.Tensor):
        dtype = np.dtype(ml_dtypes.bfloat16) if x.dtype == torch.bfloat16 else torch.empty((), dtype=x.dtype).numpy().dtype
    else:
        dtype = np.dtype(x.dtype)
    return jax.ShapeDtypeStruct(tuple(x.shape), _NARROW.get(dtype, dtype))


def to_torch(x: np.ndarray) -> torch.Tensor:
    """A host array as a torch tensor of the same dtype (bfloat16 included)."""
    x = np.asarray(x)
    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(x))


def state_dict(state: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: to_torch(v) for k, v in state.items()}


def save(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Writes a torch state dict as `.safetensors` or with torch.save (`.pt`/`.pth`/`.bin`)."""
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    if path.suffix == ".safetensors":
        save_file(tensors, str(path), metadata={"format": "pt"})
    elif path.suffix in (".pt", ".pth", ".bin"):
        torch.save(tensors, path)
    else:
        raise OptionsError(f"export path {path} must end in .safetensors (safetensors) or .pt/.pth/.bin (torch.save)")


@contextlib.contextmanager
def meta_params():
    """Builds modules whose parameters live on the meta device (no memory) while buffers keep
    real values: rotary tables and masks are small, computed in `__init__`, and often not in
    checkpoints (non-persistent), so a model built wholly under `torch.device("meta")` has none.

        with xtrain.checkpoint.meta_params():
            model = LlamaForCausalLM(config)
        step = xtrain.compile(model, mesh, ..., init_from="checkpoint_dir")

    Each parameter exists on the host only while its own module is constructed."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original
