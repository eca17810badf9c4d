"""A torch module's tree described as plain data (xtrain.ir.structure.Structure): parameter
shapes under canonical names for the presets, and the module tree."""
from __future__ import annotations

import sys

from torch import nn

from xtrain.ir.structure import Kind, Module, Structure


def _is_conv1d(module) -> bool:
    # HF's Conv1D, looked up only when transformers is already loaded (an HF model is).
    conv1d = getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
    return conv1d is not None and isinstance(module, conv1d)


def _kind(module: nn.Module) -> Kind:
    if isinstance(module, nn.Linear):
        return Kind.LINEAR
    if _is_conv1d(module):
        return Kind.CONV1D
    if isinstance(module, nn.Embedding):
        return Kind.EMBEDDING
    return Kind.LIST if isinstance(module, nn.ModuleList) else Kind.OTHER


def describe(model: nn.Module) -> Structure:
    """The module tree of `model`: kinds, parameters under their canonical names (a tied tensor
    under the first name torch gives it), children."""
    names = {id(p): n for n, p in reversed(list(model.named_parameters(remove_duplicate=False)))}
    modules = {}
    for path, module in model.named_modules():
        params = {local: names[id(p)] for local, p in module.named_parameters(recurse=False)}
        children = tuple(f"{path}.{c}" if path else c for c, _ in module.named_children())
        modules[path] = Module(path=path, kind=_kind(module), type_name=type(module).__name__, params=params,
                               children=children)
    return Structure(modules, {n: tuple(p.shape) for n, p in model.named_parameters()})
