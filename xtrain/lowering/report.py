"""What a compiled step communicates and how much memory it needs.

For the XLA-partitioner lowering the collectives are read from XLA's optimized HLO (XLA
chose them; the CPU backend may have merged several into one).
"""
from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from xtrain.ir import hlo

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_LINE = re.compile(r"=\s*(?P<shape>\(?[^=]*?\)?)\s+(?P<kind>" + "|".join(_KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the compiled step."""

    kind: str                 # all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all
    axes: tuple[str, ...]     # mesh axes its groups span
    payload_bytes: int        # per device per step (the full, unsplit buffer)
    source: str               # jaxpr op / module path it serves, as far as known

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends with a ring algorithm over a group of n devices."""
        n = self.group_size
        if n <= 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
                  "reduce-scatter": (n - 1) / n, "all-to-all": (n - 1) / n}.get(self.kind, 1.0)
        return factor * self.payload_bytes

    group_size: int = 1
    # matmul FLOPs (per device) of the compute in its program region that neither feeds nor
    # consumes it: what a scheduler can hide it behind (explicit lowering; None for XLA's HLO)
    overlap_flops: float | None = None
    # the primitive without a partition rule this gather serves (Plan(fallback="replicate")), else ""
    fallback: str = ""


def _bytes_of(shape_text: str) -> int:
    return sum(_DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dt, dims in _ARRAY.findall(shape_text))


def _axes_of_group(group: list[int], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    coords = np.array([np.unravel_index(i, tuple(mesh_shape.values())) for i in group])
    return tuple(name for k, name in enumerate(mesh_shape) if len(set(coords[:, k])) > 1)


def _clipped(source: str, width: int = 72) -> str:
    """A source for the table's last column: its start (the module path or scope) kept whole."""
    return source if len(source) <= width else source[:width - 3] + "..."


def collectives_from_hlo(hlo_text: str, mesh_shape: dict[str, int]) -> list[Collective]:
    """Every collective in an HLO module's text, with the mesh axes it runs over."""
    found = []
    for line in hlo_text.splitlines():
        line = _COMMENT.sub("", line)  # tuple shapes carry `/*index=5*/` markers
        match = _LINE.search(line)
        if not match or "-done" in line.split("=")[0]:
            continue
        kind = match.group("kind")
        groups = hlo.replica_groups(line)
        size = len(groups[0]) if groups and kind != "collective-permute" else 2
        payload = _bytes_of(match.group("shape"))
        if kind == "reduce-scatter":
            payload *= size
        op_name = re.search(r'op_name="([^"]*)"', line)
        axes = _axes_of_group(groups[0], mesh_shape) if groups else ()
        found.append(Collective(kind, axes, payload, op_name.group(1) if op_name else "", size))
    return found


@dataclasses.dataclass(frozen=True)
class Report:
    """Per-step communication and per-device memory of a compiled training step."""

    lowering: str
    mesh: dict[str, int]
    collectives: list[Collective]
    memory: dict[str, int]
    notes: list[str] = dataclasses.field(default_factory=list)
    state_memory: dict[str, int] = dataclasses.field(default_factory=dict)  # parameters, gradients, optimizer
    plan_notes: list[str] = dataclasses.field(default_factory=list)         # the preset's choices
    largest_replicated: list[tuple[str, tuple[int, ...]]] = dataclasses.field(default_factory=list)

    def bytes_per_axis(self) -> dict[str, float]:
        totals: dict[str, float] = {}
        for c in self.collectives:
            key = "x".join(c.axes) or "-"
            totals[key] = totals.get(key, 0.0) + c.wire_bytes
        return totals

    def __str__(self) -> str:
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [f"xtrain step report ({self.lowering} lowering, mesh {mesh})",
                 f"{'collective':<20}{'axes':<14}{'payload B':>12}{'wire B':>12}{'overlap MFLOP':>15}  source"]
        for c in self.collectives:
            overlap = "-" if c.overlap_flops is None else f"{c.overlap_flops / 1e6:.1f}"
            lines.append(f"{c.kind:<20}{'x'.join(c.axes) or '-':<14}{c.payload_bytes:>12}"
                         f"{c.wire_bytes:>12.0f}{overlap:>15}  "
                         + _clipped((f"FALLBACK {c.fallback}: " if c.fallback else "") + c.source))
        fallback = sum(c.wire_bytes for c in self.collectives if c.fallback)
        if fallback:
            lines.append(f"wire bytes of replicated fallbacks (ops without a partition rule): {fallback:.0f}")
        lines.append("wire bytes per axis: " + ", ".join(f"{k}: {v:.0f}" for k, v in self.bytes_per_axis().items()))
        lines.append("memory per device (bytes): " + ", ".join(f"{k}={v}" for k, v in self.memory.items()))
        if self.state_memory:
            lines.append("training state per device (bytes): "
                         + ", ".join(f"{k}={v}" for k, v in self.state_memory.items()))
        if self.largest_replicated:
            lines.append("largest tensors whole on every device: "
                         + ", ".join(f"{n} {tuple(s)}" for n, s in self.largest_replicated))
        lines += [f"plan: {n}" for n in self.plan_notes]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def memory_of(compiled) -> dict[str, int]:
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    out = {"arguments": stats.argument_size_in_bytes, "outputs": stats.output_size_in_bytes,
           "temporaries": stats.temp_size_in_bytes, "aliased": stats.alias_size_in_bytes}
    # host memory apart where XLA tells it apart (GPU); XLA:CPU counts pinned_host buffers as device bytes
    host = {f"host_{k}": getattr(stats, f"host_{v}_size_in_bytes", 0)
            for k, v in (("arguments", "argument"), ("outputs", "output"), ("temporaries", "temp"))}
    return {**out, **{k: v for k, v in host.items() if v}}


def _shard_bytes(x, sharding=None) -> int:
    sharding = sharding or getattr(x, "sharding", None)
    shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def state_memory(state, grad_shardings: dict) -> dict[str, int]:
    """Bytes per device of the parameters (trained and frozen), of the gradients the update
    consumes (sharded like `grad_shardings`: the parameters', or ZeRO-2's optimizer shards),
    of the optimizer state (in device memory, and in host memory as `optimizer_host` under
    Plan(offload="optimizer")) and of int8's error-feedback residuals, from the shardings of
    the placed TrainState."""
    import jax

    params = {**state.params, **state.frozen}
    optimizer = [v for v in jax.tree.leaves(state.opt_state) if hasattr(v, "shape")]
    on_host = lambda v: getattr(getattr(v, "sharding", None), "memory_kind", None) == "pinned_host"
    out = {"parameters": sum(_shard_bytes(v) for v in params.values()),
           "gradients": sum(_shard_bytes(v, grad_shardings.get(n)) for n, v in state.params.items()),
           "optimizer": sum(_shard_bytes(v) for v in optimizer if not on_host(v))}
    if any(on_host(v) for v in optimizer):  # Plan(offload="optimizer")
        out["optimizer_host"] = sum(_shard_bytes(v) for v in optimizer if on_host(v))
    if state.grad_residual is not None:  # GradSync(comm_dtype="int8")'s error feedback
        out["grad_residual"] = sum(_shard_bytes(v) for v in state.grad_residual.values())
    return out
