"""A small reader of XLA's HLO text: computations, instructions, and where each op came from.

Enough for conformance rules: opcode, result dtypes, operands, attributes as text, the
op_name metadata (the jaxpr path, with the torch op for torchax-traced models), the user's
file:line from the module's stack-frame table, and how often a loop runs. It reads both the
optimized HLO of a compiled program (`Compiled.as_text()`) and the HLO of a program lowered
for another platform before XLA's passes (`Lowered.as_text(dialect="hlo")`), whose headers
carry no signatures and whose loops carry no trip-count annotation.
"""
from __future__ import annotations

import dataclasses
import re

_DTYPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+|token)\[")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)(?:\s+\(.*\)\s*->\s*.*)?\s*\{\s*$")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction."""

    name: str                 # "%all-reduce.3" without the %
    shape: str                # result shape text, e.g. "f32[4]{0}" or "(f32[], s32[])"
    opcode: str               # "all-reduce", "dot", ...
    args: str                 # the text after "opcode(": operands, then attributes
    computation: str          # the computation it belongs to
    op_name: str              # metadata op_name ("jit(train_step)/.../aten::mm/dot_general")
    location: str             # user's "file:line (function)", when the module records it
    root: bool = False        # the computation's ROOT (its result)

    @property
    def dtypes(self) -> set[str]:
        return set(_DTYPE.findall(self.shape))

    @property
    def operands(self) -> list[str]:
        """Operand names, written `%name` (compiled HLO, maybe after a shape) or `name` (lowered)."""
        # compiled HLO numbers long operand lists with comments (`/*index=5*/%bitcast.7`): without
        # them, every fifth operand of a combined collective would be lost
        head = re.sub(r"/\*.*?\*/", " ", self.args.split(")", 1)[0])
        names = [part.split()[-1].lstrip("%") for part in head.split(",") if part.strip()]
        return [n for n in names if re.fullmatch(r"[A-Za-z_][\w.\-]*", n)]

    def attribute(self, key: str) -> str | None:
        match = re.search(rf'\b{re.escape(key)}=(?:"([^"]*)"|%?([\w.\-]+))', self.args)
        return (match.group(1) if match.group(1) is not None else match.group(2)) if match else None


@dataclasses.dataclass
class Module:
    """An HLO module's computations and the device count its collectives refer to."""

    computations: dict[str, list[Instruction]]
    num_devices: int
    entry: str
    device_ids: list[int] | None = None   # physical id of each logical device id (None: the same)

    def physical(self, logical: list[int]) -> list[int]:
        return list(logical) if self.device_ids is None else [self.device_ids[i] for i in logical]

    def instructions(self):
        for body in self.computations.values():
            yield from body

    def shape_of(self, computation: str, name: str) -> str:
        found = self.find(computation, name)
        return found.shape if found else ""

    def find(self, computation: str, name: str) -> Instruction | None:
        for ins in self.computations.get(computation, ()):
            if ins.name == name:
                return ins
        return None

    def root(self, computation: str) -> Instruction | None:
        body = self.computations.get(computation, [])
        return next((ins for ins in body if ins.root), body[-1] if body else None)

    def called(self, computation: str) -> set[str]:
        """`computation` and every computation it calls (fusions, reducers, branches)."""
        seen, todo = set(), [computation]
        while todo:
            name = todo.pop()
            if name in seen or name not in self.computations:
                continue
            seen.add(name)
            for ins in self.computations[name]:
                todo += re.findall(r"(?:calls|to_apply|condition|body)=%([\w.\-]+)", ins.args)
        return seen


def _split_shape(rest: str) -> tuple[str, str]:
    """'(f32[], s32[]) reduce(...' -> ('(f32[], s32[])', 'reduce(...')."""
    if not rest.startswith("("):
        shape, _, tail = rest.partition(" ")
        return shape, tail
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i + 1], rest[i + 1:].lstrip()
    return rest, ""


