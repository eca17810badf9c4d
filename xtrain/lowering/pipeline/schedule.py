"""Pipeline schedules as explicit tables: at each tick, what each pipeline stage does.

A table has one row per tick and one entry per stage (device along the `pipe` axis): the
forward (F) or backward of one microbatch (of one virtual chunk, for the interleaved schedule),
or nothing. The zero-bubble schedule splits the backward in two: B, the input gradient (what
the previous stage waits for), and W, the weight gradient (which nothing waits for, so it can
fill the ticks where a stage would idle); the other schedules run B and W as one backward.

Durations: F = B = W = 1 (a backward's two matmuls per forward matmul, one each), so a
combined backward lasts 2. A table's bubble is the idle share of stage-time when each entry
starts as soon as its stage and its inputs are ready (`Table.time`): GPipe's and 1F1B's is
(p - 1) / (m + p - 1). Tables are built by running each stage's order of work greedily: a
stage does its next action as soon as what it depends on finished at an earlier tick (the
forward on the previous virtual stage, the backward on the next).

    GPipe        all forwards, then all backwards (reverse order, as autodiff gives)
    1F1B         min(p - s - 1, m) warm-up forwards at stage s, then one forward / one
                 backward alternately, then the remaining backwards: p - s microbatches held
    interleaved  v chunks per stage, virtual stage c * p + s on stage s; warm-up
                 (p - s - 1) * 2 + (v - 1) * p; needs m divisible by p
    zbh1         zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, its
                 H1 schedule's idea): a stage does a ready B first, else its next F while it
                 holds fewer than min(p - s, ...) microbatches before their B (1F1B's limit) and
                 at most p + 1 in all (one more than 1F1B's first stage), else a pending W. The
                 W's move into the cool-down, where 1F1B idles: for m >= p the table is
                 3m + p - 1 ticks against 1F1B's 3(m + p - 1) units of time
    zbv          zero bubble over two chunks per stage laid out as a V (the ZB-V idea of Qi et
                 al., "Pipeline Parallelism with Controllable Memory", 2024): stage s holds
                 virtual stages s and 2p - 1 - s, so a microbatch goes down the stages and back
                 up, turning at the last stage without a send, and the loss is on the first.
                 Greedy per tick: a ready B, else an F while the stage holds fewer than 2p chunk
                 activations (1F1B's first-stage peak), else a W. Its ops are half a stage's
                 work, so its warm-up and cool-down are half as long: bubble 5.9% at p = 4,
                 m = 8 against zbh1's 11.1% and 1F1B's 27.3%, holding less than zbh1
"""
from __future__ import annotations

import dataclasses
import enum

from xtrain.errors import PlanError
from xtrain.sharding.pipeline import SCHEDULES


class Kind(enum.IntEnum):
    IDLE = 0
    FORWARD = 1
    BACKWARD = 2   # the whole backward, or B (the input gradient) in a zero-bubble table
    WEIGHT = 3     # W: the weight gradient of a zero-bubble table


ZERO_BUBBLE = ("zbh1", "zbv")  # schedules whose backward is split into B and W
V_SHAPED = ("zbv",)  # two chunks per stage laid out as a V: stage s holds virtual stages s and 2p - 1 - s
_TAGS = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.WEIGHT: "W"}


