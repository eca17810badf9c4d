"""Pipeline schedules as explicit tables: at each tick, what each pipeline stage does.

A table has one row per tick and one entry per stage (device along the `pipe` axis): the
forward or backward of one microbatch (of one virtual chunk, for the interleaved schedule),
or nothing. Every entry is one unit of time, a forward and a backward alike, so a table's
bubble is its share of idle entries. Tables are built by running each stage's Megatron-style
order of work greedily: a stage does its next action as soon as what it depends on finished
at an earlier tick (the forward on the previous virtual stage, the backward on the next).

    GPipe        all forwards, then all backwards (reverse order, as autodiff gives)
    1F1B         min(p - s - 1, m) warm-up forwards at stage s, then one forward / one
                 backward alternately, then the remaining backwards: p - s microbatches held
    interleaved  v chunks per stage, virtual stage c * p + s on stage s; warm-up
                 (p - s - 1) * 2 + (v - 1) * p; needs m divisible by p
"""
from __future__ import annotations

import dataclasses
import enum

from xtrain.errors import PlanError
from xtrain.sharding.pipeline import SCHEDULES


class Kind(enum.IntEnum):
    IDLE = 0
    FORWARD = 1
    BACKWARD = 2



@dataclasses.dataclass(frozen=True)
class Op:
    """The forward or backward of `microbatch` through chunk `chunk` of a stage."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        tag = "F" if self.kind == Kind.FORWARD else "B"
        return f"{tag}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclasses.dataclass(frozen=True)
class Table:
    """ticks[t][s]: the Op stage s runs at tick t, or None (idle)."""

    name: str
    stages: int
    microbatches: int
    chunks: int
    ticks: tuple[tuple[Op | None, ...], ...]

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def bubble(self) -> float:
        """Share of (tick, stage) entries that are idle."""
        slots = len(self.ticks) * self.stages
        return sum(op is None for row in self.ticks for op in row) / slots

    def held(self, stage: int) -> int:
        """Peak number of (microbatch, chunk) activations stage `stage` holds: forward done,
        backward not yet."""
        live, peak = set(), 0
        for row in self.ticks:
            op = row[stage]
            if op is not None and op.kind == Kind.FORWARD:
                live.add((op.microbatch, op.chunk))
                peak = max(peak, len(live))
            elif op is not None:
                live.discard((op.microbatch, op.chunk))
        return peak

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.stages} stages x {self.microbatches} microbatches"
                 + (f" x {self.chunks} chunks" if self.chunks > 1 else "")
                 + f", {len(self.ticks)} ticks, bubble {self.bubble():.1%}"]
        for s in range(self.stages):
            lines.append(f"  stage {s}: " + " ".join(f"{str(r[s]) if r[s] else '.':>5}" for r in self.ticks))
        return "\n".join(lines)


def _forward_order(stages: int, microbatches: int, chunks: int, stage: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) in the order a stage runs its forwards: groups of p microbatches
    through chunk 0, then the same group through chunk 1, ... (Megatron's interleaving)."""
    if chunks == 1:
        return [(i, 0) for i in range(microbatches)]
    group = stages * chunks
    return [((k // group) * stages + k % stages, (k % group) // stages) for k in range(microbatches * chunks)]


def _orders(name: str, p: int, m: int, v: int) -> list[list[Op]]:
    out = []
    for s in range(p):
        fwd = [Op(Kind.FORWARD, i, c) for i, c in _forward_order(p, m, v, s)]
        bwd = [Op(Kind.BACKWARD, i, v - 1 - c) for i, c in _forward_order(p, m, v, s)]
        if name == "gpipe":
            out.append(fwd + bwd[::-1])
            continue
        warmup = min((p - s - 1) * 2 + (v - 1) * p if v > 1 else p - s - 1, m * v)
        order = fwd[:warmup]
        for f, b in zip(fwd[warmup:], bwd):
            order += [f, b]
        out.append(order + bwd[len(fwd) - warmup:])
    return out


def _ready(table: Table, op: Op, stage: int, done: dict) -> bool:
    """Whether what `op` depends on finished at an earlier tick (done: key -> tick)."""
    vs = table.virtual_stage(stage, op.chunk)
    if op.kind == Kind.FORWARD:
        return vs == 0 or ("F", op.microbatch, vs - 1) in done
    if ("F", op.microbatch, vs) not in done:
        return False
    return vs == table.virtual_stages - 1 or ("B", op.microbatch, vs + 1) in done


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Table:
    """The schedule table `name` ("gpipe", "1f1b", "interleaved") for p stages, m microbatches
    and v chunks per stage (interleaved only)."""
    if name not in SCHEDULES:
        raise PlanError(f"pipeline schedule {name!r} is not one of {SCHEDULES}")
    chunks = chunks if name == "interleaved" else 1
    orders = _orders(name, stages, microbatches, chunks)
    shape = Table(name, stages, microbatches, chunks, ())
    done: dict = {}
    rows: list[tuple] = []
    while any(orders):
        row = []
        for s, order in enumerate(orders):
            ok = order and _ready(shape, order[0], s, done)
            row.append(order.pop(0) if ok else None)
        for s, op in enumerate(row):
            if op is not None:
                tag = "F" if op.kind == Kind.FORWARD else "B"
                done[(tag, op.microbatch, shape.virtual_stage(s, op.chunk))] = len(rows)
        if not any(row):
            raise AssertionError(f"{name} schedule deadlocked at tick {len(rows)}")
        rows.append(tuple(row))
    return dataclasses.replace(shape, ticks=tuple(rows))
