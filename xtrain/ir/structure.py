"""A model's module tree as plain data (kinds, parameters' canonical names and shapes, children),
described once by the front end (xtrain.frontend.structure) so that the compiler never sees torch.
Tensor-parallel plans do not read it: they come from the traced program (xtrain.ir.analysis.dimflow).
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping


class Kind(enum.Enum):
    """What a module is, as far as the presets care."""

    LINEAR = "linear"          # y = x W^T + b: weight (out, in)
    CONV1D = "conv1d"          # HF GPT-2's Conv1D, y = x W + b: weight (in, out)
    EMBEDDING = "embedding"    # a lookup table (num_embeddings, embedding_dim)
    LIST = "list"              # a container of numbered children (torch.nn.ModuleList)
    OTHER = "other"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Module:
    """One module of the tree.

    Attributes:
        path: its module path ("" for the root).
        kind: what it is.
        type_name: its class name (children of one class hold the same structure).
        params: its own parameters: local name ("weight", "bias") -> canonical parameter name
            (tied tensors have one canonical name).
        children: the paths of its direct children, in order.
    """

    path: str
    kind: Kind
    type_name: str
    params: Mapping[str, str] = dataclasses.field(default_factory=dict)
    children: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Structure:
    """A model's modules (by path, in definition order) and its parameters' shapes."""

    modules: Mapping[str, Module]
    shapes: Mapping[str, tuple[int, ...]]   # canonical parameter name -> shape

    def subtree(self, path: str) -> list[Module]:
        """`path`'s module and every module inside it, in order."""
        prefix = path + "." if path else ""
        return [m for p, m in self.modules.items() if p == path or p.startswith(prefix)]

    def shape(self, module: Module, local: str) -> tuple[int, ...]:
        return self.shapes[module.params[local]]
