"""Block parameters stored stacked: one (L, ...) array per position in a repeated block.

A torch transformer names its layers' parameters `model.layers.0.mlp.up_proj.weight`,
`model.layers.1.mlp.up_proj.weight`, ... xtrain stores such a family as one array
`model.layers.*.mlp.up_proj.weight` with a leading layer dimension. The layer scan then reads
each layer's slice straight from it, so nothing is stacked or unstacked per step, and the
optimizer update, gradient synchronisation and ZeRO bookkeeping are a handful of operations
whatever the depth (their cost and the compile time stay flat in depth).

`StackedModel` wraps a Model: it presents the stacked names and shapes to the rest of xtrain
and hands the wrapped model its per-layer tensors as slices of the stacked ones. Everything a
user sees keeps the per-layer names: `state_dict`, `export`, checkpoints loaded under another
layout (xtrain.checkpoint reads either form into either form).

A family is stacked only when every layer 0..L-1 has the tensor and all agree on everything
that is decided per tensor: shape, dtype, trainability, optimizer param group, and the plan's
parameter and optimizer-state specs. Otherwise the family stays per layer (still correct;
the scan then stacks those values itself).
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any, Callable, Hashable, Iterable, Mapping

import numpy as np
from jax import lax

from xtrain.ir.model import Model

MARK = "*"  # the layer index's place in a stacked name
_LAYER = re.compile(r"^(.*?)\.(\d+)\.(.+)$")  # outermost numbered container, as the layer scan


def member(name: str, k: int) -> str:
    """Layer k's name in a stacked family; a name that is not stacked is returned as it is."""
    return name.replace(f".{MARK}.", f".{k}.", 1)


def family(name: str) -> tuple[str, int] | None:
    """(stacked name, layer index) of a per-layer name, or None."""
    match = _LAYER.match(name)
    return (f"{match.group(1)}.{MARK}.{match.group(3)}", int(match.group(2))) if match else None


def is_stacked(name: str) -> bool:
    return f".{MARK}." in name


