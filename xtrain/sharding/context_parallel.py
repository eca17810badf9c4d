"""How attention runs over a sequence split along the mesh axis `context` (`Plan(context=...)`).

    ring       key/value chunks travel round the `context` devices (one collective permute per
               step) while each device attends with its own queries: memory and work per device
               fall with the axis, the traffic is 2 x (context - 1) key/value chunks per layer
               (xtrain.lowering.ring_attention).
    ulysses    four all-to-alls per attention (q, k, v in, the output back) move the split from
               the sequence to the heads: each device attends over the whole sequence for
               heads / context of the heads, so the attention kernel is the single-device one
               (DeepSpeed-Ulysses, arXiv:2309.14509). The query heads must split over the axis.
    ContextParallel(ulysses=U)
               hybrid: Ulysses over groups of U neighbouring `context` devices (inner), a ring
               over the context / U groups (outer): the head split U is what the heads allow,
               the ring takes the rest (the "unified sequence parallel" of arXiv:2405.07719).
"""
from __future__ import annotations

import dataclasses

from xtrain.errors import PlanError
from xtrain.sharding.mesh import CONTEXT

ALL = -1  # Ulysses over the whole context axis


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Attention over the `context` axis: Ulysses (all-to-all to a head split) over groups of
    `ulysses` neighbouring devices, a ring over the groups.

    Attributes:
        ulysses: the Ulysses group size; 1: a ring only (`Plan(context="ring")`, the default);
            -1: the whole axis (`Plan(context="ulysses")`); else a divisor of the axis size.
    """

    ulysses: int = 1

    def __post_init__(self):
        if not isinstance(self.ulysses, int) or isinstance(self.ulysses, bool) or not (
                self.ulysses == ALL or self.ulysses >= 1):
            raise PlanError(f"ContextParallel(ulysses={self.ulysses!r}): give the Ulysses group size (a positive "
                            "divisor of the context axis), or -1 for the whole axis")

    @classmethod
    def of(cls, value: "ContextParallel | str | None") -> "ContextParallel":
        if isinstance(value, ContextParallel):
            return value
        if value is None or value == "ring":
            return cls(1)
        if value == "ulysses":
            return cls(ALL)
        raise PlanError(f"Plan(context={value!r}) must be 'ring', 'ulysses' or xtrain.ContextParallel(ulysses=U)")

    def degrees(self, context: int) -> tuple[int, int]:
        """(Ulysses group size, ring size) on a `context` axis of this size."""
        u = context if self.ulysses == ALL else self.ulysses
        if context % u:
            raise PlanError(f"ContextParallel(ulysses={u}) on mesh axis {CONTEXT!r}={context}: the Ulysses group size "
                            f"must divide the axis; use one of {[d for d in range(1, context + 1) if context % d == 0]}")
        return u, context // u

    @property
    def name(self) -> str:
        return {1: "ring", ALL: "ulysses"}.get(self.ulysses, f"ulysses{self.ulysses}xring")
