"""Layouts: how one value of the global program is split over the mesh."""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per-dimension mesh axes (major first) and axes with a sum still pending.

    A value with `partial=("data",)` holds, on each device, one addend of the true value:
    the global value is the sum over the `data` axis.
    """

    dims: tuple[Axes, ...]
    partial: Axes = ()

    def __post_init__(self):
        used = self.split_axes() + tuple(self.partial)
        assert len(set(used)) == len(used), f"mesh axis used twice in layout {self}"

    @staticmethod
    def replicated(ndim: int) -> "Layout":
        return Layout(((),) * ndim)

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def is_replicated(self) -> bool:
        return not self.partial and not any(self.dims)

    def split_axes(self) -> Axes:
        return tuple(a for d in self.dims for a in d)

    def with_dims(self, dims) -> "Layout":
        return Layout(tuple(tuple(d) for d in dims), self.partial)

    def with_partial(self, partial) -> "Layout":
        return Layout(self.dims, tuple(partial))

    def factor(self, dim: int, sizes: Mapping[str, int]) -> int:
        return math.prod(sizes[a] for a in self.dims[dim])

    def local_shape(self, shape, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(s // self.factor(i, sizes) for i, s in enumerate(shape))

    def divides(self, shape, sizes: Mapping[str, int]) -> bool:
        return all(s % self.factor(i, sizes) == 0 for i, s in enumerate(shape))

    def __str__(self) -> str:
        dims = ", ".join("x".join(d) if d else "-" for d in self.dims)
        return f"[{dims}]" + (f" partial({','.join(self.partial)})" if self.partial else "")
