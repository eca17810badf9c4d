"""What a lowering found while tracing one step: the report's notes, the ops that fell back to
replicated execution, the per-step counts the rules emit, the repeated block families.

A `Record` collects them while one per-device program is interpreted (the rules write to it
through their Context); `Findings` is its frozen value, returned with the strategy's gradients
and exposed as `StepProgram.findings`. Reports and tests read findings, never a strategy's
trace leftovers.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Any, Iterable, Mapping

TOP_LEVEL = "<top level>"  # the module path of an op outside every module


def _frozen_map(pairs: Mapping) -> Mapping:
    return types.MappingProxyType(dict(pairs))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Findings:
    """What the lowering of one step found.

    Attributes:
        notes: what the rules told the report (ring attention, expert parallel, capacity), in order.
        fallbacks: primitive -> module paths where it ran replicated (no partition rule).
        fallback_bytes: primitive -> bytes of split operands its replicated runs all-gathered
            (per traced call; a layer scan's body counts once).
        counts: (name, module path) of each per-step count the step outputs, e.g.
            ("expert_tokens", "model.layers.0.mlp"); their values are the step's outputs.
        repeated: the families of repeated blocks the layer scan runs (explicit/blocks.py
            RepeatedBlocks), in program order; empty when the traced blocks are not one family.
        block_notes: what the report says about those families (per-layer variants, outputs).
        scanned: stacked parameters the layer scan reads in place.
        stage_layers: with a pipeline, the number of layers each (stage, chunk) runs, stage-major.
    """

    notes: tuple[str, ...] = ()
    fallbacks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: _frozen_map({}))
    fallback_bytes: Mapping[str, int] = dataclasses.field(default_factory=lambda: _frozen_map({}))
    counts: tuple[tuple[str, str], ...] = ()
    repeated: tuple[Any, ...] = ()
    block_notes: tuple[str, ...] = ()
    scanned: frozenset[str] = frozenset()
    stage_layers: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "fallbacks", _frozen_map(self.fallbacks))
        object.__setattr__(self, "fallback_bytes", _frozen_map(self.fallback_bytes))

    def report_notes(self) -> list[str]:
        """The report's lines: the fallbacks, the block families, then the rules' notes."""
        fallbacks = [f"no partition rule for {prim}: gathered and run replicated in {sorted(paths)}"
                     for prim, paths in sorted(self.fallbacks.items())]
        return fallbacks + list(self.block_notes) + list(self.notes)


class Record:
    """Collects findings while a per-device program is interpreted (one Record per interpretation:
    its counts are traced values of that trace)."""

    def __init__(self):
        self._notes: dict[str, None] = {}  # a dict: ordered, each note once
        self._fallbacks: dict[str, set[str]] = {}
        self._fallback_bytes: dict[str, int] = {}
        self.counts: dict[tuple[str, str], Any] = {}  # (name, module path) -> Sharded count

    def note(self, text: str) -> None:
        self._notes[text] = None

    def fallback(self, primitive: str, path: str, gathered_bytes: int = 0) -> None:
        self._fallbacks.setdefault(primitive, set()).add(path or TOP_LEVEL)
        self._fallback_bytes[primitive] = self._fallback_bytes.get(primitive, 0) + gathered_bytes

    def count(self, name: str, path: str, value) -> None:
        self.counts[name, path or TOP_LEVEL] = value

    def take_counts(self, before: Iterable) -> dict:
        """The counts recorded since the keys `before` were: removed from the record (a layer's
        counts leave its scan as outputs and are recorded again per layer)."""
        return {key: self.counts.pop(key) for key in set(self.counts) - set(before)}


def collected(records: Iterable[Record], **found) -> Findings:
    """The Findings of `records` (all interpretations of one step's program), with `found`'s
    fields (what the strategy found besides the rules: repeated blocks, stage layers, ...)."""
    notes: dict[str, None] = {}
    fallbacks: dict[str, set[str]] = {}
    gathered: dict[str, int] = {}
    counts: dict[tuple[str, str], None] = {}
    for record in records:
        notes.update(record._notes)
        for prim, paths in record._fallbacks.items():
            fallbacks.setdefault(prim, set()).update(paths)
        for prim, n in record._fallback_bytes.items():  # the forward's trace and the backward's see one op
            gathered[prim] = max(gathered.get(prim, 0), n)
        counts.update(dict.fromkeys(sorted(record.counts)))
    return Findings(notes=tuple(notes), fallbacks={p: tuple(sorted(s)) for p, s in fallbacks.items()},
                    fallback_bytes=gathered,
                    counts=tuple(counts), **found)
