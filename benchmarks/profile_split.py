"""Where a compiled xtrain step spends its time on CPU: matmuls, other compute, collectives and
data movement (copies, zero-fills, the layer scan's stacked-buffer writes and slices).

    python benchmarks/profile_split.py --layers 12            # the example GPT, 1 process
    (bench_xtrain.py --profile-split does the same inside a benchmark run, per configuration)

A few steps are traced with jax.profiler; XLA:CPU records one event per executed thunk, named
by its HLO instruction. The instruction's opcode in the step's optimized HLO (a fusion by the
ops it fuses) gives its class; loops and calls are containers (their bodies' thunks are counted
instead). Times are per step, summed over the process's XLA threads.
"""
from __future__ import annotations

import glob
import re
import shutil
import tempfile

COLLECTIVE = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
MOVES = ("copy", "dynamic-update-slice", "dynamic-slice", "broadcast", "slice", "concatenate", "transpose", "pad",
         "gather", "scatter", "bitcast", "reshape", "iota")
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")
CLASSES = ("matmul", "other compute", "collectives", "data movement")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][\w\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def _computations(hlo: str) -> dict[str, list[tuple[str, str, str]]]:
    """computation name -> its instructions (name, opcode, rest of the line)."""
    out: dict[str, list] = {}
    current = None
    for line in hlo.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0]:
            current = out.setdefault(head.group(1), [])
            continue
        found = _INSTRUCTION.match(line)
        if found and current is not None:
            current.append(found.groups())
    return out


def _opcodes(computations: dict, name: str, seen=()) -> set[str]:
    """Every opcode inside computation `name`, following fusions' called computations."""
    ops = set()
    for _, op, rest in computations.get(name, ()):
        ops.add(op)
        if op == "fusion" and name not in seen:
            for called in _CALLS.findall(rest):
                ops |= _opcodes(computations, called, seen + (name,))
    return ops


def classify(op: str, inner: set[str]) -> str:
    """The class of an instruction with opcode `op` (`inner`: the opcodes a fusion fuses);
    "container" for loops and calls, whose bodies' thunks are counted instead."""
    if op in CONTAINERS:
        return "container"
    ops = inner if op == "fusion" else {op}
    base = {o.removesuffix("-start").removesuffix("-done") for o in ops}
    if base & set(COLLECTIVE):
        return "collectives"
    if base & {"dot", "convolution"} or (op == "custom-call" and "matmul" in str(inner)):
        return "matmul"
    if base - {"parameter", "constant", "get-tuple-element", "tuple"} <= set(MOVES):
        return "data movement"
    return "other compute"


def instruction_classes(hlo: str) -> dict[str, str]:
    """HLO instruction name -> class, for every instruction of the module."""
    computations = _computations(hlo)
    out = {}
    for instructions in computations.values():
        for name, op, rest in instructions:
            inner = set()
            if op == "fusion":
                for called in _CALLS.findall(rest):
                    inner |= _opcodes(computations, called)
            out[name] = classify(op, inner | ({"matmul"} if "matmul" in rest else set()))
    return out


def split(run_steps, hlo: str, steps: int = 3) -> dict[str, float]:
    """Milliseconds per step in each class (plus "unattributed": thunks not in the HLO) while
    `run_steps(steps)` runs `steps` steps to completion."""
    import jax
    from jax.profiler import ProfileData

    classes = instruction_classes(hlo)
    where = tempfile.mkdtemp(prefix="xtrain_profile_")
    try:
        jax.profiler.start_trace(where)
        run_steps(steps)
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{where}/**/*.xplane.pb", recursive=True)[0])
    finally:
        shutil.rmtree(where, ignore_errors=True)
    totals = dict.fromkeys(CLASSES + ("unattributed",), 0.0)
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            for event in line.events:
                name = event.name
                if name.startswith(("ThreadpoolListener", "ThunkExecutor", "end: ")):
                    continue
                kind = classes.get(name, "unattributed")
                if kind != "container":  # its body's thunks are counted
                    totals[kind] += event.duration_ns / 1e6 / steps
    return totals


def main() -> None:
    import bench_common

    bench_common.pin_to_core()
    import torch
    import xtrain

    args = bench_common.parse_args()
    xtrain.init(cpu_devices=1)
    model = bench_common.build_model(args)
    step = xtrain.compile(model, xtrain.Mesh(data=-1), optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr))
    batches = bench_common.batches(args)
    for x, y in batches[:2]:
        float(step(x, y)["loss"])
    hlo = step.compiled(*batches[0]).as_text()

    def run(n):
        for x, y in batches[2:2 + n]:
            float(step(x, y)["loss"])

    parts = split(run, hlo, min(3, len(batches) - 2))
    total = sum(parts.values())
    for name, ms in parts.items():
        print(f"{name:15s} {ms:8.1f} ms/step  {ms / total:6.1%}")


if __name__ == "__main__":
    main()
