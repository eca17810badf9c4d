"""Automatic plan search: enumerate plans for a device count, predict each, pick the best.

    result = search(model, tx, batch, profile, devices=128)
    print(result)                      # one row per candidate; `*` marks the pick
    result.best.candidate.plan(search.tensor_plan(model, batch))  # the Plan, result.best.candidate.mesh the Mesh sizes

Candidates (xtrain.cost.candidates; in the fixed order of torchtitan's parallelize: tensor,
pipeline, activation checkpointing, data/ZeRO): tensor degree t over the "tensor" axis (Megatron
preset; on Trainium only the replica-group sizes a node supports), pipeline degree p over "pipe"
with m microbatches, for an MoE model (`experts`) expert degree e over "expert" (dividing n and
every MoE layer's experts; no pipeline: experts split, tokens moved by all-to-all, costed on the
link that axis maps to), for sequences of CONTEXT_MIN_SEQUENCE tokens or more context degree c over
"context" (`context_degrees`; with or without a pipeline: in one, each stage's lockstep ticks ring
its own layers' attention and the stage boundary carries 1/c of the activations, all read off the
lowered program), data degree n / (t x p x e x c) over "data" with ZeRO stage 0-3 (0-1 with a
pipeline, all the pipeline step supports), activation checkpointing on/off (with a pipeline: GPipe's
per-stage checkpoint, or the 1F1B schedule, which always recomputes). Pipeline degrees by
default: the divisors of n up to the model's number of repeated blocks, none for a model
without repeated blocks; m in (p, 2p, 4p). Precision: the script's fp32, except on hardware
with fp16 but no bf16 arithmetic (V100: p3 instances), where every plan is fp16 with dynamic
loss scaling (`HardwareProfile.plan_precision`).

Each candidate is lowered for an abstract mesh (cost.program), never run; a pipeline candidate
by the pipeline step itself, so its FLOPs, permutes between stages, gradient sync over "pipe"
and the data axes, and memory (each stage stores its own layers) are the program's. On
Trainium (trn1, trn1n, trn2) each candidate's program is lowered for Neuron and run through
the conformance checker (neuron_support.conformance: replica groups, permutes between adjacent
cores, the cap on distinct groups) in every order of its mesh axes ("data", "pipe", "tensor",
tensor innermost, first): the candidate takes the fastest order that passes (e.g. pipe
innermost, so that stages are neighbouring cores), and one that fails in every order is listed
with the first finding and never picked. MFU divides the model's FLOPs (xtrain.ir.analysis.flops.model_flops:
6N + attention per token, the same for every plan) by each plan's predicted step time. A
candidate that cannot be lowered (batch not divisible by data x microbatches, fewer repeated
blocks than stages, no transformer blocks for tensor parallel) is listed with the reason; one
whose memory exceeds the device is marked as not fitting and never picked. A variant that only
saves memory (remat, 1F1B, and where the profile knows the host link, without a pipeline: the
optimizer state offloaded to host memory, or, for a model with repeated blocks, what each layer
of the layer scan saves for the backward pass) is lowered only when its plain form does not
fit; an offloaded plan needs no device memory for what it offloads and is charged its host
transfers (twice those bytes per step: the state to the device and back, the activations out
in the forward pass and back in the backward).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping, Sequence

import jax

from xtrain.errors import OptionsError, UnsupportedError, XtrainError
from xtrain.ir.analysis import flops as flops_mod
from xtrain.cost import model as cost_model
from xtrain.cost import listing, placement, sweep
from xtrain.cost import program as program_mod
# the search space lives in cost.candidates; its public names are the search's too
from xtrain.cost.candidates import (SKIPPED_REJECTED, SKIPPED_REMAT, SKIPPED_ZERO_BUBBLE, Candidate, candidates,
                                    context_degrees, pipeline_degrees)
from xtrain.cost.hardware import HardwareProfile
from xtrain.ir.structure import Structure
from xtrain.lowering import accounting, offload
from xtrain.lowering.assembly import AssemblyOptions
from xtrain.sharding import presets
from xtrain.sharding.experts import expert_parallel
from xtrain.sharding.offload import Offload
from xtrain.sharding.plan import Plan

# Candidates within this share of the fastest count as tied; the simplest of them is picked
# (less tensor parallelism, lower ZeRO stage, no recomputation): the margin is about the
# model's error on elementwise traffic, which it counts unfused.
TIE = 0.10


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verified:
    """A candidate's program as the target's compiler saw it (search(verify=...)).

    Attributes:
        fits: the compiled program fits the device (a candidate that does not is never picked).
        memory_bytes: compiled memory per device (arguments + outputs - aliased + temporaries).
        note: what else to print beside the cost model's figures (e.g. compiled collectives).
    """

    fits: bool
    memory_bytes: int
    note: str = ""


# search(verify=...): `verify(row, plan)` compiles a candidate (`row.candidate.mesh`: its mesh
# sizes in device order; `plan`: its Plan) for the target, e.g. a deviceless GPU compile, and
# says whether it fits; called on the few best candidates only
Verify = Callable[["Row", Plan], Verified]
VERIFY_TOP = 3  # candidates compiled per round of verification
# with an FP8 peak (H100, H200, trn2) a search in the profile's precision also lists its fastest FP8_ROWS
# candidates with FP8 matmuls, never picked: FP8 changes the numerics (`--precision fp8` picks among them)
FP8_ROWS = 3
FP8_LISTED = "fp8 for comparison: not picked (FP8 matmuls change the numerics; --precision fp8 searches them)"
# why a candidate is refused before lowering: its parameters, gradients and optimizer state alone,
# split as evenly as the candidate can split them (Candidate.state_floor), exceed the device's memory
STATE_ALONE = "not traced: parameters, gradients and optimizer state alone need at least"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    """One candidate's outcome: its prediction, or why it has none."""

    candidate: Candidate
    prediction: cost_model.Prediction | None = None
    cost: cost_model.StepCost | None = None
    reason: str = ""
    findings: tuple[str, ...] = ()  # why the target's compiler would reject its program (Neuron)
    # ops without a partition rule this candidate runs replicated (primitive -> module paths); their
    # gathers are in its program, so its cost charges them; picked only when no clean candidate fits
    fallbacks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    verified: Verified | None = None  # what the target's compiler said of it (search(verify=...)); None: not asked
    listed_only: bool = False  # shown beside the candidates for comparison, never picked (FP8_ROWS)

    @property
    def usable(self) -> bool:
        fits = self.verified.fits if self.verified is not None else True
        return self.prediction is not None and self.prediction.fits and not self.findings and fits and \
            not self.listed_only


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """All candidates for one target and the pick."""

    target: str
    profile: HardwareProfile
    rows: list[Row]
    best: Row | None

    def __str__(self) -> str:
        return self.listing()

    def listing(self, *, show_all: bool = False) -> str:
        """The table: every lowered or refused candidate; those a bound left unlowered
        (xtrain.cost.sweep) only with `show_all`. Ends with the pick, as code."""
        return listing.table(self, show_all=show_all)


