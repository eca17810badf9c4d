"""A fused dimension split per segment: `Segments(axes, sizes)` as one entry of a parameter spec.

A fused projection's output (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn) is the
concatenation of segments (q | k | v, gate | up) that the program slices apart. Split
contiguously, a device would hold the wrong mix of them. `Segments(("tensor",), (q, k, v))` says
the dimension is split per segment: device i holds the i-th slice of every segment.

Stored layout: the parameter is stored on the mesh in segment-interleaved order
(q_0 k_0 v_0 | q_1 k_1 v_1 | ...), so an ordinary contiguous split over the axes gives each device
its own slices. `to_stored` / `to_torch` move a tensor between torch's order and that one; the
training step applies them where tensors enter and leave the mesh (placement, state_dict,
checkpoints), so everything outside the step sees torch's order.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from xtrain.errors import PlanError


@dataclasses.dataclass(frozen=True)
class Segments:
    """A spec entry: the dimension is the concatenation of segments of `sizes`, each split over
    `axes` (major first) on its own.

    Attributes:
        axes: the mesh axes splitting every segment (a name or a tuple of names).
        sizes: the segments' sizes, in order; they add up to the dimension.
    """

    axes: tuple[str, ...]
    sizes: tuple[int, ...]

    def __init__(self, axes, sizes):
        object.__setattr__(self, "axes", (axes,) if isinstance(axes, str) else tuple(axes))
        object.__setattr__(self, "sizes", tuple(int(s) for s in sizes))
        if not self.axes or not self.sizes or any(s <= 0 for s in self.sizes):
            raise PlanError(f"Segments(axes={axes!r}, sizes={sizes!r}): give at least one mesh axis and positive "
                            "segment sizes, e.g. Segments('tensor', (q, k, v))")

    def __repr__(self) -> str:
        axes = self.axes[0] if len(self.axes) == 1 else self.axes
        return f"Segments({axes!r}, {self.sizes})"

    def bounds(self) -> list[tuple[int, int]]:
        """(start, stop) of each segment along the dimension."""
        ends = np.cumsum((0,) + self.sizes)
        return [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])]

    def check(self, size: int, parts: int, where: str) -> None:
        """Fails unless the segments tile a dimension of `size` and `parts` divides each."""
        if sum(self.sizes) != size:
            raise PlanError(f"{where}: {self!r} adds up to {sum(self.sizes)}, but the dimension has size {size}; "
                            "give the sizes of all the segments it concatenates")
        bad = [s for s in self.sizes if s % parts]
        if bad:
            raise PlanError(f"{where}: segments {bad} of {self!r} are not divisible by the {parts} devices of "
                            f"{self.axes}; split it contiguously (the axis alone) or leave it whole")

    def stored_order(self, parts: int) -> np.ndarray:
        """Indices into torch's order, in stored order: device 0's slice of every segment, then
        device 1's, ..."""
        pieces = [np.arange(a + i * (b - a) // parts, a + (i + 1) * (b - a) // parts)
                  for i in range(parts) for a, b in self.bounds()]
        return np.concatenate(pieces)


def segmented_dims(spec) -> list[tuple[int, Segments]]:
    """(dimension, Segments) of each per-segment entry of `spec`."""
    return [(d, e) for d, e in enumerate(spec) if isinstance(e, Segments)]


def _take(x, index: np.ndarray, axis: int):
    if isinstance(x, np.ndarray):
        return np.take(x, index, axis=axis)
    import jax.numpy as jnp  # (jax arrays: a device computation, placed again by the caller)

    return jnp.take(x, index, axis=axis)


def to_stored(x, spec, sizes: Mapping[str, int], inverse: bool = False):
    """`x` (torch's order) in the stored order of `spec`'s Segments entries; `inverse`: back."""
    for dim, seg in segmented_dims(spec):
        order = seg.stored_order(math.prod(sizes[a] for a in seg.axes))
        x = _take(x, np.argsort(order) if inverse else order, dim)
    return x


def to_torch(x, spec, sizes: Mapping[str, int]):
    """`x` (stored order) back in torch's order."""
    return to_stored(x, spec, sizes, inverse=True)
