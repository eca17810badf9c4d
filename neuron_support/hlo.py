"""A small reader of XLA's HLO text: computations, instructions, and where each op came from.

Enough for conformance rules: opcode, result dtypes, operands, attributes as text, the
op_name metadata (the jaxpr path, with the torch op for torchax-traced models) and the
user's file:line from the module's stack-frame table.
"""
from __future__ import annotations

import dataclasses
import re

_DTYPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+|token)\[")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")


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

    @property
    def dtypes(self) -> set[str]:
        return set(_DTYPE.findall(self.shape))

    @property
    def operands(self) -> list[str]:
        head = self.args.split(")", 1)[0]
        return re.findall(r"%([\w.\-]+)", head)

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
        for ins in self.computations.get(computation, ()):
            if ins.name == name:
                return ins.shape
        return ""

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
    match = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", line)
    if not match:
        return None
    shape, tail = _split_shape(match.group(2))
    op = re.match(r"([a-z][\w\-]*)\((.*)$", tail)
    if not op:
        return None
    op_name = re.search(r'op_name="([^"]*)"', line)
    frame = re.search(r"stack_frame_id=(\d+)", line)
    return Instruction(match.group(1), shape, op.group(1), op.group(2), computation,
                       op_name.group(1) if op_name else "",
                       frames.get(int(frame.group(1)), "") if frame else "")


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
