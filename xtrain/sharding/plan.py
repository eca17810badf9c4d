"""Plans: which mesh axes split which tensors.

Parameter rules are keyed by glob patterns over torch module paths (`fnmatch` syntax:
`*` matches any run of characters, dots included), e.g. `"blocks.*.mlp.fc_in.weight"`.
A spec has one entry per tensor dimension: a mesh axis name, a tuple of axis names,
`Segments(axes, sizes)` (a fused dimension split per segment) or None (that dimension is not split).
"""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any, Callable, Mapping, Sequence, Union

from xtrain.errors import PlanError
from xtrain.ir.trace_options import TraceOptions
from xtrain.sharding.context_parallel import ContextParallel
from xtrain.sharding.fallback import Fallback, FallbackPolicy
from xtrain.sharding.mesh import CONTEXT
from xtrain.sharding.offload import Offload
from xtrain.sharding.pipeline import Pipeline, pipeline
from xtrain.sharding.precision import Precision
from xtrain.sharding.remat import LayerRemat, Remat
from xtrain.sharding.segments import Segments

AxisEntry = Union[str, tuple[str, ...], Segments, None]
Spec = tuple[AxisEntry, ...]


def axes_of(entry: AxisEntry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, Segments):
        return entry.axes
    return (entry,) if isinstance(entry, str) else tuple(entry)


def partition_entry(entry: AxisEntry):
    """`entry` as a PartitionSpec entry: a per-segment split is stored as a contiguous one
    (in segment-interleaved order, xtrain.sharding.segments)."""
    return (entry.axes[0] if len(entry.axes) == 1 else entry.axes) if isinstance(entry, Segments) else entry


