"""The plan search's space (xtrain.cost.search): a `Candidate` is one point (data, expert, tensor,
context and pipeline degrees, microbatches and schedule, ZeRO stage, remat, what is offloaded to host
memory, compute precision, the order of its mesh axes) and turns into a Plan; `candidates`
lists the points for a device count and hardware profile, in the order the search lowers and
lists them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from neuron_support import topology
from xtrain.cost.hardware import HardwareProfile
from xtrain.errors import PlanError, UnsupportedError
from xtrain.sharding.context_parallel import ContextParallel
from xtrain.sharding.offload import Offload
from xtrain.sharding.plan import Plan

# the Megatron plan of the model for a mesh's {axis: size} (xtrain.sharding.presets.megatron_of)
TensorPlan = Callable[[Mapping[str, int]], Plan]
# a plan with the model's MoE experts split over the mesh's `expert` axis (sharding.experts.expert_parallel)
ExpertPlan = Callable[[Plan, Mapping[str, int]], Plan]

NOT_LOWERED = "not lowered:"  # how the reasons of memory-only variants skipped by the search begin
SKIPPED_REMAT = "not lowered: fits without remat, which would only add recomputation"
# under lockstep SPMD a 1F1B tick runs a forward and a backward on every stage
# (xtrain/lowering/pipeline/executors.py)
SKIPPED_1F1B = "not lowered: fits as GPipe; 1F1B only saves memory (each lockstep tick runs forward and backward)"
SKIPPED_REJECTED = "not lowered: same collectives as its plain plan, which the target's checker rejects"
SKIPPED_ZERO_BUBBLE = ("not lowered: its GPipe form, even without its bubble (all zero bubble can save), is slower "
                       "than the best candidate")
SKIPPED_OFFLOAD = "not lowered: fits with the optimizer state on the device, which saves the host transfers"
SKIPPED_ACT_OFFLOAD = "not lowered: fits with the activations on the device, which saves the host transfers"
# a candidate's name for what it offloads
OFFLOAD_NAMES = {Offload.NONE: "", Offload.OPTIMIZER: " offload", Offload.ACTIVATIONS: " act-offload"}
SCHEDULES = ("gpipe", "1f1b", "zbh1", "zbv")
# schedules that branch per stage (lax.switch): not on Trainium, which runs no conditionals
BRANCHING = ("zbh1", "zbv")
# mesh axes, outermost first: tensor parallelism (the chattiest) on neighbouring devices, expert
# parallel's all-to-alls next
DEFAULT_ORDER = ("data", "pipe", "context", "expert", "tensor")
# context-parallel candidates for sequences at least this long (shorter ones fit without splitting)
CONTEXT_MIN_SEQUENCE = 4096
# sequences the ring attention splits into whole blocks on every backend (blocks of 128-512)
_BLOCK_GRAIN = 512


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One point of the search space.

    Attributes:
        data: data-parallel degree (mesh axis "data").
        tensor: Megatron tensor-parallel degree (mesh axis "tensor"; 1: none).
        expert: expert-parallel degree (mesh axis "expert": MoE layers' experts split over it,
            the batch over data x expert; 1: none; with a pipeline, inside each stage).
        context: context-parallel degree (mesh axis "context": the sequence split, ring
            attention; 1: none). With a pipeline, each stage rings its own layers' attention.
        ulysses: how attention runs over `context` (Plan(context=...)): 1 a ring; `context`
            Ulysses (all-to-all to a head split); a divisor between, Ulysses in groups of that
            many devices and a ring over the groups (xtrain.ContextParallel(ulysses=...)).
        zero: ZeRO stage over "data".
        remat: activation checkpointing of the layer stack (with a pipeline: GPipe's
            checkpoint of each stage, `with_pipeline(checkpoint=True)`).
        pipe, microbatches: pipeline stages and microbatches (1, 1: no pipeline).
        schedule: the pipeline schedule, "gpipe", "1f1b", "zbh1" or "zbv" (zero bubble; not on
            Trainium; zbv runs two chunks per stage, so needs 2 x pipe layers).
        order: the mesh axes from outermost to innermost (device ids are numbered row-major
            over them, so the last axis takes neighbouring devices); () is DEFAULT_ORDER.
        precision: the plan's compute precision (`HardwareProfile.plan_precision`: "fp16" with
            loss scaling on hardware without bf16, else "fp32").
        offload: what lives in host memory (Plan(offload=...)): Offload.OPTIMIZER the optimizer
            state; Offload.ACTIVATIONS what each layer of the layer scan saves for the backward
            pass (no pipeline; the layer is recomputed as under remat, so remat stays False).
            The strings "none", "optimizer", "activations" are accepted.
        capacity_factor: MoE layers' expert capacity (Plan(capacity_factor=...)): expert
            parallel's all-to-all buffers hold that capacity per peer, and the cost follows;
            None: drop-free.
    """

    data: int
    tensor: int = 1
    zero: int = 0
    remat: bool = False
    pipe: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    order: tuple[str, ...] = ()
    precision: str = "fp32"
    offload: Offload = Offload.NONE
    expert: int = 1
    context: int = 1
    ulysses: int = 1
    capacity_factor: float | None = None

    def __post_init__(self):
        self._check_offload()
        if self.ulysses < 1 or self.context % self.ulysses:
            raise PlanError(f"Candidate(context={self.context}, ulysses={self.ulysses}): the Ulysses group size "
                            f"must divide the context degree; use one of {_divisors(self.context)}")
        if self.order and sorted(self.order) != sorted(self._sizes(DEFAULT_ORDER)):
            raise PlanError(f"Candidate(order={self.order}) must order exactly the axes "
                            f"{tuple(self._sizes(DEFAULT_ORDER))} of this candidate")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"Candidate(schedule={self.schedule!r}) is not one of {SCHEDULES}")
        if self.pipe == 1 and (self.microbatches, self.schedule) != (1, "gpipe"):
            raise PlanError(f"Candidate(pipe=1, microbatches={self.microbatches}, schedule={self.schedule!r}): "
                            "microbatches and schedule belong to a pipeline; set pipe >= 2")
        if self.schedule != "gpipe" and self.remat:
            raise PlanError(f"Candidate(schedule={self.schedule!r}, remat=True): remat is GPipe's per-stage "
                            "checkpoint (1F1B always recomputes each stage from its input; zero bubble keeps the "
                            "forward's residuals for its B and W); use remat=False")

    def _check_offload(self) -> None:
        names = [o.value for o in Offload]
        if not isinstance(self.offload, (Offload, str)) or self.offload not in [*Offload, *names]:
            raise PlanError(f"Candidate(offload={self.offload!r}) must be one of {names} (or an Offload)")
        object.__setattr__(self, "offload", Offload.of(self.offload))
        if self.offload is Offload.ACTIVATIONS and self.pipe > 1:
            raise PlanError(f"Candidate(offload='activations', pipe={self.pipe}): activation offload checkpoints "
                            "the layer scan, which a pipeline does not run; use pipe=1, or remat=True for the "
                            "pipeline's per-stage checkpoint")
        if self.offload is Offload.ACTIVATIONS and self.remat:
            raise PlanError("Candidate(offload='activations', remat=True): offloaded activations already recompute "
                            "each layer from its input, as remat does; use remat=False")

    def _sizes(self, order: tuple[str, ...]) -> dict[str, int]:
        sizes = {"data": self.data, "pipe": self.pipe, "context": self.context, "expert": self.expert,
                 "tensor": self.tensor}
        return {a: sizes[a] for a in order if a == "data" or sizes[a] > 1}

    @property
    def mesh(self) -> dict[str, int]:
        """Mesh axis sizes in device order: `order`, by default "data" outermost and "tensor"
        innermost (neighbouring devices)."""
        return self._sizes(self.order or DEFAULT_ORDER)

    @property
    def name(self) -> str:
        short = {"data": "dp", "tensor": "tp", "pipe": "pp", "expert": "ep", "context": "cp"}
        parts = [f"{short[a]}{n}" for a, n in self.mesh.items() if a == "data" or n > 1]
        name = "x".join(parts) + (f" {self.schedule} m{self.microbatches}" if self.pipe > 1 else "")
        name += (f" zero{self.zero}" if self.zero else "") + (" remat" if self.remat else "")
        name += OFFLOAD_NAMES[self.offload]
        if self.ulysses > 1:
            name += " ulysses" + (f"{self.ulysses}" if self.ulysses < self.context else "")
        return name + (f" {self.precision}" if self.precision != "fp32" else "")

    def plan(self, tensor: TensorPlan | None = None, expert: ExpertPlan | None = None) -> Plan:
        """The Plan: Megatron rules for tensor > 1 (`tensor(mesh sizes)`: derived from the model's
        traced program), the experts split for expert > 1 (`expert(plan, mesh sizes)`; None: left
        to `xtrain.compile`, which splits them on a mesh with an "expert" axis), the ZeRO stage,
        remat, what is offloaded, the pipeline."""
        base = self._base_plan(tensor)
        if self.expert > 1 and expert is not None:
            base = expert(base, self.mesh)
        if self.pipe == 1:
            return dataclasses.replace(base, zero=self.zero, remat=self.remat)
        return dataclasses.replace(base, zero=self.zero).with_pipeline(
            stages=self.pipe, microbatches=self.microbatches, schedule=self.schedule, checkpoint=self.remat)

    def _base_plan(self, tensor: TensorPlan | None) -> Plan:
        base = Plan(precision=self.precision, offload=self.offload, context=ContextParallel(self.ulysses),
                    capacity_factor=self.capacity_factor)
        if self.tensor > 1:
            if tensor is None:
                raise UnsupportedError(f"candidate {self.name}: tensor parallelism uses xtrain.plans.megatron, "
                                       "which needs a torch.nn.Module")
            base = dataclasses.replace(tensor(self.mesh), precision=base.precision, offload=base.offload,
                                       context=base.context, capacity_factor=base.capacity_factor)
        return base

    def code(self) -> str:
        """Python that builds this candidate's mesh and plan in a training script that has
        `model` (and `batch`, which a Megatron plan is derived on)."""
        options = [f"zero={self.zero}"] * bool(self.zero) + ["remat='full'"] * (self.remat and self.pipe == 1)
        options += [f"precision={self.precision!r}"] * (self.precision != "fp32")
        options += [f"offload={self.offload.value!r}"] * (self.offload is not Offload.NONE)
        if self.ulysses > 1:
            options.append("context='ulysses'" if self.ulysses == self.context
                           else f"context=xtrain.ContextParallel(ulysses={self.ulysses})")
        options += [f"capacity_factor={self.capacity_factor}"] * (self.capacity_factor is not None)
        lines = [f"mesh = xtrain.Mesh({', '.join(f'{a}={n}' for a, n in self.mesh.items())})"]
        if self.tensor > 1:
            lines.append("plan = xtrain.plans.megatron(model, mesh, example=batch)")
            if options:
                lines = ["import dataclasses", *lines, f"plan = dataclasses.replace(plan, {', '.join(options)})"]
        else:
            lines.append(f"plan = xtrain.Plan({', '.join(options)})")
        if self.pipe > 1:
            lines.append(f"plan = plan.with_pipeline(stages={self.pipe}, microbatches={self.microbatches}, "
                         f"schedule={self.schedule!r}" + (", checkpoint=True" if self.remat else "") + ")")
        return "\n".join(lines)

    @property
    def saves_memory_only(self) -> bool:
        """Remat, 1F1B and offload never make a step faster (recomputation, lockstep ticks,
        host transfers); a zero-bubble schedule can (it runs each matmul once, no bubble ticks
        beyond the warm-up's)."""
        return self.remat or self.schedule == "1f1b" or self.offload is not Offload.NONE

    @property
    def zero_bubble(self) -> bool:
        """A zero-bubble schedule: lowered after the rest, when its GPipe form could win (search)."""
        return self.schedule in BRANCHING

    @property
    def plain(self) -> "Candidate":
        """This candidate without its memory-only variants."""
        return dataclasses.replace(self, remat=False, schedule="gpipe", offload=Offload.NONE)

    @property
    def skipped(self) -> str:
        """Why this memory-only variant is not lowered when its plain form fits."""
        if self.remat:
            return SKIPPED_REMAT
        return {Offload.OPTIMIZER: SKIPPED_OFFLOAD, Offload.ACTIVATIONS: SKIPPED_ACT_OFFLOAD}.get(self.offload,
                                                                                                 SKIPPED_1F1B)

    def state_floor(self, params: int, optimizer: int) -> int:
        """The fewest bytes of parameters, gradients and optimizer state one device can hold under
        this candidate, from the model's totals alone (`params`: every parameter's bytes, the
        gradients' too; `optimizer`: the optimizer state's): every split taken as even (tensor,
        pipeline and expert degrees divide all of it), so the step needs at least this much, with
        no trace. ZeRO-1 splits the optimizer state over `data`, ZeRO-2 also the gradients,
        ZeRO-3 also the parameters; an offloaded optimizer state is in host memory."""
        d = self.data
        held = (params / d if self.zero >= 3 else params) + (params / d if self.zero >= 2 else params)
        if self.offload is not Offload.OPTIMIZER:
            held += optimizer / d if self.zero >= 1 else optimizer
        return int(held / (self.tensor * self.pipe * self.expert))

    def simplicity(self) -> tuple:
        offloads = list(Offload).index(self.offload)  # none, then the optimizer state, then activations
        return (self.pipe, self.tensor, self.expert, self.context, self.ulysses, self.zero, offloads, self.remat,
                self.schedule != "gpipe", self.microbatches)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def pipeline_degrees(devices: int, layers: int) -> list[int]:
    """Default pipe degrees > 1: the divisors of `devices` up to `layers` repeated blocks."""
    return [p for p in _divisors(devices) if 2 <= p <= layers]


