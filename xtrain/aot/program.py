"""`TargetProgram`: a training step compiled by XLA's GPU compiler for a cluster that is not here.

Memory per device comes from XLA's buffer assignment of the compiled program, the collectives
and their overlap from its schedule (xtrain.aot.schedule), FLOPs from xtrain's own count of the
per-device program (a deviceless compile has no cost analysis). `report()` is the Report
`step.report()` gives: the collectives xtrain emitted (what the cost model and the plan search
count), with the compiled program's memory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from xtrain.aot import schedule
from xtrain.aot.request import Prepared
from xtrain.aot.schedule import ScheduledCollective
from xtrain.cost import program as cost_program
from xtrain.ir.analysis import flops as flops_mod
from xtrain.lowering import accounting
from xtrain.lowering import report as report_mod
from xtrain.lowering.state import named
from xtrain.sharding import presets

ATTENTION_NOTE = ("attention is traced with xtrain's blockwise kernel: cuDNN fused attention is not built by a "
                  "deviceless compile in jaxlib 0.10.2 (no GPU to size its workspace; it would fail at run time)")
AUTOTUNE_NOTE = ("no GPU, no autotuning: XLA makes every GEMM a Triton fusion with default tiles, so temporaries "
                 "differ from an on-GPU compile by some percent; compare deviceless programs with each other")


@dataclasses.dataclass(frozen=True)
class Memory:
    """Bytes per device of the compiled program (XLA's buffer assignment).

    Attributes:
        arguments, outputs: the step's inputs (state, batch) and results.
        aliased: outputs written into donated inputs (counted once in `total`).
        temporaries: activations, gradients and scratch live during the step.
        total: arguments + outputs - aliased + temporaries: the device memory the step needs.
        capacity: one GPU's memory (the target config's device_memory_size).
        host: bytes the step keeps in host memory (offloaded state and activations).
    """

    arguments: int
    outputs: int
    aliased: int
    temporaries: int
    capacity: int
    host: int = 0

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries

    @property
    def fits(self) -> bool:
        """Whether the step's device memory is within one GPU's capacity. (JAX's allocator takes 75%
        of the GPU by default: XLA_PYTHON_CLIENT_MEM_FRACTION raises it.)"""
        return self.total <= self.capacity

    def as_report(self) -> dict[str, int]:
        """The keys `step.report().memory` uses."""
        out = {"arguments": self.arguments, "outputs": self.outputs, "temporaries": self.temporaries,
               "aliased": self.aliased}
        return {**out, **({"host": self.host} if self.host else {})}


@dataclasses.dataclass(frozen=True)
class TargetProgram:
    """A step compiled for a GPU target (xtrain.aot.compile).

    Attributes:
        target: the target as given ('p5.48xlarge:2').
        mesh: the mesh's axis sizes on the target's devices.
        memory: per device (Memory).
        collectives: the compiled program's collectives in schedule order (ScheduledCollective:
            kind, axes, bytes per step, overlap_flops, ...).
        flops: FLOPs per device per step (xtrain.ir.analysis.flops of the per-device program).
        matmul_flops: the dot and convolution part of `flops`.
        text: the scheduled per-device HLO.
        executable: the serialized executable (jax.experimental.serialize_executable).
        sha256: the executable's hash.
        compile_s: XLA's compile time in the child.
        manifest: what `save` writes beside the executable (target, plan, flags, versions, hash).
        notes: how this program differs from one compiled on the GPUs.
    """

    target: str
    mesh: dict[str, int]
    memory: Memory
    collectives: list[ScheduledCollective]
    flops: float
    matmul_flops: float
    text: str
    executable: bytes
    sha256: str
    compile_s: float
    manifest: dict
    notes: list[str]
    prepared: Prepared = dataclasses.field(repr=False, compare=False)

    def report(self) -> report_mod.Report:
        """The step's Report (the type `step.report()` returns): the collectives xtrain emitted,
        counted as step.report() counts them, and this compiled program's memory."""
        built, sizes = self.prepared.built, self.mesh
        emitted = accounting.collectives(self.prepared.jaxpr, sizes, built.model.module_paths())
        state = built.placed_state
        shapes = {n: tuple(v.shape) for n, v in {**state.params, **state.frozen}.items()}
        return report_mod.Report(
            self.prepared.options.lowering, dict(sizes), emitted, self.memory.as_report(),
            [f"compiled for {self.target} ({self.prepared.target.device_kind}) without its GPUs", *self.notes,
             *built.program.notes()],
            report_mod.state_memory(state, named(built.mesh, built.layout.grad_specs)), list(built.plan.notes),
            presets.largest_replicated(built.layout.param_specs, shapes))

    def overlapped_share(self, kinds: tuple[str, ...], axes: tuple[str, ...] | None = None) -> float:
        """The share of the bytes of `kinds` (over `axes`, if given) whose start and done have at
        least one GEMM between them in the schedule (1.0 when there are none)."""
        chosen = [c for c in self.collectives if c.kind in kinds and (axes is None or c.axes == axes)]
        total = sum(c.bytes for c in chosen)
        return sum(c.bytes for c in chosen if c.gemms) / total if total else 1.0

    def save(self, path: str | os.PathLike) -> Path:
        """Writes `executable.bin` (loadable with jax.experimental.serialize_executable on the
        target's GPUs) and `manifest.json` (target, plan, flags, jaxlib and ptxas versions, the
        executable's sha256) into the directory `path`; returns it."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "executable.bin").write_bytes(self.executable)
        (path / "manifest.json").write_text(json.dumps(self.manifest, indent=1, sort_keys=True))
        return path


def program_of(prepared: Prepared, result: dict, versions: dict, flags: tuple[str, ...]) -> TargetProgram:
    """The TargetProgram of one child result."""
    m, target = result["memory"], prepared.target
    memory = Memory(m["argument"], m["output"], m["alias"], m["temp"], target.capacity,
                    m["host_argument"] + m["host_output"] + m["host_temp"])
    body = cost_program.per_device_body(prepared.jaxpr) or prepared.jaxpr
    counted = flops_mod.count(body)
    collectives = schedule.Schedule(result["text"], prepared.sizes).collectives()
    digest = hashlib.sha256(result["executable"]).hexdigest()
    manifest = {"target": target.spec, "gpu": target.device_kind, "topology": target.topology,
                "mesh": prepared.sizes, "plan": repr(prepared.built.plan), "flags": list(flags),
                "compiler_options": prepared.job["compiler_options"],
                "versions": versions, "executable_sha256": digest, "executable_bytes": len(result["executable"])}
    return TargetProgram(target.spec, prepared.sizes, memory, collectives, counted.total, counted.matmul,
                         result["text"], result["executable"], digest, result["seconds"], manifest,
                         [ATTENTION_NOTE, AUTOTUNE_NOTE], prepared)


def disagreements(program: TargetProgram, reported: list[report_mod.Collective] | None = None,
                  tolerance: float = 0.01) -> list[str]:
    """Where the compiled program's collectives differ from the report's (`program.report()`'s by
    default), per (kind, mesh axes): bytes per step beyond `tolerance`, more executions than the
    report lists (XLA may combine, never add), or a kind/axes the report does not list. [] when
    they agree."""
    reported = program.report().collectives if reported is None else reported
    want: dict = {}
    for c in reported:
        b, n = want.get((c.kind, c.axes), (0, 0))
        want[(c.kind, c.axes)] = (b + c.payload_bytes, n + 1)
    got = schedule.totals(program.collectives)
    problems = []
    for key in sorted(set(want) | set(got)):
        (wb, wn), (gb, gn) = want.get(key, (0, 0)), got.get(key, (0, 0))
        label = f"{key[0]} over {'x'.join(key[1]) or 'no axis'}"
        if key not in want:
            problems.append(f"{label}: {gb} B in {gn} collectives compiled, none in the report")
        elif abs(gb - wb) > tolerance * wb:
            problems.append(f"{label}: {gb} B per step compiled vs {wb} B reported")
        elif gn > wn:
            problems.append(f"{label}: {gn} collectives compiled vs {wn} reported")
    return problems