def _tokens(batch: tuple) -> int:
    first = batch[0]
    return math.prod(first.shape[:2]) if len(first.shape) >= 2 else first.shape[0]


def step_cost(step: program_mod.AbstractStep, sizes: dict[str, int], tokens: int, module_paths=frozenset(),
              pipeline: cost_model.Pipeline = cost_model.Pipeline()) -> cost_model.StepCost:
    """The StepCost of a traced step: FLOPs, collectives and graph memory of its program (the
    activations it offloads counted as host memory, as `step.report()` counts them)."""
    body = program_mod.per_device_body(step.program)
    memory = cost_model.memory_from_graph(body if body is not None else step.program, step.state_bytes,
                                          activations_host=offload.offloaded_activation_bytes(step.program))
    return cost_model.StepCost(
        flops=flops_mod.count(step.program),
        collectives=accounting.collectives(step.program, sizes, module_paths),
        mesh=sizes, data_axes=step.batch_axes, memory=memory, tokens=tokens, pipeline=pipeline)


def _refusal(candidate: Candidate, rows: int, layers: int | None) -> str:
    """Why `candidate` is no plan for this model and batch, found before lowering ('' if none)."""
    d, m, p = candidate.data, candidate.microbatches, candidate.pipe
    if candidate.expert > 1 and rows % (d * candidate.expert):
        return f"global batch {rows} is not divisible by data={d} x expert={candidate.expert}"
    if rows % (d * m):
        return f"global batch {rows} is not divisible by data={d}" + (f" x microbatches={m} = {d * m}" if p > 1 else "")
    if p > 1 and layers is not None and layers < p:
        if layers == 0:
            return "no repeated blocks (blocks.0, blocks.1, ...) to cut into pipeline stages"
        return f"the model has {layers} repeated blocks, fewer than pipe={p} stages"
    return ""