def context_degrees(devices: int, sequence: int) -> list[int]:
    """Context-parallel degrees > 1 worth a candidate: none below CONTEXT_MIN_SEQUENCE tokens;
    else the divisors of `devices` that cut the sequence into 2 x degree chunks of whole
    attention blocks (ring attention's balanced chunks)."""
    if sequence < CONTEXT_MIN_SEQUENCE or sequence % _BLOCK_GRAIN:
        return []
    def fits(c: int) -> bool:
        chunk = sequence // (2 * c)
        return sequence % (2 * c) == 0 and (chunk % _BLOCK_GRAIN == 0 or _BLOCK_GRAIN % chunk == 0)

    return [c for c in _divisors(devices) if c > 1 and fits(c)]


def candidates(devices: int, profile: HardwareProfile, *, tensor_degrees: Sequence[int] | None = None,
               zero_stages: Sequence[int] = (0, 1, 2, 3), remat: Sequence[bool] = (False, True),
               pipe_degrees: Sequence[int] = (1,), microbatches: Sequence[int] | None = None,
               schedules: Sequence[str] = SCHEDULES,
               offloads: Sequence[Offload] = (Offload.OPTIMIZER, Offload.ACTIVATIONS),
               expert_degrees: Sequence[int] = (1,), context: Sequence[int] = (1,),
               ulysses: bool = True) -> list[Candidate]:
    """Every (pipe, tensor, zero, remat) point for `devices` devices; tensor degrees divide the
    devices of one instance (and, on Trainium, are replica-group sizes a node supports).
    Without a pipeline, also each of `offloads` where the profile knows its host link
    (Offload.ACTIVATIONS needs a layer scan: leave it out for a model without repeated blocks).

    Pipeline points (pipe > 1) take ZeRO 0-1 (the stages the pipeline step supports), each
    of `microbatches` (default (p, 2p, 4p)) and of `schedules` (on Trainium without the
    zero-bubble ones, which branch; nor with context parallel, which they do not run); remat there is GPipe's
    per-stage checkpoint (1F1B always recomputes). `expert_degrees` > 1 (for MoE models only)
    add expert-parallel points, with and without a pipeline (inside one, each stage's experts
    split over `expert`); `context`: context-parallel degrees
    (`context_degrees`), with and without a pipeline; without a pipeline each context degree
    also takes every Ulysses group size dividing it (`ulysses`: Ulysses alone, hybrid Ulysses x
    ring; a size the heads cannot split is refused when lowered, with the reason), inside one
    a ring or Ulysses over the whole axis."""
    bad = [p for p in pipe_degrees if p < 1 or devices % p]
    if bad:
        raise PlanError(f"pipe_degrees={tuple(pipe_degrees)}: {bad} do not divide the {devices} devices; use "
                        f"divisors of {devices}, e.g. {_divisors(devices)}")
    if _neuron(profile):  # no conditionals there
        schedules = [s for s in schedules if s not in BRANCHING]
    out = []
    for p, c in ((p, c) for p in pipe_degrees for c in context):
        for t in (t for t in tensor_degrees or _tensor_degrees(devices, profile) if devices % (t * p * c) == 0):
            for e in (e for e in expert_degrees if devices % (t * p * c * e) == 0):
                points = _points(devices // (t * p * c * e), t, p, zero_stages, remat,
                                 microbatches or (p, 2 * p, 4 * p), schedules, profile, offloads)
                out += [dataclasses.replace(x, expert=e, context=c, ulysses=u) for x in points
                        if c == 1 or not x.zero_bubble for u in _ulysses_sizes(c, p, ulysses)]
    return out


