"""What the dimension flow (xtrain.ir.analysis.dimflow) finds: each group of matmul output
dimensions split together, with its columns, sinks, followers and what stops it."""
from __future__ import annotations

import dataclasses

from xtrain.ir.analysis import detour


@dataclasses.dataclass(frozen=True)
class Use:
    """One parameter dimension that a group splits."""

    name: str
    dim: int
    size: int
    path: str      # the module path of the equation that reads it


@dataclasses.dataclass
class Group:
    """Sources split together: their columns, the sinks that contract them, the parameters read
    elementwise with them (biases) and what, if anything, stops the split."""

    columns: list[Use] = dataclasses.field(default_factory=list)
    rows: list[Use] = dataclasses.field(default_factory=list)
    followers: list[Use] = dataclasses.field(default_factory=list)
    segments: dict[str, set[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    heads: dict[str, int] = dataclasses.field(default_factory=dict)   # column name -> heads it reshapes into
    units: dict[str, int] = dataclasses.field(default_factory=dict)   # column name -> rows of one sliced head
    breaks: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)  # (kind, op, where)
    detours: list[tuple[detour.Ghost, list[str]]] = dataclasses.field(default_factory=list)  # LoRA's B, its A

    @property
    def logits(self) -> bool:
        return not self.rows and bool(self.breaks) and all(k in ("reduce", "lookup") for k, _, _ in self.breaks)

    @property
    def splittable(self) -> bool:
        return bool(self.rows) and not self.breaks


@dataclasses.dataclass(frozen=True)
class Flow:
    """The result: groups in program order and the embedding tables (gathered parameters)."""

    groups: tuple[Group, ...]
    tables: tuple[Use, ...]