@dataclasses.dataclass(frozen=True)
class Op:
    """The forward or backward of `microbatch` through chunk `chunk` of a stage."""

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{_TAGS[self.kind]}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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
        if self.name in V_SHAPED:
            return stage if chunk == 0 else 2 * self.stages - 1 - stage
        return chunk * self.stages + stage

    def place(self, vs: int) -> tuple[int, int]:
        """(stage, chunk) of virtual stage `vs`."""
        return place(self.name, self.stages, vs)

    def holds(self, stage, chunk, vs: int):
        """Whether (stage, chunk) (traced or not) runs virtual stage `vs` (the first: the prologue;
        the last: the loss)."""
        s, c = self.place(vs)
        return (stage == s) & (chunk == c)

    @property
    def split_backward(self) -> bool:
        """Whether the backward runs as B and W (a zero-bubble table)."""
        return self.name in ZERO_BUBBLE

    def duration(self, op: Op | None) -> int:
        """Units of time of one entry: F = B = W = 1, a combined backward 2, idle 0."""
        if op is None:
            return 0
        return 2 if op.kind == Kind.BACKWARD and not self.split_backward else 1

    def time(self) -> int:
        """Units of time from the first entry's start to the last one's end, each entry starting
        as soon as its stage is free and what it depends on has finished (the table's order
        per stage kept): the schedule's own length, as a pipeline without lockstep runs it."""
        free, end = [0] * self.stages, {}
        for row in self.ticks:
            for s, op in enumerate(row):
                if op is None:
                    continue
                vs = self.virtual_stage(s, op.chunk)
                after = [free[s]]
                if op.kind == Kind.FORWARD and vs:
                    after.append(end[(Kind.FORWARD, op.microbatch, vs - 1)])
                if op.kind == Kind.BACKWARD and vs < self.virtual_stages - 1:
                    after.append(end[(Kind.BACKWARD, op.microbatch, vs + 1)])
                free[s] = end[(op.kind, op.microbatch, vs)] = max(after) + self.duration(op)
        return max(free)

    def bubble(self) -> float:
        """Idle share of stage-time over `time()` (durations: `duration`). The lockstep
        executors run a tick as long as its longest entry and, for 1F1B and interleaved, a
        whole vjp on every tick: what that costs is in the step's program, not here."""
        busy = sum(self.duration(op) for row in self.ticks for op in row)
        return 1 - busy / (self.time() * self.stages)

    def held(self, stage: int) -> int:
        """Peak number of (microbatch, chunk) activations stage `stage` holds: forward done,
        backward (W, in a zero-bubble table) not yet."""
        last = Kind.WEIGHT if self.split_backward else Kind.BACKWARD
        live, peak = set(), 0
        for row in self.ticks:
            op = row[stage]
            if op is not None and op.kind == Kind.FORWARD:
                live.add((op.microbatch, op.chunk))
                peak = max(peak, len(live))
            elif op is not None and op.kind == last:
                live.discard((op.microbatch, op.chunk))
        return peak

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.stages} stages x {self.microbatches} microbatches"
                 + (f" x {self.chunks} chunks" if self.chunks > 1 else "")
                 + f", {len(self.ticks)} ticks, bubble {self.bubble():.1%}"]
        for s in range(self.stages):
            lines.append(f"  stage {s}: " + " ".join(f"{str(r[s]) if r[s] else '.':>5}" for r in self.ticks))
        return "\n".join(lines)


def place(name: str, stages: int, vs: int) -> tuple[int, int]:
    """(stage, chunk) of virtual stage `vs` under schedule `name`: chunk c of stage s is virtual
    stage c * p + s (interleaved), or the V of zbv (s, then 2p - 1 - s: the last virtual stage is on
    the first stage, and the activations turn at the last stage without leaving it)."""
    if name in V_SHAPED:
        return (vs, 0) if vs < stages else (2 * stages - 1 - vs, 1)
    chunk, stage = divmod(vs, stages)
    return stage, chunk


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


def _zero_bubble_op(p: int, m: int, s: int, count: dict, done: dict, t: int) -> Op | None:
    """What stage s does at tick t of the zbh1 table (module docstring): count holds
    (kind, stage, chunk 0) -> how many it did, done (tag, microbatch, stage) -> tick."""
    f, b, w = (count[(k, s, 0)] for k in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT))
    earlier = lambda key: done.get(key, t) < t
    if b < f and earlier(("F", b, s)) and (s == p - 1 or earlier(("B", b, s + 1))):
        return Op(Kind.BACKWARD, b)
    if f < m and (s == 0 or earlier(("F", f, s - 1))) and f - b < p - s and f - w < p + 1:
        return Op(Kind.FORWARD, f)
    if w < b and earlier(("B", w, s)):
        return Op(Kind.WEIGHT, w)
    return None