def _ulysses_sizes(context: int, pipe: int, ulysses: bool) -> tuple[int, ...]:
    """The Ulysses group sizes of a context degree: without a pipeline every divisor (a ring,
    hybrids, Ulysses alone); inside one a ring or Ulysses over the whole axis (the pipeline
    points are many already)."""
    if not ulysses or context == 1:
        return (1,)
    return tuple(_divisors(context)) if pipe == 1 else (1, context)


def _neuron(profile: HardwareProfile) -> bool:
    kind = topology.INSTANCES.get(profile.name.split("[")[0])
    return bool(kind and kind.backend is topology.Backend.NEURON)


def _tensor_degrees(devices: int, profile: HardwareProfile) -> list[int]:
    """Divisors of the devices of one instance; on Trainium, replica-group sizes a node supports."""
    allowed = topology.INSTANCES.get(profile.name.split("[")[0])
    groups = allowed.node_group_sizes if allowed and allowed.node_group_sizes else None
    return [t for t in _divisors(math.gcd(devices, profile.devices_per_node)) if groups is None or t in groups]


def _points(data: int, tensor: int, pipe: int, zero_stages, remat, microbatches, schedules,
            profile: HardwareProfile, offloads: Sequence[Offload]) -> list[Candidate]:
    """The candidates of one (data, tensor, pipe) mesh; without a pipeline also the optimizer
    state or the layers' saved activations offloaded to host memory, where the profile knows
    the host link."""
    zeros = [z for z in zero_stages if pipe == 1 or z <= 1] if data > 1 else [0]
    precision = profile.plan_precision
    if pipe == 1:
        plain = [Candidate(data=data, tensor=tensor, zero=z, remat=r, precision=precision)
                 for z in zeros for r in remat]
        offload = [Candidate(data=data, tensor=tensor, zero=z, precision=precision, offload=o)
                   for o in offloads if o is not Offload.NONE for z in zeros]
        return plain + (offload if profile.host_bytes_per_s else [])
    return [Candidate(data=data, tensor=tensor, zero=z, pipe=pipe, microbatches=m, schedule=s, remat=r,
                      precision=precision)
            for m in microbatches for z in zeros for s in schedules for r in (remat if s == "gpipe" else (False,))]
