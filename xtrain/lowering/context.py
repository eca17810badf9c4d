"""The explicit lowering's interpreter state, split by how it changes:

    LoweringOptions   fixed for one lowering (mesh sizes, module paths, batch axes, remat, ...)
    Cursor            where the interpreter is (module path, unrolled layer, the conversions
                      already emitted in the jaxpr being interpreted); moved only by its context
                      managers, which restore it on exit
    Record            what the rules found (xtrain.lowering.findings), returned with the program

A `Context` bundles the three for the rules; it is frozen: a rule reads options, moves the
cursor in a `with` block, or passes a Context with other options down (`in_derivative_rule`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Any, Callable, Iterator, Mapping

from xtrain.lowering.findings import Record
from xtrain.sharding.context_parallel import ContextParallel
from xtrain.sharding.fallback import FallbackPolicy
from xtrain.sharding.remat import LayerRemat


def _frozen_map(mapping: Mapping) -> Mapping:
    return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoweringOptions:
    """What one lowering of the per-device program is asked to do.

    Attributes:
        sizes: mesh axis -> size.
        module_paths: the model's module paths (equations are attributed to them).
        batch_axes: axes the batch is split on (activations are never gathered over them).
        remat: activation checkpointing of each layer of a layer scan (None: off).
        regather: ZeRO-3's re-gather policy in each layer (zero.RegatherPolicy), or None.
        unroll: repeated blocks emitted one after another instead of as a layer scan.
        capacity_factor: MoE layers drop the pairs past each expert's capacity (Plan); None: drop-free.
        context: attention over a sequence split along `context`: ring, Ulysses or both (Plan.context).
        platform: what the program is built for ("cpu", "cuda", "neuron"): MoE dispatch is a ragged
            all-to-all on "cuda" (xtrain.lowering.explicit.rules.experts).
        derivative_rule: interpreting a user's JVP rule, whose tangents are linear: nothing
            without a transpose (checkpoint tags, custom VJPs) may be emitted.
        fallback: where a split operand may reach a primitive without a rule and run replicated
            (Plan.fallback_policy(); elsewhere registry.fallback raises UnsupportedOpError).
        synced: parameters whose gradients the layer scan all-reduces inside the backward pass:
            jaxpr var -> mesh axes (xtrain.lowering.gradient_sync.in_layer), with `sync`.
        sync: the GradSync of those all-reduces.
        scattered: ZeRO-2 parameters whose gradients the layer scan reduce-scatters inside the
            backward pass: jaxpr var -> (this device's block of the stacked parameter, its ZeRO
            dim, mesh axes) (xtrain.lowering.zero.scatter_in_layer).
    """

    sizes: Mapping[str, int]
    module_paths: frozenset = frozenset()
    batch_axes: tuple[str, ...] = ()
    remat: LayerRemat | None = None
    regather: Callable | None = None
    unroll: bool = False
    capacity_factor: float | None = None
    context: ContextParallel = ContextParallel()
    platform: str = "cpu"
    derivative_rule: bool = False
    fallback: FallbackPolicy = FallbackPolicy()
    synced: Mapping = dataclasses.field(default_factory=dict)
    sync: Any = None
    scattered: Mapping = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for name in ("sizes", "synced", "scattered"):
            object.__setattr__(self, name, _frozen_map(getattr(self, name)))


class Cursor:
    """Where the interpreter is. Read `path`, `layer` and `memo`; move it with `at`, `in_layer`
    and `fresh_memo`, each restoring what it changed when its block ends."""

    def __init__(self):
        self._path = ""
        self._layer: tuple[str, str] | None = None
        self._memo: dict = {}

    @property
    def path(self) -> str:
        """The module path of the equation being interpreted ("" at top level)."""
        return self._path

    @property
    def layer(self) -> tuple[str, str] | None:
        """(block 0's module path, the unrolled layer's) while an unrolled layer is emitted."""
        return self._layer

    @property
    def memo(self) -> dict:
        """Conversions already emitted in the jaxpr being interpreted (sharded.memoized)."""
        return self._memo

    @contextlib.contextmanager
    def at(self, path: str) -> Iterator[None]:
        """Interprets at module `path`."""
        outer, self._path = self._path, path
        try:
            yield
        finally:
            self._path = outer

    @contextlib.contextmanager
    def in_layer(self, layer: tuple[str, str] | None) -> Iterator[None]:
        """Emits block 0's equations as the unrolled layer `layer` (None: as themselves)."""
        outer, self._layer = self._layer, layer
        try:
            yield
        finally:
            self._layer = outer

    @contextlib.contextmanager
    def fresh_memo(self) -> Iterator[None]:
        """A nested jaxpr that may run in another trace (a scan body) must neither leak its
        conversions out nor see the outer ones."""
        outer, self._memo = self._memo, {}
        try:
            yield
        finally:
            self._memo = outer


@dataclasses.dataclass(frozen=True)
class Context:
    """The options, cursor and record one interpretation shares with its rules."""

    options: LoweringOptions
    cursor: Cursor = dataclasses.field(default_factory=Cursor)
    record: Record = dataclasses.field(default_factory=Record)

    @staticmethod
    def of(sizes: Mapping[str, int], **options) -> "Context":
        """A fresh Context lowering for a mesh of `sizes` with `options` (LoweringOptions' fields)."""
        return Context(LoweringOptions(sizes=sizes, **options))

    def in_derivative_rule(self) -> "Context":
        """This interpretation (same cursor and record) inside a user's derivative rule, whose
        tangents are linear: remat off (a checkpoint_name tag has no transpose) and no custom VJPs."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, remat=None, derivative_rule=True))

    # the options the rules read, and where the interpreter is
    @property
    def sizes(self):
        return self.options.sizes

    @property
    def module_paths(self):
        return self.options.module_paths

    @property
    def batch_axes(self):
        return self.options.batch_axes

    @property
    def remat(self):
        return self.options.remat

    @property
    def regather(self):
        return self.options.regather

    def unpacked(self, *values) -> None:
        """Tells ZeRO-3's re-gather policy (if any) that `values` are gathered weights being
        unpacked, so their reshapes and casts are redone in the backward pass, not saved."""
        if self.options.regather is not None:
            self.options.regather.record(*values)

    @property
    def unroll(self):
        return self.options.unroll

    @property
    def capacity_factor(self):
        return self.options.capacity_factor

    @property
    def context(self) -> ContextParallel:
        return self.options.context

    @property
    def platform(self) -> str:
        return self.options.platform

    @property
    def fallback(self) -> FallbackPolicy:
        return self.options.fallback

    @property
    def synced(self):
        return self.options.synced

    @property
    def sync(self):
        return self.options.sync

    @property
    def scattered(self):
        return self.options.scattered

    @property
    def path(self):
        return self.cursor.path

    @property
    def layer(self):
        return self.cursor.layer

    @property
    def memo(self):
        return self.cursor.memo

    def note(self, text: str) -> None:
        """Tells the report `text` (once, in order)."""
        self.record.note(text)

    def note_fallback(self, primitive: str, gathered_bytes: int = 0) -> None:
        """`primitive` ran replicated at the current module path (no partition rule), gathering
        `gathered_bytes` (its split operands, whole)."""
        self.record.fallback(primitive, self.path, gathered_bytes)

    def count(self, name: str, value) -> None:
        """A per-step count (a Sharded value) of the current module, e.g. an MoE layer's tokens per expert."""
        self.record.count(name, self.path, value)
