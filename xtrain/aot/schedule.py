"""What XLA's GPU compiler scheduled: the collectives of a compiled program (`Compiled.as_text()`,
per device, in schedule order) and the GEMMs it placed between each one's start and done.

XLA's GPU backend turns collectives into start/done pairs (all-reduce-start / -done,
all-gather-start, reduce-scatter-start, collective-permute-start, or async-start wrapping one);
the latency-hiding scheduler moves independent compute between the two, and that compute is
what hides the transfer. A GEMM is a fusion whose fused computation holds a dot or convolution
(Triton GEMMs, which a deviceless compile makes of every matmul) or a cuBLAS custom call. A loop
body's collectives run once per iteration (XLA's known_trip_count).

The HLO reader is neuron_support.hlo (the one shared reader of the text format); replica groups
are read by xtrain.ir.hlo in every notation XLA prints.
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from neuron_support import hlo
from xtrain.ir import hlo as groups_of

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective instruction of the compiled program.

    Attributes:
        kind: all-reduce, all-gather, reduce-scatter, collective-permute or all-to-all.
        axes: the mesh axes its replica groups span.
        bytes: bytes per device per step: `payload` times `times`.
        payload: bytes of one execution (the whole buffer: an all-gather's result, else its operands).
        times: executions per step (loop trip counts multiplied).
        dtypes: the element types it moves.
        overlap_flops: FLOPs of the GEMMs the scheduler placed between its start and done (0 for a
            synchronous collective or an empty window).
        gemms: how many GEMM kernels run between start and done.
        name: its HLO instruction name.
        source: its op_name metadata (the jaxpr's name stack: module path, transpose(...) in the backward).
        overlapped: the op_name metadata of each GEMM run between start and done.
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    payload: int
    times: int
    dtypes: tuple[str, ...]
    overlap_flops: float
    gemms: int
    name: str
    source: str = ""
    overlapped: tuple[str, ...] = ()


def nbytes(shape: str) -> int:
    shape = re.sub(r"/\*.*?\*/", "", shape)
    return sum(_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(shape))


def _dims(shape: str) -> list[int]:
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def axes_of(groups: list[list[int]], mesh: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of some group differ (device ids are positions in
    the mesh's row-major device order)."""
    if not groups:  # no groups written: every device
        return tuple(a for a, n in mesh.items() if n > 1)
    coords = np.array(np.unravel_index(np.arange(math.prod(mesh.values())), tuple(mesh.values()))).T
    varying = {a for g in groups for k, a in enumerate(mesh) if len({int(coords[d][k]) for d in g}) > 1}
    return tuple(a for a in mesh if a in varying)


