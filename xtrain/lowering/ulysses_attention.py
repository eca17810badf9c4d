"""Ulysses attention: a sequence split along `context` turned into a head split for attention.

Each of the U devices of a Ulysses group holds a chunk of the sequence for every head. One
all-to-all per operand (q, k, v) sends head block i of its chunk to device i of the group and
joins what arrives along the sequence, so device i holds heads block i over the group's whole
sequence; attention is then computed per head with nothing else exchanged, and one all-to-all
of the output moves it back to the sequence split (DeepSpeed-Ulysses, arXiv:2309.14509).
Autodiff's transposes are all-to-alls again: four forward, four backward per attention.

Operands are the blockwise kernel's (xtrain.ir.kernels.blockwise): q (..., Hk, G, n, D) with Hk
key/value heads and G query heads per key/value head, k and v (..., Hk, n, D). Where U divides
Hk the key/value heads split. Grouped-query attention with fewer key/value heads than U
(U = Hk x r): each key/value head is repeated r times before its all-to-all and the query
heads of one key/value head split r ways, so device i holds key/value head i // r and
the (i % r)-th share of its query heads (r must divide G).

In hybrid context parallelism the groups are U neighbouring devices of the `context` axis
(`groups`), and a ring over the groups (xtrain.lowering.ring_attention, Ring.inner = U) computes
attention over the group's sequence chunks.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from xtrain.errors import PlanError
from xtrain.ir.kernels import attention_dropout as dm
from xtrain.lowering import collectives


@dataclasses.dataclass(frozen=True)
class Ulysses:
    """One attention call's head split over groups of `size` devices of mesh axis `axis`.

    Attributes:
        axis: the context axis; size: devices per Ulysses group; groups: the number of groups
            (the ring's size under hybrid context parallelism; 1: Ulysses over the whole axis).
        heads: key/value heads on this device before the split (Hk, after any tensor split);
            group: query heads per key/value head (G).
    """

    axis: str
    size: int
    groups: int
    heads: int
    group: int

    @property
    def repeat(self) -> int:
        """Copies of each key/value head sent (r > 1: fewer key/value heads than the group)."""
        return 1 if self.heads % self.size == 0 else self.size // self.heads

    @property
    def index_groups(self) -> list[list[int]] | None:
        if self.groups == 1:
            return None
        return [[g * self.size + i for i in range(self.size)] for g in range(self.groups)]

    def check(self, where: str, query_heads: int) -> None:
        """A clear error for heads that do not split over the group."""
        u, hk, g = self.size, self.heads, self.group
        if hk % u == 0 or (u % hk == 0 and g % (u // hk) == 0):
            return
        divisors = [d for d in range(1, u) if u % d == 0 and (hk % d == 0 or (d % hk == 0 and g % (d // hk) == 0))]
        raise PlanError(
            f"attention in {where!r}: Ulysses over {u} devices of mesh axis {self.axis!r} splits the heads "
            f"{u} ways, but this device holds {hk} key/value heads x {g} query heads each "
            f"({query_heads} query heads in all); the key/value heads must divide by {u}, or {u} by them with "
            f"the query heads of each dividing by the rest. Use Plan(context=xtrain.ContextParallel(ulysses=U)) "
            f"with U in {divisors} (a ring over the rest), or Plan(context='ring')")

    # -- the all-to-alls ---------------------------------------------------------------------------

    def _swap(self, x, split: int, join: int):
        return collectives.all_to_all(x, (self.axis,), split, join, groups=self.index_groups)

    def queries(self, q):
        """(..., Hk, G, n, D), sequence chunk -> (..., Hk', G', n x U, D), this device's heads."""
        r, nd = self.repeat, q.ndim
        if r > 1:  # (Hk, G) -> (Hk x r, G / r): query heads of one kv head as r consecutive heads
            q = q.reshape(q.shape[:nd - 4] + (self.heads * r, self.group // r) + q.shape[nd - 2:])
        return self._swap(q, nd - 4, nd - 2)

    def keys(self, k):
        """(..., Hk, n, D) -> (..., Hk', n x U, D), the key/value heads of this device's query heads."""
        if self.repeat > 1:
            k = jnp.repeat(k, self.repeat, axis=k.ndim - 3)
        return self._swap(k, k.ndim - 3, k.ndim - 2)

    def output(self, out):
        """The inverse of `queries` on the attention output."""
        nd = out.ndim
        out = self._swap(out, nd - 2, nd - 4)
        if self.repeat > 1:
            out = out.reshape(out.shape[:nd - 4] + (self.heads, self.group) + out.shape[nd - 2:])
        return out

    def lead_index(self, local_lead: tuple[int, ...], offsets: list, whole: tuple[int, ...]):
        """The flat global index of each leading (batch..., Hk', G') position this device holds
        after `queries` (xtrain.ir.kernels.attention_dropout): `offsets` and `whole` are those of
        the leading dims before it (the sequence split: heads start at their tensor split's
        offset), `local_lead` is q's leading shape after it."""
        place = lax.axis_index(self.axis) % self.size
        offsets = list(offsets)
        hk, g = len(local_lead) - 2, len(local_lead) - 1
        if self.repeat == 1:
            offsets[hk] = offsets[hk] + place * local_lead[hk]
        else:
            offsets[hk] = offsets[hk] + place // self.repeat
            offsets[g] = offsets[g] + (place % self.repeat) * local_lead[g]
        return dm.flat_index(local_lead, offsets, whole)