@functools.lru_cache(maxsize=16)
def _megatron(model, shapes: tuple, sizes: tuple) -> Plan:
    return presets.megatron_of(model, shapes, dict(sizes))


def tensor_plan(model, batch: tuple) -> Callable[[Mapping[str, int]], Plan]:
    """The Megatron plan of `model` for a mesh, derived from its program traced on `batch`'s
    shapes (one trace per mesh, shared by the candidates)."""
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch)
    return lambda sizes: _megatron(model, shapes, tuple(sizes.items()))


def expert_plan(model, experts: Sequence[str]) -> Callable[[Plan, Mapping[str, int]], Plan]:
    """`plan` with `model`'s MoE expert weights `experts` split over a mesh's `expert` axis."""
    shapes = {n: tuple(s.shape) for n, s in model.param_shapes().items()}
    return lambda plan, sizes: expert_parallel(plan, experts, dict(sizes), shapes, model.name)


def expert_degrees(model, experts: Sequence[str], devices: int) -> list[int]:
    """Expert-parallel degrees worth listing: 1, and for an MoE model the degrees > 1 that divide
    the devices and every MoE layer's number of experts."""
    counts = {model.param_shapes()[n].shape[0] for n in experts}
    return [1] + [e for e in range(2, devices + 1) if devices % e == 0 and counts and all(c % e == 0 for c in counts)]


def evaluate(model, tx, structure: Structure | None, candidate: Candidate, batch: tuple, profile: HardwareProfile,
             *, regather: bool = True, layers: int | None = None, model_flops: float | None = None,
             experts: Sequence[str] = ()) -> Row:
    """Lowers `candidate` for an abstract mesh and predicts it on `profile`. On Trainium the
    program is lowered for Neuron and checked (neuron_support.conformance): the candidate
    takes the fastest mesh-axis order that passes, or is marked with what fails and never picked.

    Args:
        layers: the model's repeated blocks (program.model_facts), to refuse a pipeline of more
            stages without lowering it; None: the lowering finds out.
        model_flops: the model's FLOPs per step (xtrain.ir.analysis.flops.model_flops), for MFU.
        experts: the model's MoE expert weights (Trainable.experts), for expert-parallel candidates."""
    reason = _refusal(candidate, batch[0].shape[0], layers)
    if reason:
        return Row(candidate=candidate, reason=reason)
    target, built_for = placement.neuron_target(profile), placement.platform_of(profile)
    try:
        profile.check_precision(candidate.precision)
        plan = candidate.plan(tensor_plan(model, batch) if structure is not None else None,
                              expert_plan(model, experts) if experts else None)
        plan = dataclasses.replace(plan, fallback="replicate")  # costed and marked, not refused
        traced = program_mod.abstract_step(program_mod.trainable_of(model, tx, experts), candidate.mesh, plan, batch,
                                           options=AssemblyOptions(scan_layers=True, regather=regather),
                                           platform="neuron" if target else None, built_for=built_for)
    except XtrainError as err:  # what xtrain refuses, with its reason; anything else is a bug, raised
        return Row(candidate=candidate, reason=f"cannot lower: {err}")
    idle = traced.bubble if candidate.pipe > 1 else None
    cost = step_cost(traced, candidate.mesh, _tokens(batch), model.module_paths(),
                     cost_model.Pipeline(stages=candidate.pipe, microbatches=candidate.microbatches, idle=idle))
    placed, errors = placement.conforming_orders(candidate, traced.hlo, target) if target else ([candidate], [])
    # the order only moves collectives between links: the fastest order that the target accepts
    options = [(c, dataclasses.replace(cost, mesh=c.mesh)) for c in placed or [candidate]]
    predicted = [(cost_model.predict(k, profile, model_flops=model_flops), c, k) for c, k in options]
    prediction, candidate, cost = min(predicted, key=lambda p: p[0].step_s)
    size = listing.size
    reason = "" if prediction.fits else f"needs {size(prediction.memory_bytes)} > {size(profile.hbm_bytes)}"
    reason = placement.rejection(target, errors) if not placed else reason
    if traced.fallbacks:
        reason = "; ".join([reason] * bool(reason) + [_fallback_note(traced.fallbacks)])
    return Row(candidate=candidate, prediction=prediction, cost=cost, reason=reason,
               findings=tuple(str(f) for f in errors) if not placed else (), fallbacks=traced.fallbacks)


def _fallback_note(fallbacks) -> str:
    return "replicated fallback (gathers charged): " + ", ".join(
        f"{prim} in {', '.join(paths)}" for prim, paths in sorted(fallbacks.items()))