def _normalize(spec: Sequence[AxisEntry] | str | None) -> Spec:
    if spec is None:
        return ()
    if isinstance(spec, str):
        return (spec,)
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """How a model is split over a mesh.

    Attributes:
        params: glob pattern over parameter names -> spec. A parameter matched by no rule is
            replicated; a rule that matches no parameter is an error. When several rules match
            one parameter, the first one wins.
        batch: spec of the leading dimensions of every batch argument. None means "the mesh's
            `data` axis when it has one", and a `context` axis on dimension 1, the sequence
            (xtrain.sharding.layout.batch_spec).
        batch_args: per-argument specs (argument position -> spec) replacing `batch` for those
            arguments, with the axes of the batch spec only: e.g. {1: ("data", None, "context")}
            for a (batch, 1, L, S) attention mask passed second, whose sequence is dimension 2.
        notes: why a preset (`xtrain.plans`) chose what it did: tensors it kept whole and the
            reason, splits that are correct but not the textbook layout. Informational only.
        zero: ZeRO stage over the batch (data-parallel) axes. 0: replicated optimizer state;
            1: optimizer state split; 2: also gradients reduce-scattered; 3: also parameters
            split (gathered per use). Tensors with no dimension divisible by the data size
            stay whole (the report lists them).
        precision: the mixed-precision policy: "fp32", "bf16", "fp16" or an
            `xtrain.Precision(...)` with per-module overrides (see xtrain.sharding.precision).
        remat: activation checkpointing per layer of the layer scan (explicit lowering):
            "off", "full" (keep only each layer's input; True means this), "dots" (keep matmul
            outputs) or "selective" (keep the activations of the modules `remat_keep` names),
            or a JAX checkpoint policy (a callable `policy(prim, *avals, **params) -> bool`, e.g.
            `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`): each layer saves what
            it saves (`plan.remat` then reads "policy", `plan.remat_policy` holds it).
        remat_keep: remat="selective": fnmatch patterns over module paths, e.g. ("blocks.*.attn",).
        pipeline: pipeline parallelism (stages, microbatches, schedule, split); set it with
            `plan.with_pipeline(...)`. None: no pipeline.
        offload: "optimizer" keeps the optimizer state in host memory between steps,
            "activations" what each layer of the layer scan saves for the backward pass (its
            input; with remat="dots"/"selective" also what those keep) (xtrain.sharding.offload);
            "none" (default) keeps everything on the device.
        capacity_factor: MoE layers (explicit lowering): each expert takes at most
            ceil(tokens x top_k / experts x capacity_factor) of one device's (token, expert) pairs,
            the rest are dropped (their expert output is zero; `step(...)["expert_dropped"]`
            counts them) and expert parallel's all-to-all buffers shrink to that capacity.
            None (default): drop-free, as torch computes.
        router_bias_rate: auxiliary-loss-free load balancing of MoE layers (DeepSeek-V3): after
            each step every expert's selection bias (the router's `e_score_correction_bias`
            buffer, as HF DeepSeek-V3 has it) moves by this rate towards balance, up for an
            expert below the mean load, down above it (xtrain.lowering.router_bias); e.g. 1e-3.
            None (default): the buffer stays as torch leaves it.
        fallback: what a split operand reaching a primitive without a partition rule does
            (xtrain.sharding.fallback): "error" (default: the first step raises
            UnsupportedOpError naming the op, module, split and the bytes a replicated run
            gathers) or "replicate" (gathered and run whole on every device; the report and the
            cost model show and charge the gathers).
        fallback_modules: fnmatch patterns over module paths where "replicate" is allowed while
            the plan's `fallback` stays "error", e.g. ("model.fft_mixer",).
        context: how attention runs over a sequence split along the mesh axis `context`
            (xtrain.sharding.context_parallel): "ring" (default), "ulysses" (all-to-all to a
            head split) or `xtrain.ContextParallel(ulysses=U)` (Ulysses in groups of U, a ring
            over the groups).
        trace: how the front end traces the model for this plan (xtrain.ir.trace_options):
            Megatron's head split and sequence-parallel blocks (`xtrain.plans.megatron` sets
            them). Default: as torch computes it.
    """

    params: Mapping[str, Sequence[AxisEntry]] = dataclasses.field(default_factory=dict)
    batch: Sequence[AxisEntry] | str | None = None
    batch_args: Mapping[int, Sequence[AxisEntry]] | tuple = ()
    notes: tuple[str, ...] = ()
    zero: int = 0
    precision: Precision | str = "fp32"
    remat: Remat | str | bool | Callable = "off"
    remat_keep: tuple[str, ...] = ()
    remat_policy: Callable | None = None
    pipeline: Pipeline | None = None
    offload: Offload | str = "none"
    capacity_factor: float | None = None
    router_bias_rate: float | None = None
    fallback: Fallback | str = "error"
    fallback_modules: tuple[str, ...] = ()
    context: ContextParallel | str = "ring"
    trace: TraceOptions = TraceOptions()

    def with_pipeline(self, stages: int, microbatches: int, schedule: str = "1f1b",
                      split: Sequence[str] | str = "auto", virtual_stages: int = 1, axis: str = "pipe",
                      checkpoint: bool = False) -> "Plan":
        """This plan with pipeline parallelism over mesh axis `axis` (see xtrain.sharding.pipeline.Pipeline)."""
        return dataclasses.replace(self, pipeline=pipeline(stages, microbatches, schedule, split,
                                                           virtual_stages, axis, checkpoint))

    def __post_init__(self):
        object.__setattr__(self, "precision", Precision.of(self.precision))
        object.__setattr__(self, "offload", Offload.of(self.offload))
        object.__setattr__(self, "context", ContextParallel.of(self.context))
        self._check_remat()
        self._check_fallback()
        if self.zero not in (0, 1, 2, 3):
            raise PlanError(f"Plan(zero={self.zero!r}): the ZeRO stage must be 0, 1, 2 or 3")
        object.__setattr__(self, "params", {k: _normalize(v) for k, v in self.params.items()})
        if self.batch is not None:
            object.__setattr__(self, "batch", _normalize(self.batch))
        args = self.batch_args.items() if isinstance(self.batch_args, Mapping) else self.batch_args
        object.__setattr__(self, "batch_args", tuple(sorted((int(i), _normalize(s)) for i, s in args)))
        object.__setattr__(self, "notes", tuple(self.notes))
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise PlanError(f"Plan(capacity_factor={self.capacity_factor!r}): give a positive factor (e.g. 1.25), "
                            "or None for drop-free MoE layers")
        if self.router_bias_rate is not None and not self.router_bias_rate > 0:
            raise PlanError(f"Plan(router_bias_rate={self.router_bias_rate!r}): give a positive rate (DeepSeek-V3 "
                            "used 1e-3), or None to leave the routers' selection bias as it is")

    def _check_remat(self) -> None:
        if callable(self.remat) and not isinstance(self.remat, Remat):
            object.__setattr__(self, "remat_policy", self.remat)
            object.__setattr__(self, "remat", Remat.POLICY)
        remat = {True: "full", False: "off"}[self.remat] if isinstance(self.remat, bool) else self.remat
        try:
            object.__setattr__(self, "remat", Remat(remat))
        except ValueError:
            raise PlanError(f"Plan(remat={self.remat!r}) must be one of {[r.value for r in Remat]}") from None
        keep = (self.remat_keep,) if isinstance(self.remat_keep, str) else tuple(self.remat_keep)
        object.__setattr__(self, "remat_keep", keep)
        if (self.remat is Remat.POLICY) != callable(self.remat_policy):
            raise PlanError(f"Plan(remat={self.remat.value!r}): pass the JAX checkpoint policy itself, "
                            "Plan(remat=jax.checkpoint_policies.dots_saveable), not the word 'policy'"
                            if self.remat is Remat.POLICY else f"Plan(remat_policy=...) needs remat=<that policy>, "
                            f"not remat={self.remat.value!r}")
        if self.remat is Remat.POLICY and self.offload is Offload.ACTIVATIONS:
            raise PlanError("Plan(remat=<policy>, offload='activations'): a policy callable decides what stays on "
                            "the device; offloading needs names (remat='full', 'dots' or 'selective')")
        if (self.remat is Remat.SELECTIVE) != bool(keep):
            raise PlanError(f"Plan(remat={self.remat.value!r}, remat_keep={keep!r}): remat='selective' needs "
                            "remat_keep=(module-path patterns, e.g. 'blocks.*.attn'), and only it uses them")

    def _check_fallback(self) -> None:
        try:
            object.__setattr__(self, "fallback", Fallback(self.fallback))
        except ValueError:
            raise PlanError(f"Plan(fallback={self.fallback!r}) must be one of {[f.value for f in Fallback]}") from None
        modules = self.fallback_modules
        object.__setattr__(self, "fallback_modules", (modules,) if isinstance(modules, str) else tuple(modules))

    def fallback_policy(self) -> FallbackPolicy:
        """Where a primitive without a rule may run replicated (xtrain.sharding.fallback)."""
        return FallbackPolicy(self.fallback, self.fallback_modules)

    def layer_remat(self) -> LayerRemat | None:
        """What the layer scan checkpoints, or None. Offloaded activations checkpoint each
        layer (remat='off' then means 'full': only the layer's input is saved, on the host)."""
        if self.offload is Offload.ACTIVATIONS:
            mode = Remat.FULL if self.remat is Remat.OFF else self.remat
            return LayerRemat(mode, self.remat_keep, offload=True)
        return None if self.remat is Remat.OFF else LayerRemat(self.remat, self.remat_keep, policy=self.remat_policy)

    def __str__(self) -> str:
        """One line per rule, then the notes: what `print(plan)` shows."""
        batch = "default (the mesh's 'data' axis)" if self.batch is None else tuple(self.batch)
        mixed = "" if self.precision.compute.value == "fp32" else f", precision={self.precision.compute.value}"
        remat = "" if self.remat.value == "off" else f", remat={self.remat.value}"
        offload = "" if self.offload is Offload.NONE else f", offload={self.offload.value}"
        fallback = "" if self.fallback_policy() == FallbackPolicy() else ", " + self.fallback_policy().setting
        lines = [f"Plan(batch={batch}, zero={self.zero}{mixed}{remat}{offload}{fallback})"]
        if self.pipeline is not None:
            lines.append(f"  {self.pipeline}")
        width = max((len(p) for p in self.params), default=0)
        lines += [f"  {p:<{width}}  {tuple(s)}" for p, s in self.params.items()] or ["  (every parameter replicated)"]
        lines += [f"  note: {n}" for n in self.notes]
        if not self.trace.is_default:
            lines.append(f"  trace: {self.trace}")
        return "\n".join(lines)

    def trace_options(self, mesh_axes: Mapping[str, int], lowering: str) -> TraceOptions:
        """The trace options of a step of this plan on a mesh of `mesh_axes` lowered by
        `lowering`: the plan's own, plus why the fused kernels are ruled out there. Under
        Ulysses over the whole `context` axis the fused kernels (cuDNN, NKI) see whole sequences
        and may run."""
        context = mesh_axes.get(CONTEXT, 1)
        ulysses = self.context.degrees(context)[0] if context > 1 else 1
        whole = context > 1 and ulysses == context
        no_cudnn = "" if context == 1 or whole else \
            f"the sequence is split over {CONTEXT!r} (ring attention runs the blockwise kernel)"
        # a fused kernel runs in the compute dtype, as the policy's matmuls do; with fp32_modules the
        # blockwise kernel (narrowed per module by the policy) keeps attention inside them float32
        autocast = "" if self.precision.compute.value == "fp32" or self.precision.fp32_modules else \
            self.precision.dtype.name
        return dataclasses.replace(self.trace, no_nki=no_nki(mesh_axes, lowering, whole), no_cudnn=no_cudnn,
                                   ulysses=ulysses if whole else 1, autocast=autocast)

    def check_batch(self, mesh_axes: Mapping[str, int]) -> None:
        """Fails when `batch` names an axis the mesh lacks (or one twice)."""
        if self.batch is not None:
            _check_axes("batch", self.batch, mesh_axes, rule="Plan(batch=...)")

    def param_specs(self, shapes: Mapping[str, tuple[int, ...]], mesh_axes: Mapping[str, int]) -> dict[str, Spec]:
        """Spec of every parameter (empty tuple = replicated), validated against shapes and mesh."""
        specs: dict[str, Spec] = {}
        used: set[str] = set()
        for name, shape in shapes.items():
            for pattern, spec in self.params.items():
                if fnmatch.fnmatchcase(name, pattern):
                    _check_param(name, shape, spec, mesh_axes, pattern)
                    specs[name] = spec
                    used.add(pattern)
                    break
            else:
                specs[name] = ()
        unused = [p for p in self.params if p not in used]
        if unused:
            sample = ", ".join(list(shapes)[:6])
            raise PlanError(
                f"Plan rule(s) {unused} match no parameter; parameter names look like: {sample}, ... "
                "(patterns are fnmatch globs over torch parameter names)")
        return specs