def _stack_frames(text: str) -> dict[int, str]:
    """stack_frame_id -> "file:line (function)" from the FileNames/.../StackFrames tables."""
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
        elif current is not None and re.match(r"^\d+ ", line):
            key, _, value = line.partition(" ")
            current[int(key)] = value.strip().strip('"')
        elif line and not line[0].isdigit():
            current = None
    files, funcs, locs = (tables.get(k, {}) for k in ("FileNames", "FunctionNames", "FileLocations"))
    out = {}
    for frame, value in tables.get("StackFrames", {}).items():
        loc = locs.get(int(re.search(r"file_location_id=(\d+)", value).group(1)), "")
        fields = dict(re.findall(r"(\w+)=(\d+)", loc))
        if fields:
            out[frame] = (f"{files.get(int(fields['file_name_id']), '?')}:{fields['line']} "
                          f"({funcs.get(int(fields['function_name_id']), '?')})")
    return out


def _instruction(line: str, computation: str, frames: dict[int, str]) -> Instruction | None:
    match = re.match(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
    if not match:
        return None
    shape, tail = _split_shape(match.group(3))
    op = re.match(r"([a-z][\w\-]*)\((.*)$", tail)
    if not op:
        return None
    op_name = re.search(r'op_name="([^"]*)"', line)
    frame = re.search(r"stack_frame_id=(\d+)", line)
    return Instruction(match.group(2), shape, op.group(1), op.group(2), computation,
                       op_name.group(1) if op_name else "",
                       frames.get(int(frame.group(1)), "") if frame else "", root=bool(match.group(1)))


def parse(text: str) -> Module:
    """Reads `Compiled.as_text()` (or any HLO module text)."""
    frames = _stack_frames(text)
    computations: dict[str, list[Instruction]] = {}
    current, entry = None, ""
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group("name")
            computations[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            ins = _instruction(line, current, frames)
            if ins:
                computations[current].append(ins)
    partitions = re.search(r"num_partitions=(\d+)", text)
    replicas = re.search(r"replica_count=(\d+)", text)
    devices = int(partitions.group(1) if partitions else 1) * int(replicas.group(1) if replicas else 1)
    return Module(computations, devices, entry)


# -- loops ----------------------------------------------------------------------------------------
def constant_value(ins: Instruction | None) -> int | None:
    """The value of an integer scalar `constant` instruction, else None."""
    if ins is None or ins.opcode != "constant":
        return None
    match = re.match(r"\s*(-?\d+)\)", ins.args)
    return int(match.group(1)) if match else None


def _counter(module: Module, loop: Instruction) -> tuple[int, int] | None:
    """(tuple index, bound) of a condition `get-tuple-element(param, index=k) < constant`."""
    root = module.root(loop.attribute("condition") or "")
    if root is None or root.opcode != "compare" or root.attribute("direction") != "LT":
        return None
    counter, bound = (module.find(root.computation, n) for n in root.operands[:2])
    if counter is None or counter.opcode != "get-tuple-element":
        return None
    limit = constant_value(bound)
    return None if limit is None else (int(counter.attribute("index")), limit)


def _steps_by_one(module: Module, loop: Instruction, index: int) -> bool:
    """Whether the loop body's result k is its parameter's element k plus the constant 1."""
    body = loop.attribute("body") or ""
    root = module.root(body)
    if root is None or root.opcode != "tuple" or len(root.operands) <= index:
        return False
    step = module.find(body, root.operands[index])
    if step is None or step.opcode != "add":
        return False
    parts = [module.find(body, n) for n in step.operands[:2]]
    ones = [p for p in parts if constant_value(p) == 1]
    counters = [p for p in parts if p is not None and p.opcode == "get-tuple-element" and p.attribute("index") == str(index)]
    return len(ones) == 1 and len(counters) == 1


def static_trip_count(module: Module, loop: Instruction) -> int | None:
    """Iterations of a `while` instruction when they are fixed, else None: XLA's known_trip_count
    annotation (optimized HLO), or a counter that starts at a constant, steps by one and is
    compared `<` with a constant (what JAX's scan and fori_loop emit, as lowered)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', loop.args)
    if known:
        return int(known.group(1))
    counter = _counter(module, loop)
    init = module.find(loop.computation, loop.operands[0]) if loop.operands else None
    if counter is None or init is None or init.opcode != "tuple" or len(init.operands) <= counter[0]:
        return None
    start = constant_value(module.find(loop.computation, init.operands[counter[0]]))
    if start is None or not _steps_by_one(module, loop, counter[0]):
        return None
    return max(0, counter[1] - start)