def pick(rows: Sequence[Row]) -> Row | None:
    """The fastest candidate that fits; among those within TIE of it, the simplest."""
    usable = sweep.preferred(rows)  # a plan without replicated fallbacks first
    if not usable:
        return None
    fastest = min(r.prediction.step_s for r in usable)
    tied = [r for r in usable if r.prediction.step_s <= fastest * (1 + TIE)]
    return min(tied, key=lambda r: (r.candidate.simplicity(), r.prediction.step_s))


def _sequence(batch: tuple) -> int:
    """Dimension 1 of the first batch argument with one (the sequence context parallelism splits)."""
    return next((int(x.shape[1]) for x in batch if len(getattr(x, "shape", ())) >= 2), 0)


def search(model, tx, batch: tuple, profile: HardwareProfile, devices: int, *, structure: Structure | None = None,
           target: str | None = None, candidate_list: Sequence[Candidate] | None = None,
           regather: bool = True, prune_remat: bool = True, pipe_degrees: Sequence[int] | None = None,
           experts: Sequence[str] = (), precision: str | None = None, capacity_factor: float | None = None,
           verify: Verify | None = None, verify_top: int = VERIFY_TOP, fp8_rows: int | None = None,
           progress: Callable[[Candidate], None] | None = None) -> SearchResult:
    """Predicts every candidate for `devices` devices of `profile` and picks one.

    Args:
        model: xtrain's wrapped model (xtrain.ir.Model); tx: the optax transformation.
        batch: one global batch (arrays or jax.ShapeDtypeStruct).
        structure: the model's module structure (for Megatron tensor-parallel candidates).
        candidate_list: the candidates (default: `candidates(devices, profile, pipe_degrees=...)`,
            with context-parallel points where the batch's sequence is long: `context_degrees`).
        regather: ZeRO-3 re-gathers weights in the backward pass (as the step does by default).
        prune_remat: leave unlowered what a bound shows cannot be the pick (xtrain.cost.sweep): a
            memory-only variant (remat, 1F1B, offload) whose plain plan fits or is too slow already,
            a ZeRO sibling whose mesh's matmuls alone are too slow, a zero-bubble one whose GPipe form
            without a bubble would not beat the best; False lowers every candidate.
        pipe_degrees: pipeline degrees of the default candidates, 1 included for no pipeline
            (default: 1 and `pipeline_degrees(devices, repeated blocks of the model)`).
        experts: the model's MoE expert weights (Trainable.experts): the default candidates then
            include expert-parallel ones (`expert_degrees`); none for a model without them.
        precision: every candidate's compute precision ("bf16", ...); default: the profile's
            (`HardwareProfile.plan_precision`).
        capacity_factor: every candidate's MoE capacity (Plan(capacity_factor=...)): expert
            parallel's all-to-alls are costed at that capacity; None: drop-free.
        verify: the target compiler's word on a candidate (Verify): the fastest `verify_top`
            usable candidates are verified; one that does not fit as compiled is marked and never
            picked, and the next best are verified until the pick is a verified one (or none is
            left). None: the cost model's figures alone.
        fp8_rows: on a target with an FP8 peak, a search without `precision` also lists its fastest
            `fp8_rows` candidates costed with FP8 matmuls, never picked (FP8_LISTED); default
            FP8_ROWS with the default candidates, none with a `candidate_list`.
        progress: called with each candidate once it is lowered (e.g. a progress bar's update).

    A candidate whose parameters, gradients and optimizer state alone cannot fit the device, split
    as evenly as it splits them (Candidate.state_floor), is listed as such and never traced.
    The model is traced once per batch signature and trace options (xtrain.ir.replay) and that
    trace is replayed by every candidate; nothing reads a parameter's value, so a model built on
    the meta device (or under xtrain.checkpoint.meta_params()) plans at any size.
    """
    if fp8_rows is not None and fp8_rows < 0:
        raise OptionsError(f"search(fp8_rows={fp8_rows!r}): the FP8 candidates to list beside the others, 0 or more")
    facts = program_mod.model_facts(model, batch)
    default = candidate_list is None
    if candidate_list is None:
        pipes = [1] + pipeline_degrees(devices, facts.layers) if pipe_degrees is None else pipe_degrees
        # activation offload checkpoints the layer scan: only for a model with repeated blocks
        offloads = (Offload.OPTIMIZER, Offload.ACTIVATIONS) if facts.layers else (Offload.OPTIMIZER,)
        candidate_list = candidates(devices, profile, pipe_degrees=pipes, offloads=offloads,
                                    expert_degrees=expert_degrees(model, experts, devices),
                                    context=[1] + context_degrees(devices, _sequence(batch)))
    if precision is not None:
        candidate_list = [dataclasses.replace(c, precision=precision) for c in candidate_list]
    if capacity_factor is not None:
        candidate_list = [dataclasses.replace(c, capacity_factor=capacity_factor) for c in candidate_list]
    totals = program_mod.state_totals(model, tx)

    def lower(c: Candidate) -> Row:
        need = c.state_floor(*totals)
        if need > profile.hbm_bytes:  # no activation can make it fit: not worth a trace
            return Row(candidate=c, reason=f"{STATE_ALONE} {listing.size(need)} > {listing.size(profile.hbm_bytes)}")
        row = evaluate(model, tx, structure, c, batch, profile, regather=regather, layers=facts.layers,
                       model_flops=facts.matmul_flops, experts=experts)
        if progress is not None:
            progress(c)
        return row
    swept = sweep.Sweep(lower, profile, TIE, Row, prune=prune_remat)
    done = swept.run(candidate_list)
    rows = [done[c] for c in candidate_list]
    if precision is None:
        rows += _fp8_rows(rows, profile, lower, (FP8_ROWS if default else 0) if fp8_rows is None else fp8_rows)
    if verify is not None:
        plan_of = lambda c: c.plan(tensor_plan(model, batch) if structure is not None else None,
                                   expert_plan(model, experts) if experts else None)
        while True:  # until no bound skipped what the verified rows' fastest could lose to
            rows = verified(rows, verify, plan_of, verify_top)
            reopened = swept.reopen(rows)
            if not reopened:
                break
            rows = [reopened.get(c, r) for c, r in zip(candidate_list, rows)] + rows[len(candidate_list):]
    return SearchResult(target or f"{profile.name} ({devices} devices)", profile, rows, pick(rows))