def _zbv_op(table: Table, s: int, count: dict, done: dict, t: int) -> Op | None:
    """What stage s does at tick t of the zbv table: a ready B (chunk 0's first: it ends a
    microbatch's backward), else a ready F while the stage holds fewer than 2p chunk activations
    (1F1B's peak at its first stage: p microbatches of a whole stage), chunk 1's first (it moves a
    microbatch towards the loss), else a pending W. count holds (kind, stage, chunk) -> how many
    it did, done (tag, microbatch, virtual stage) -> tick."""
    p, m = table.stages, table.microbatches
    earlier = lambda key: done.get(key, t) < t

    def ready(kind: Kind, c: int) -> Op | None:
        i, vs = count[(kind, s, c)], table.virtual_stage(s, c)
        if kind == Kind.FORWARD:
            ok = i < m and (vs == 0 or earlier(("F", i, vs - 1)))
        elif kind == Kind.BACKWARD:
            ok = i < count[(Kind.FORWARD, s, c)] and earlier(("F", i, vs)) and \
                (vs == 2 * p - 1 or earlier(("B", i, vs + 1)))
        else:
            ok = i < count[(Kind.BACKWARD, s, c)] and earlier(("B", i, vs))
        return Op(kind, i, c) if ok else None

    held = sum(count[(Kind.FORWARD, s, c)] - count[(Kind.WEIGHT, s, c)] for c in (0, 1))
    wanted = [(Kind.BACKWARD, 0), (Kind.BACKWARD, 1)] + ([(Kind.FORWARD, 1), (Kind.FORWARD, 0)] if held < 2 * p else [])
    for kind, c in wanted + [(Kind.WEIGHT, 0), (Kind.WEIGHT, 1)]:
        op = ready(kind, c)
        if op is not None:
            return op
    return None


def _zero_bubble(name: str, p: int, m: int) -> Table:
    chunks = 2 if name in V_SHAPED else 1
    shape = Table(name, p, m, chunks, ())
    count = {(k, s, c): 0 for k in Kind for s in range(p) for c in range(chunks)}
    done: dict = {}
    rows: list[tuple] = []
    while any(count[(Kind.WEIGHT, s, c)] < m for s in range(p) for c in range(chunks)):
        t = len(rows)
        row = tuple(_zero_bubble_op(p, m, s, count, done, t) if chunks == 1 else _zbv_op(shape, s, count, done, t)
                    for s in range(p))
        if not any(row):
            raise AssertionError(f"{name} schedule deadlocked at tick {t}")
        for s, op in enumerate(row):
            if op is not None:
                count[(op.kind, s, op.chunk)] += 1
                done[(_TAGS[op.kind], op.microbatch, shape.virtual_stage(s, op.chunk))] = t
        rows.append(row)
    return dataclasses.replace(shape, ticks=tuple(rows))


def build(name: str, stages: int, microbatches: int, chunks: int = 1) -> Table:
    """The schedule table `name` ("gpipe", "1f1b", "interleaved", "zbh1", "zbv") for p stages, m
    microbatches and v chunks per stage (interleaved only; zbv has 2)."""
    if name not in SCHEDULES:
        raise PlanError(f"pipeline schedule {name!r} is not one of {SCHEDULES}")
    if name in ZERO_BUBBLE:
        return _zero_bubble(name, stages, microbatches)
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
                done[(_TAGS[op.kind], op.microbatch, shape.virtual_stage(s, op.chunk))] = len(rows)
        if not any(row):
            raise AssertionError(f"{name} schedule deadlocked at tick {len(rows)}")
        rows.append(tuple(row))
    return dataclasses.replace(shape, ticks=tuple(rows))
