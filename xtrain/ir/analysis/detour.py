"""Low-rank detours (LoRA) in the dimension flow.

A row-parallel product's output is a partial sum; its free dimension starts no split. When that
output is *added* to a column-parallel output (LoRA's `base(x) + B(A(x)) * scale`, where
`base` is column-parallel), the cheaper layout splits `B` on its output with the base and keeps
the rank-r `A` whole: no collective in the forward pass (the backward sums A's gradient, r wide).
Splitting the rank instead (A column, B row) would make B's output a partial sum of the base's
full width, to be reduced before the add.

So the free dimension of a row-parallel product's weight becomes a *ghost*: it follows
elementwise ops, transposes and 1:1 reshapes, and where it meets a real split dimension of the
same size it is recorded as a *link*. After the walk a link is taken when the real group is
splittable and the ghost's own group is narrower than it (a low-rank detour); that group is then
left whole.
"""
from __future__ import annotations

import dataclasses

@dataclasses.dataclass(frozen=True)
class Ghost:
    """The output dimension `dim` (size `size`) of weight `name` read at `path`, in a product that
    contracts the split dimension of group `of` (its source index)."""

    name: str
    dim: int
    size: int
    path: str
    of: int


Ghosts = tuple  # per output dimension: a Ghost or None


def carry(eqn, ins: list, ghosts: list, links: list) -> list:
    """The ghosts of `eqn`'s outputs, given its inputs' live labels `ins` and ghosts; a ghost that
    meets a real label at an elementwise op is appended to `links` as (label, ghost)."""
    if not any(ghosts) or len(eqn.outvars) != 1:
        return [None] * len(eqn.outvars)
    prim, out_shape = eqn.primitive.name, tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    held = [g for g in ghosts if g is not None]
    if prim == "transpose":
        return [tuple(held[0][p] for p in eqn.params["permutation"])]
    if prim in ("reshape", "squeeze", "expand_dims"):
        return [_reshape(held[0], tuple(eqn.invars[0].aval.shape), out_shape)]
    shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
    if all(s == () or len(s) == len(out_shape) and all(a in (1, b) for a, b in zip(s, out_shape)) for s in shapes):
        return [_elementwise(eqn, ins, ghosts, out_shape, links)]
    return [None]


def _elementwise(eqn, ins, ghosts, out_shape, links) -> Ghosts | None:
    out: list = [None] * len(out_shape)
    for d in range(len(out_shape)):
        here = [g[d] for g in ghosts if g is not None and g[d] is not None]
        if not here:
            continue
        real = [lab[d] for lab in ins if lab is not None and lab[d] is not None]
        if real and eqn.primitive.name in ("add", "add_any", "sub"):
            links.append((real[0], here[0]))
        elif not real:
            out[d] = here[0]
    return tuple(out) if any(g is not None for g in out) else None


def _reshape(ghost: Ghosts, in_shape: tuple, out_shape: tuple) -> Ghosts | None:
    """Ghosts through a reshape that keeps their dimension's size at the same position among the
    dimensions larger than 1 ((B, T, D) <-> (B*T, D) keeps D)."""
    big_in = [d for d in range(len(in_shape)) if in_shape[d] > 1]
    big_out = [d for d in range(len(out_shape)) if out_shape[d] > 1]
    out: list = [None] * len(out_shape)
    for d, g in enumerate(ghost):
        if g is None or d not in big_in:
            continue
        at = big_in.index(d) - len(big_in)   # counted from the end: leading dims may merge
        if -at <= len(big_out) and out_shape[big_out[at]] == in_shape[d]:
            out[big_out[at]] = g
    return tuple(out) if any(g is not None for g in out) else None


def absorb(groups: list, find, links: list, tp: int) -> set[int]:
    """Take the links whose real group is splittable and wider than the ghost's group (a low-rank
    detour): the ghost's weight joins the real group as a column; returns the roots left whole."""
    dropped: set[int] = set()
    for label, ghost in links:
        real, of = find(label.source), find(ghost.of)
        group, detour = groups[real], groups[of]
        narrower = max((u.size for u in detour.columns), default=0) < min(u.size for u in group.columns)
        if real != of and group.splittable and narrower and ghost.size % tp == 0:
            group.detours.append((ghost, [u.name for u in detour.columns]))
            dropped.add(of)
    return dropped