def _fp8_rows(rows: Sequence[Row], profile: HardwareProfile, lower: Callable[[Candidate], Row], count: int) -> list[Row]:
    """The FP8 forms of the fastest `count` usable rows, listed only (FP8_LISTED); none where the profile
    has no FP8 peak (emulated CPUs compute FP8 by upcasting: nothing to gain) or the rows are FP8."""
    if "fp8" not in profile.peak_flops:
        return []
    best = sorted((r for r in rows if r.usable and r.candidate.precision != "fp8"),
                  key=lambda r: r.prediction.step_s)[:count]
    return [dataclasses.replace(lower(dataclasses.replace(r.candidate, precision="fp8")), listed_only=True,
                                reason=FP8_LISTED) for r in best]


def verified(rows: Sequence[Row], verify: Verify, plan_of: Callable[[Candidate], Plan],
             top: int = VERIFY_TOP) -> list[Row]:
    """`rows` with the best candidates verified (search(verify=...)): rounds of the `top` fastest
    usable unverified rows, until the pick is verified or no usable row is left."""
    rows = list(rows)
    while True:
        best = pick(rows)
        if best is None or best.verified is not None:
            return rows
        waiting = sorted((i for i, r in enumerate(rows) if r.usable and r.verified is None),
                         key=lambda i: rows[i].prediction.step_s)[:max(1, top)]
        for i in waiting:
            v = verify(rows[i], plan_of(rows[i].candidate))
            needs = listing.size(v.memory_bytes)
            reason = rows[i].reason if v.fits else f"compiled: needs {needs} > the device's memory"
            rows[i] = dataclasses.replace(rows[i], verified=v, reason=reason)


def compiled_step_cost(step, *batch) -> cost_model.StepCost:
    """The StepCost of a compiled TrainStep (explicit lowering) for `batch`: its program's FLOPs
    and collectives, and memory from XLA's memory analysis of the compiled step."""
    if step.options.lowering != "explicit":
        raise UnsupportedError("compiled_step_cost reads xtrain's emitted program; this step uses "
                               f"lowering={step.options.lowering!r}")
    rep = step.report(*batch)
    program = step.program(*batch)
    sizes = dict(step.mesh.shape)
    data_axes = step.layout.batch_axes
    memory = cost_model.memory_from_compiled(step.compiled(*batch), rep.state_memory,
                                             rep.memory.get("activations_host", 0))
    return cost_model.StepCost(flops=flops_mod.count(program), collectives=rep.collectives, mesh=sizes,
                               data_axes=data_axes, memory=memory, tokens=_tokens(batch))