@dataclasses.dataclass(frozen=True)
class Stacking:
    """Which per-layer tensors are stored as one stacked array: {stacked name: members, in
    layer order}. Row i of a stored array holds layer `rows[name][i]` (None: a padding row of
    zeros); by default row k is layer k. `axis`: the mesh axis the row dimension is split over
    (None: whole on every device; the pipeline step stores each stage's layers on that stage)."""

    groups: Mapping[str, tuple[str, ...]]
    rows: Mapping[str, tuple[int | None, ...]] = dataclasses.field(default_factory=dict)
    axis: str | None = None

    @classmethod
    def find(cls, names: Iterable[str], agree: Callable[[str], Hashable]) -> "Stacking":
        """The families of `names` with layers 0..L-1 (L >= 2) all present and equal under
        `agree` (the per-tensor decisions that must match to share one array)."""
        found: dict[str, dict[int, str]] = defaultdict(dict)
        for name in names:
            if (fam := family(name)) is not None:
                found[fam[0]][fam[1]] = name
        groups = {}
        for stacked, layers in found.items():
            members = tuple(layers[k] for k in range(len(layers)) if k in layers)
            if len(members) >= 2 and len(members) == len(layers) and len({agree(m) for m in members}) == 1:
                groups[stacked] = members
        return cls(groups)

    def __bool__(self) -> bool:
        return bool(self.groups)

    def rows_of(self, name: str) -> tuple[int | None, ...]:
        return tuple(self.rows.get(name, range(len(self.groups[name]))))

    def stored_names(self, names: Iterable[str]) -> list[str]:
        """`names` with each stacked family replaced by its stacked name (at its first member)."""
        of = {m: s for s, members in self.groups.items() for m in members}
        out: list[str] = []
        for n in names:
            s = of.get(n, n)
            if s == n or n == self.groups[s][0]:
                out.append(s)
        return out

    def _stored(self, values: Mapping[str, Any], combine: Callable[[str], Any]) -> dict:
        return {n: combine(n) if n in self.groups else values[n] for n in self.stored_names(values)}

    def member_names(self, names: Iterable[str]) -> list[str]:
        """Stored `names` with each stacked family replaced by its members (the per-layer names)."""
        return [m for n in names for m in (self.groups[n] if n in self.groups else (n,))]

    def stack_dict(self, values: Mapping[str, Any], stack: Callable[[list], Any] = np.stack,
                   zeros: Callable[[Any], Any] = np.zeros_like) -> dict:
        """Per-layer dict -> stored dict: each family's layers stacked in row order, padding rows
        zeros."""
        def combine(n):
            members = self.groups[n]
            return stack([values[members[r]] if r is not None else zeros(values[members[0]])
                          for r in self.rows_of(n)])
        return self._stored(values, combine)

    def stack_first(self, values: Mapping[str, Any]) -> dict:
        """Per-layer dict of per-tensor facts (all equal within a family) -> stored dict."""
        return self._stored(values, lambda n: values[self.groups[n][0]])

    def unstack_dict(self, values: Mapping[str, Any], take: Callable[[Any, int], Any] = lambda x, k: x[k]) -> dict:
        """Stored dict -> per-layer dict (`take(value, i)` is row i of a stacked value)."""
        out = {}
        for n, v in values.items():
            if n in self.groups:
                out.update({self.groups[n][r]: take(v, i) for i, r in enumerate(self.rows_of(n)) if r is not None})
            else:
                out[n] = v
        return out

    def stack_specs(self, specs: Mapping[str, tuple]) -> dict[str, tuple]:
        """A stacked tensor's spec: its members' spec after the row dimension (whole, or split
        over `axis`)."""
        return self._stored(specs, lambda n: (self.axis,) + tuple(specs[self.groups[n][0]]))

    def stack_shapes(self, shapes: Mapping[str, Any]) -> dict[str, Any]:
        import jax

        def combine(n):
            first = shapes[self.groups[n][0]]
            return jax.ShapeDtypeStruct((len(self.rows_of(n)),) + tuple(first.shape), first.dtype)
        return self._stored(shapes, combine)

    def row_table(self) -> dict[str, tuple[int | None, ...]]:
        """{stacked name: layer of each row} for checkpoints (which store layers by name)."""
        return {n: self.rows_of(n) for n in self.groups}


def _slice_layer(x, k: int):
    return lax.index_in_dim(x, k, 0, keepdims=False)  # slice + squeeze: the layer scan reads through it


class StackedModel(Model):
    """`inner` with its block parameters stored stacked (see module docstring)."""

    def __init__(self, inner: Model, stacking: Stacking):
        self.inner, self.stacking, self.name = inner, stacking, inner.name

    def __getattr__(self, attr: str):  # loss_fn, module, name_of, ... of the wrapped model
        if attr in ("inner", "stacking"):
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def initial_params(self) -> dict[str, np.ndarray]:
        return self.stacking.stack_dict(self.inner.initial_params())

    def param_shapes(self) -> dict[str, Any]:
        return self.stacking.stack_shapes(self.inner.param_shapes())

    def initial_buffers(self, stored: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        return self.inner.initial_buffers(stored)

    def buffer_names(self) -> list[str]:
        return self.inner.buffer_names()

    def buffer_shapes(self) -> dict[str, Any]:
        return self.inner.buffer_shapes()

    def trainable(self) -> dict[str, bool]:
        return self.stacking.stack_first(self.inner.trainable())

    def apply(self, params, buffers, key, batch, *, training: bool):
        return self.inner.apply(self.stacking.unstack_dict(params, _slice_layer), buffers, key, batch,
                                training=training)

    def module_paths(self) -> frozenset[str]:
        return self.inner.module_paths()

    def export_state(self, params, buffers) -> dict:
        return self.inner.export_state(self.stacking.unstack_dict(params), buffers)


def stored_model(model: Model, stacking: Stacking) -> Model:
    """`model` as a step stores it: its stacked families under their stacked names."""
    return StackedModel(model, stacking) if stacking else model