@dataclasses.dataclass(frozen=True, kw_only=True)
class PendingPlan(Plan):
    """A plan whose parameter rules are derived from the traced program (xtrain.plans.megatron
    without `example=`): the step derives them at its first call, from the first batch's shapes.
    Rules in `params` (a user's, added with dataclasses.replace) win over the derived ones.

    Attributes:
        derive: (model, batch) -> the derived Plan (its params and notes are taken).
    """

    derive: Callable[[Any, tuple], Plan] | None = None

    def resolved(self, model, batch: tuple) -> Plan:
        """The plan for `model` (xtrain.ir.Model) traced on `batch`: the derived rules after this
        plan's own, which win."""
        derived = self.derive(model, batch)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(Plan)}
        notes = [f"user rule {p!r}: {tuple(s)} wins over the derived rules" for p, s in self.params.items()]
        return Plan(**{**fields, "params": {**self.params, **{k: v for k, v in derived.params.items()
                                                                 if k not in self.params}},
                       "notes": tuple(notes) + derived.notes + self.notes, "trace": derived.trace})

    def param_specs(self, shapes, mesh_axes) -> dict[str, Spec]:
        raise PlanError("this plan's tensor-parallel rules are derived from the program traced on the first batch "
                        "(xtrain.plans.megatron without example=): they exist after the step's first call; pass "
                        "example=<a batch> to plans.megatron to derive them now")

    def __str__(self) -> str:
        first, *rest = Plan.__str__(self).replace("  (every parameter replicated)\n", "").split("\n")
        rest = [r for r in rest if r != "  (every parameter replicated)"]
        return "\n".join([first, "  pending: the tensor-parallel rules are derived from the program traced at the "
                           "step's first call (plans.megatron(..., example=batch) derives them now)", *rest])


