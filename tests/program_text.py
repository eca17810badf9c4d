"""Reads a lowered step's HLO text on its own terms, for tests that check xtrain's accounting
against the program (not against itself): which collectives run, over which mesh axes, how
many bytes each moves per step, what runs in bf16, which inputs are donated.

Only the HLO reader of neuron_support is shared with xtrain (a parser of the text format);
nothing here comes from xtrain.lowering.accounting or the report.
"""
from __future__ import annotations

import collections
import math
import re

import numpy as np

from neuron_support import hlo

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")


def nbytes(shape: str) -> int:
    """Bytes of an HLO shape (a tuple shape: the sum of its arrays)."""
    shape = re.sub(r"/\*.*?\*/", "", shape)
    return sum(_BYTES[t] * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(shape))


def dtypes(shape: str) -> set[str]:
    return {t for t, _ in _ARRAY.findall(shape)}


def _kind(opcode: str) -> str | None:
    base = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


def _groups(ins: hlo.Instruction) -> list[list[int]]:
    text = ins.args
    match = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", text)
    if match:
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", match.group(1))]
    pairs = re.search(r"source_target_pairs=\{([\d,{}]*)\}", text)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    raise AssertionError(f"{ins.opcode} {ins.name}: no explicit replica groups in {text[:200]}")


def axes_of(groups: list[list[int]], mesh: dict[str, int], permute: bool = False) -> tuple[str, ...]:
    """The mesh axes a collective's groups span (device ids row-major over `mesh`); a
    collective's groups must be all the orbits of exactly those axes."""
    coords = np.array(np.unravel_index(np.arange(math.prod(mesh.values())), tuple(mesh.values()))).T
    varying = {a for g in groups for k, a in enumerate(mesh) if len({coords[d][k] for d in g}) > 1}
    axes = tuple(a for a in mesh if a in varying)
    if not permute:
        ids = np.arange(math.prod(mesh.values())).reshape(tuple(mesh.values()))
        keep = [k for k, a in enumerate(mesh) if a not in axes] + [k for k, a in enumerate(mesh) if a in axes]
        expected = ids.transpose(keep).reshape(-1, math.prod(mesh[a] for a in axes) if axes else 1)
        assert sorted(map(sorted, groups)) == sorted(map(sorted, expected.tolist())), (groups, axes)
    return axes


def payload(ins: hlo.Instruction, module: hlo.Module, kind: str) -> int:
    """Bytes per device of the whole buffer: an all-gather's result, else its operands."""
    if kind == "all-gather":
        return nbytes(ins.shape)
    return sum(nbytes(module.shape_of(ins.computation, name)) for name in ins.operands)


def _called(ins: hlo.Instruction) -> list[str]:
    if ins.opcode == "while":
        return [ins.attribute("body")]
    if ins.opcode in ("call", "fusion", "async-start"):
        return [c for c in (ins.attribute("to_apply"), ins.attribute("calls")) if c]
    if ins.opcode == "conditional":
        return re.findall(r"(?:branch_computations=\{|true_computation=|false_computation=)%?([\w.\-]+)", ins.args)
    return []


def _holds_collectives(module, ins: hlo.Instruction) -> bool:
    return any(_kind(inner.opcode) or _holds_collectives(module, inner)
               for sub in _called(ins) for inner in module.computations[sub])


def collectives(text: str, mesh: dict[str, int]) -> collections.Counter:
    """(kind, mesh axes, payload bytes) -> how often one step runs it: a loop body's collectives
    count once per iteration (the loop's static trip count; a loop counted at run time, as a
    grouped matmul over a padded buffer is, must hold none)."""
    module = hlo.parse(text)
    found: collections.Counter = collections.Counter()

    def walk(computation: str, times: int) -> None:
        for ins in module.computations[computation]:
            kind = _kind(ins.opcode)
            if kind:
                axes = axes_of(_groups(ins), mesh, permute=kind == "collective-permute")
                found[(kind, axes, payload(ins, module, kind))] += times
            repeat = times
            if ins.opcode == "while":
                trips = hlo.static_trip_count(module, ins)
                assert trips is not None or not _holds_collectives(module, ins), \
                    f"while {ins.name} has collectives and no static trip count"
                repeat = times * (trips or 1)
            for sub in _called(ins):
                walk(sub, repeat)

    walk(module.entry, 1)
    return found


def collective_dtypes(text: str) -> list[tuple[str, set[str], int]]:
    """(kind, dtypes, payload bytes) of every collective instruction, once each."""
    module = hlo.parse(text)
    out = []
    for ins in module.instructions():
        kind = _kind(ins.opcode)
        if kind:
            out.append((kind, dtypes(ins.shape), payload(ins, module, kind)))
    return out


def dot_operand_dtypes(text: str) -> collections.Counter:
    """dtype -> number of floating-point dot / convolution operands of that dtype."""
    module = hlo.parse(text)
    found: collections.Counter = collections.Counter()
    for ins in module.instructions():
        if ins.opcode in ("dot", "convolution"):
            for name in ins.operands[:2]:
                found.update(t for t in dtypes(module.shape_of(ins.computation, name)) if t[0] in "fb")
    return found


def donated_inputs(text: str) -> set[int]:
    """Entry parameter numbers the module aliases to an output (donated buffers)."""
    header = next(line for line in text.splitlines() if line.startswith("HloModule"))
    aliases = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", header)
    return {int(p) for p in re.findall(r":\s*\((\d+),", aliases.group(1))} if aliases else set()


def instruction_names(text: str) -> list[str]:
    return [ins.name for ins in hlo.parse(text).instructions()]
