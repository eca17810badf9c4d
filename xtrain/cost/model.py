"""Predicted step time and memory of a lowered training step on a hardware profile.

    step = compute + exposed communication + offload

compute        matmul FLOPs / peak(dtype) + (elementwise and reduction traffic + bytes that data
               movement copies: transposes, concatenations, a layer scan's stacked
               activations) / HBM bandwidth
communication  per collective, ring cost on the link its group spans: wire bytes / bandwidth +
               ring steps x latency (tree latency, 2 log2 n, where that is fewer steps);
               a group whose devices sit on one instance uses the intra-node link, else the
               inter-node one (its slowest hop)
offload        host bytes (an offloaded optimizer state: to the device and back; offloaded
               activations: out in the forward pass, back in the backward) x 2 / host-link
               bandwidth, exposed
exposed        tensor-parallel and other collectives inside the forward/backward are on the
               critical path; data-parallel ones (gradient sync, ZeRO gathers) depend only on
               their own layer's tensors, so `profile.overlap` of the compute can hide them
               (not in a pipeline: its gradients are complete only after the last
               microbatch's backward, so their sync waits for all the compute)
bubble         a pipeline's per-device program is lockstep SPMD: every stage runs every tick
               of the schedule, the idle ones on masked data, so the program's FLOPs and
               permutes already hold the bubble ((m + p - 1) ticks each way for GPipe with p
               stages and m microbatches, not m). It is reported, not added again:
               bubble_s = compute x the schedule's idle share ((p - 1) / (m + p - 1) for
               GPipe and 1F1B)
Memory per device comes from XLA's memory analysis when the step was compiled, else from the
graph (`memory_from_graph`: the state's shards plus the peak of live temporaries in device
memory; what a plan offloads is host memory).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

from xtrain.cost import liveness
from xtrain.cost.hardware import HardwareProfile
from xtrain.errors import PlanError, UnsupportedError
from xtrain.ir.analysis import flops as ir_flops
from xtrain.ir.analysis.flops import Flops
from xtrain.lowering.report import Collective
from xtrain.sharding.mesh import CONTEXT, EXPERT

INTRA, INTER = "intra-node", "inter-node"
_RING_STEPS = {"all-reduce": lambda n: 2 * (n - 1), "all-gather": lambda n: n - 1,
               "reduce-scatter": lambda n: n - 1, "all-to-all": lambda n: n - 1,
               "collective-permute": lambda n: 1}
ELEMENT_BYTES = 4  # traffic per elementwise/reduction FLOP (fp32 read-modify-write, fused chains)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Pipeline shape of a plan (stages=1: no pipeline).

    Attributes:
        stages, microbatches: p and m.
        idle: the schedule table's share of idle (tick, stage) slots when known (it is
            smaller than the formula for interleaved schedules); None: (p - 1) / (m + p - 1).
    """

    stages: int = 1
    microbatches: int = 1
    idle: float | None = None

    def __post_init__(self):
        if self.stages < 1 or self.microbatches < 1:
            raise PlanError(f"Pipeline(stages={self.stages}, microbatches={self.microbatches}): both must be >= 1")
        if self.idle is not None and not 0 <= self.idle < 1:
            raise PlanError(f"Pipeline(idle={self.idle}): the idle share must be in [0, 1)")

    @property
    def bubble_fraction(self) -> float:
        """Idle share of a stage's time: the table's, else (p - 1) / (m + p - 1)."""
        if self.idle is not None:
            return self.idle
        return (self.stages - 1) / (self.microbatches + self.stages - 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Memory:
    """Bytes per device of one step."""

    total: int
    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0        # temporaries beyond the state: activations, gathered weights, buffers
    host: int = 0               # bytes in host memory, not in `total`: an offloaded optimizer state
                                # (Plan(offload="optimizer")) or offloaded activations, below
    activations_host: int = 0   # of `host`, the layers' saved activations (Plan(offload="activations"))
    source: str = "graph"       # "xla" (compiled memory analysis) or "graph" (lowered program)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
    """What one lowered step does on each device."""

    flops: Flops
    collectives: Sequence[Collective]
    mesh: Mapping[str, int]               # axis sizes, in device order (last axis fastest)
    data_axes: tuple[str, ...]            # axes the batch is split on
    memory: Memory
    tokens: int                           # tokens per global step
    pipeline: Pipeline = Pipeline()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted step of one plan on one profile."""

    compute_s: float
    comm_s: Mapping[str, float]           # per link (intra-node / inter-node), before overlap
    exposed_comm_s: float
    bubble_s: float                       # part of compute_s (pipeline ticks with no work), not extra
    offload_s: float                      # host <-> device transfers of offloaded state or activations
    step_s: float
    memory_bytes: int
    fits: bool
    tokens_per_s: float
    mfu: float


def link_of(axes: Sequence[str], mesh: Mapping[str, int], devices_per_node: int) -> str:
    """Whether a collective over `axes` stays inside one instance (device ids numbered
    row-major over the mesh, `devices_per_node` to an instance)."""
    names = list(mesh)
    strides = {a: math.prod(mesh[b] for b in names[i + 1:]) for i, a in enumerate(names)}
    span = 1 + sum((mesh[a] - 1) * strides[a] for a in axes)  # ids of the group holding device 0
    return INTRA if span <= devices_per_node else INTER


def collective_seconds(c: Collective, link: str, profile: HardwareProfile) -> float:
    n = c.group_size
    if n <= 1:
        return 0.0
    bandwidth = profile.intra_node_bytes_per_s if link == INTRA else profile.inter_node_bytes_per_s
    latency = profile.intra_node_latency_s if link == INTRA else profile.inter_node_latency_s
    steps = min(_RING_STEPS.get(c.kind, lambda n: 1)(n), max(1, 2 * math.ceil(math.log2(n))))
    return c.wire_bytes / bandwidth + steps * latency


def compute_seconds(flops: Flops, profile: HardwareProfile) -> float:
    """Matmuls at the peak of their dtype (ragged dots as the backends run them: dense against
    every group, Flops.ragged_dense), the rest at memory bandwidth; on GPUs with cuDNN's fused
    attention, the blockwise attention calls it would take keep their softmax traffic on chip."""
    matmul = (flops.matmul + flops.ragged_dense) / profile.matmul_flops_per_s(flops.matmul_dtype)
    elementwise, moved = flops.elementwise + flops.reduce, flops.moved_bytes
    if profile.fused_attention == "cuda":
        elementwise, moved = elementwise - flops.cuda_fused_elementwise, moved - flops.cuda_fused_moved_bytes
    return matmul + (elementwise * ELEMENT_BYTES + moved) / profile.hbm_bytes_per_s


def hidden_seconds(c: Collective, seconds: float, cost: StepCost, profile: HardwareProfile) -> float:
    """What of a collective over `context` or `expert` alone runs under compute: ring attention
    passes the next key/value chunk while the chunk in hand is attended to, Ulysses' all-to-all
    of k or v can run beside the projection of q, and on GPUs an MoE layer's dispatch and combine
    run beside other rows' expert GEMMs (xtrain.lowering.explicit.rules.experts). Credited as
    `profile.overlap` of the matmul time of the compute that neither feeds nor consumes it
    (Collective.overlap_flops), at most all of it."""
    if tuple(c.axes) not in ((CONTEXT,), (EXPERT,)) or not c.overlap_flops:
        return 0.0
    return min(seconds, profile.overlap * c.overlap_flops / profile.matmul_flops_per_s(cost.flops.matmul_dtype))


def communication(cost: StepCost, profile: HardwareProfile) -> tuple[dict[str, float], float, float]:
    """(seconds per link, seconds of data-parallel collectives, exposed seconds of the others:
    all of them but what runs under compute, `hidden_seconds`)."""
    per_link = {INTRA: 0.0, INTER: 0.0}
    data_parallel = other = 0.0
    for c in cost.collectives:
        link = link_of(c.axes, cost.mesh, profile.devices_per_node)
        seconds = collective_seconds(c, link, profile)
        per_link[link] += seconds
        if set(c.axes) <= set(cost.data_axes):
            data_parallel += seconds
        else:
            other += seconds - hidden_seconds(c, seconds, cost, profile)
    return per_link, data_parallel, other


def offload_seconds(memory: Memory, profile: HardwareProfile) -> float:
    """Host bytes cross the host link twice per step: an offloaded optimizer state to the device
    for the update and back after it, offloaded activations out in the forward pass and back in
    the backward; counted as exposed, though XLA may overlap part of it."""
    if not memory.host:
        return 0.0
    if profile.host_bytes_per_s is None:
        raise UnsupportedError(
            f"{profile.name} has no host-link bandwidth in its profile: offload cannot be costed there")
    return 2 * memory.host / profile.host_bytes_per_s


def predict(cost: StepCost, profile: HardwareProfile, *, model_flops: float | None = None) -> Prediction:
    """Step time, throughput and fit of `cost` on `profile`.

    Args:
        model_flops: the model's FLOPs per step, all devices together (xtrain.ir.analysis.flops: the
            same for every plan of a model, so MFU compares plans); default: the program's own
            matmul FLOPs on every device, replicated work and recomputation included.
    """
    compute = compute_seconds(cost.flops, profile)
    per_link, data_parallel, other = communication(cost, profile)
    pipelined = cost.pipeline.stages > 1
    hidden = 0.0 if pipelined else profile.overlap * compute  # a pipeline syncs after its last backward
    exposed = other + max(0.0, data_parallel - hidden)
    offload = offload_seconds(cost.memory, profile)
    step = compute + exposed + offload  # a pipeline's bubble ticks are in its program's compute (module docstring)
    bubble = compute * cost.pipeline.bubble_fraction if pipelined else 0.0
    devices = math.prod(cost.mesh.values())
    useful = cost.flops.matmul * devices if model_flops is None else model_flops
    peak = profile.matmul_flops_per_s(cost.flops.matmul_dtype)
    return Prediction(compute_s=compute, comm_s=per_link, exposed_comm_s=exposed,
                      bubble_s=bubble, offload_s=offload, step_s=step, memory_bytes=cost.memory.total,
                      fits=cost.memory.total <= profile.hbm_bytes, tokens_per_s=cost.tokens / step,
                      mfu=ir_flops.mfu(useful, step, devices, peak))


# -- memory ---------------------------------------------------------------------------------
def memory_from_compiled(compiled, state: Mapping[str, int], activations_host: int = 0) -> Memory:
    """XLA's memory analysis of a compiled step: arguments + outputs not aliased to them +
    temporaries; `state` is the parameters/gradients/optimizer split (report.state_memory);
    `activations_host` the bytes of offloaded activations (report's memory["activations_host"]:
    charged as host traffic; where XLA keeps them in device buffers, XLA:CPU, they stay in
    `total` as XLA counts them)."""
    stats = compiled.memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
             + stats.temp_size_in_bytes)
    host = state.get("optimizer_host", 0)
    if host and not getattr(stats, "host_argument_size_in_bytes", 0):
        total -= host  # XLA:CPU counts pinned_host buffers as device bytes (donated: once, net)
    return Memory(total=int(total), parameters=state.get("parameters", 0), gradients=state.get("gradients", 0),
                  optimizer=state.get("optimizer", 0), activations=int(stats.temp_size_in_bytes),
                  host=host + activations_host, activations_host=activations_host, source="xla")


def memory_from_graph(per_device_jaxpr, state: Mapping[str, int], activations_host: int = 0) -> Memory:
    """Per-device memory of a lowered (not compiled) step: the state shards (`state`:
    parameters, gradients, optimizer, int8 residual bytes; an offloaded optimizer state,
    `optimizer_host`, counts as host memory) held all step, plus the peak of live
    intermediates of the per-device program in device memory (activations, gathered weights;
    gradients are intermediates there and counted in that peak, not twice; values placed in
    host memory are not: `activations_host` bytes of offloaded activations per step,
    xtrain.lowering.offload.offloaded_activation_bytes, count as host memory)."""
    temporaries = liveness.peak_live_bytes(per_device_jaxpr, donated=True)  # a step donates its state
    held = state.get("parameters", 0) + state.get("optimizer", 0) + state.get("grad_residual", 0)
    return Memory(total=int(held + temporaries), parameters=state.get("parameters", 0),
                  gradients=state.get("gradients", 0), optimizer=state.get("optimizer", 0),
                  activations=int(max(0, temporaries - state.get("gradients", 0))),
                  host=state.get("optimizer_host", 0) + activations_host, activations_host=activations_host,
                  source="graph")