def no_nki(mesh_axes: Mapping[str, int], lowering: str, ulysses: bool = False) -> str:
    """Why a step's attention must not use Neuron's NKI kernels ("" when it may): a sequence split
    over `context` runs ring attention (blockwise), unless Ulysses over the whole axis (`ulysses`)
    gives each device whole sequences; XLA's partitioner sees the kernel call as opaque and would
    gather its operands onto every device."""
    if mesh_axes.get(CONTEXT, 1) != 1 and not ulysses:
        return f"the sequence is split over {CONTEXT!r} (ring attention runs the blockwise kernel)"
    if lowering != "explicit":
        return f"lowering={lowering!r} (XLA's partitioner cannot split the kernel call)"
    return ""


def _check_axes(what: str, spec: Spec, mesh_axes: Mapping[str, int], rule: str) -> None:
    seen: list[str] = []
    for entry in spec:
        for axis in axes_of(entry):
            if axis not in mesh_axes:
                raise PlanError(
                    f"{rule} splits {what} over mesh axis {axis!r}, which the mesh "
                    f"({', '.join(f'{k}={v}' for k, v in mesh_axes.items())}) does not have")
            if axis in seen:
                raise PlanError(f"{rule} uses mesh axis {axis!r} twice for {what}")
            seen.append(axis)


def _check_param(name: str, shape: tuple[int, ...], spec: Spec, mesh_axes: Mapping[str, int], pattern: str) -> None:
    rule = f"Plan rule {pattern!r}: {tuple(spec)}"
    if len(spec) > len(shape):
        raise PlanError(
            f"{rule} has {len(spec)} entries but parameter {name} has shape {tuple(shape)} "
            f"({len(shape)} dims); give at most one entry per dimension")
    _check_axes(f"parameter {name}", spec, mesh_axes, rule)
    for dim, entry in enumerate(spec):
        size = 1
        for axis in axes_of(entry):
            size *= mesh_axes[axis]
        if isinstance(entry, Segments):
            entry.check(shape[dim], size, f"{rule}: dimension {dim} of parameter {name} (shape {tuple(shape)})")
        if shape[dim] % size:
            raise PlanError(
                f"{rule}: dimension {dim} of parameter {name} (shape {tuple(shape)}) has size "
                f"{shape[dim]}, not divisible by {entry}={size}; split another dimension or leave it whole")