class Schedule:
    """A compiled program's collectives and GEMMs, read once."""

    def __init__(self, text: str, mesh: dict[str, int]):
        self.module = hlo.parse(text)
        self.mesh = dict(mesh)
        self._gemm_flops: dict[str, float] = {}

    # -- GEMMs ----------------------------------------------------------------------------------
    def _dot_flops(self, ins: hlo.Instruction) -> float:
        lhs = self.module.shape_of(ins.computation, ins.operands[0]) if ins.operands else ""
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.args)
        dims = _dims(lhs)
        k = math.prod(dims[int(i)] for i in contracting.group(1).split(",") if i) if contracting and dims else 1
        return 2.0 * math.prod(_dims(ins.shape)) * k

    def _computation_flops(self, name: str) -> float:
        """Dot / convolution FLOPs of a fused computation (and what it calls)."""
        if name not in self._gemm_flops:
            self._gemm_flops[name] = 0.0
            total = 0.0
            for ins in self.module.computations.get(name, []):
                if ins.opcode in ("dot", "convolution"):
                    total += self._dot_flops(ins)
                for sub in (ins.attribute("calls"), ins.attribute("to_apply")):
                    if sub and sub in self.module.computations:
                        total += self._computation_flops(sub)
            self._gemm_flops[name] = total
        return self._gemm_flops[name]

    def gemm_flops(self, ins: hlo.Instruction) -> float:
        """FLOPs of `ins` if it is a GEMM kernel, else 0."""
        if ins.opcode == "fusion":
            return self._computation_flops(ins.attribute("calls") or "")
        if ins.opcode == "custom-call" and re.search(r"cublas|gemm", ins.attribute("custom_call_target") or ""):
            out = re.sub(r"^\(|,\s*s8\[\d+\].*$", "", ins.shape)  # (result, workspace)
            lhs = self.module.shape_of(ins.computation, ins.operands[0]) if ins.operands else ""
            contracting = re.search(r'"lhs_contracting_dimensions":\["?(\d+)', ins.args)
            dims = _dims(lhs)
            k = dims[int(contracting.group(1))] if contracting and dims else 1
            return 2.0 * math.prod(_dims(out)) * k
        return 0.0

    # -- collectives ----------------------------------------------------------------------------
    def _op(self, ins: hlo.Instruction) -> str:
        """The instruction's operation, "-start" left out and an async-start's wrapped one."""
        op = ins.opcode[:-len("-start")] if ins.opcode.endswith("-start") else ins.opcode
        if op == "async":  # async-start wrapping a collective's computation
            root = self.module.root(ins.attribute("calls") or "")
            op = root.opcode if root is not None else ""
        return op

    def _kind(self, ins: hlo.Instruction) -> str | None:
        op = self._op(ins)
        op = "all-to-all" if op == "ragged-all-to-all" else op  # counted as xtrain.lowering.accounting does
        return op if op in KINDS else None

    def _payload(self, ins: hlo.Instruction, kind: str, done: hlo.Instruction | None) -> int:
        if kind == "all-gather":
            return nbytes(done.shape if done is not None else ins.shape)
        sizes = [nbytes(self.module.shape_of(ins.computation, n)) for n in ins.operands]
        if self._op(ins) == "ragged-all-to-all":  # (operand, output, offsets, sizes): the rows routed
            return min(sizes[:2])  # as xtrain.lowering.accounting counts it
        return sum(sizes)

    def _gemms(self, ins: hlo.Instruction) -> tuple[float, list]:
        """(FLOPs, GEMM instructions) of `ins`: a GEMM kernel, or a loop's body (times its static
        trip count; once where it is known at run time only, as a grouped matmul over a padded
        buffer's is)."""
        f = self.gemm_flops(ins)
        if f or ins.opcode != "while":
            return f, [ins] if f else []
        flops, gemms = 0.0, []
        for inner in self.module.computations.get(ins.attribute("body") or "", []):
            f, found = self._gemms(inner)
            flops, gemms = flops + f, gemms + found
        return flops * self._trips(ins), gemms

    def _window(self, body: list[hlo.Instruction], index: int) -> tuple[hlo.Instruction | None, float, list]:
        """The done of the start at `index`, the GEMM FLOPs and the GEMMs scheduled in between."""
        start = body[index]
        flops, gemms = 0.0, []
        for ins in body[index + 1:]:
            if ins.opcode.endswith("-done") and start.name in ins.operands:
                return ins, flops, gemms
            f, found = self._gemms(ins)
            flops, gemms = flops + f, gemms + found
        return None, 0.0, []

    def _trips(self, ins: hlo.Instruction) -> int:
        trips = hlo.static_trip_count(self.module, ins)
        return 1 if trips is None else trips

    def collectives(self) -> list[ScheduledCollective]:
        """Every collective instruction reachable from the entry computation, in schedule order."""
        found: list[ScheduledCollective] = []
        seen: set[str] = set()

        def walk(computation: str, times: int) -> None:
            if computation in seen and times == 1:
                return
            seen.add(computation)
            body = self.module.computations.get(computation, [])
            for i, ins in enumerate(body):
                kind = self._kind(ins)
                if kind is not None:
                    done, flops, gemms = self._window(body, i) if ins.opcode.endswith("-start") else (None, 0.0, [])
                    payload = self._payload(ins, kind, done)
                    groups = groups_of.replica_groups(ins.args)
                    found.append(ScheduledCollective(
                        kind, axes_of(groups, self.mesh), payload * times, payload, times,
                        tuple(sorted({t for t, _ in _ARRAY.findall((done or ins).shape)} - {"u32", "s32"}
                                     or {t for t, _ in _ARRAY.findall(ins.shape)})),
                        flops, len(gemms), ins.name, ins.op_name, tuple(g.op_name for g in gemms)))
                if ins.opcode == "while":
                    walk(ins.attribute("body") or "", times * self._trips(ins))
                elif ins.opcode in ("call", "conditional", "async-start"):
                    for sub in re.findall(r"(?:to_apply|calls|branch_computations=\{|true_computation|"
                                          r"false_computation)=?%?([\w.\-]+)", ins.args):
                        if sub in self.module.computations and self._kind(ins) is None:
                            walk(sub, times)

        walk(self.module.entry, 1)
        return found


def totals(collectives, key=lambda c: (c.kind, c.axes)) -> dict:
    """(kind, axes) -> (bytes per step, executions per step)."""
    out: dict = {}
    for c in collectives:
        b, n = out.get(key(c), (0, 0))
        out[key(c)] = (b + c.bytes, n + c.times)
    return out
