"""Layout resolution: from a plan, the mesh's axis sizes and the parameters' shapes to where every
tensor of the training state lives. The training step, the cost model (on an abstract mesh),
checkpoints and the report all read this one result; nothing re-derives it.

    batch       the batch spec: the plan's, else the mesh's data axis
    parameters  each parameter's spec: the plan's rules, then ZeRO-3's split over the data axes
    optimizer   ZeRO-1/2's split of the optimizer state over the data axes
    gradients   what the update consumes: ZeRO-2's shards, else the parameters' layout
    storage     block parameters stored stacked, (L, ...) per block position, for the layer
                scan (`resolve`); for a pipeline, each stage's layers on that stage, once the
                stage partition is known from the traced graph (`place_stages`)
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Hashable, Iterable, Mapping

from xtrain.errors import PlanError, UnsupportedError
from xtrain.ir.stacked import Stacking, family
from xtrain.sharding import zero
from xtrain.sharding.mesh import CONTEXT, DATA, EXPERT
from xtrain.sharding.offload import Offload
from xtrain.sharding.plan import Plan, Spec, axes_of

UNROLL_MAX_LAYERS = 3  # scan_layers="auto" unrolls up to this many layers (why: scan_layers_for)
# Mesh axes with data meaning: by default the batch is split over those the mesh has, in mesh
# order (model axes, such as `tensor` and `pipe`, never split it).
BATCH_AXES = (DATA,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StateLayout:
    """Where the training state lives for one plan on one mesh.

    Attributes:
        sizes: mesh axis sizes, in mesh order.
        batch_spec: spec of the leading dimensions of every batch argument.
        batch_args: (argument position, spec) pairs replacing batch_spec for those arguments.
        zero: the plan's ZeRO stage.
        layer_specs, layer_optimizer_specs: per parameter under its own (per-layer) name: the
            spec of the parameter (ZeRO-3 included) and of its optimizer state (ZeRO-1/2).
        stacking: which per-layer parameters are stored as one stacked array.
        param_specs, optimizer_specs: the same specs under the stored names.
        optimized: stored names of the parameters the optimizer updates (the rest are frozen).
        zero_whole: parameters ZeRO leaves whole (no dimension the data size divides).
        scan_layers: the repeated blocks run as one layer scan (else one after another).
        stage_starts: a placed pipeline's first layer of each virtual stage; None before.
        agreement: per-layer name -> the decisions that must agree for layers to share one
            stored array (shape, dtype, trainability, param group, specs).
        offload_optimizer: the optimizer state lives in host memory (Plan(offload="optimizer")).
    """

    sizes: Mapping[str, int]
    batch_spec: Spec
    zero: int
    layer_specs: Mapping[str, Spec]
    layer_optimizer_specs: Mapping[str, Spec]
    stacking: Stacking
    param_specs: Mapping[str, Spec]
    optimizer_specs: Mapping[str, Spec]
    optimized: frozenset[str]
    zero_whole: tuple[str, ...] = ()
    scan_layers: bool = True
    stage_starts: tuple[int, ...] | None = None
    agreement: Mapping[str, Hashable] = dataclasses.field(default_factory=dict)
    offload_optimizer: bool = False
    batch_args: tuple[tuple[int, Spec], ...] = ()
    # split over `expert` by expert parallelism (their experts dim): used where they are, never
    # gathered over it (any other tensor split over `expert` is a ZeRO-3 / FSDP shard over it)
    expert_weights: frozenset[str] = frozenset()

    def arg_spec(self, index: int) -> Spec:
        """The spec of batch argument `index`."""
        return dict(self.batch_args).get(index, self.batch_spec)

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (data parallel), major first."""
        return tuple(a for e in self.batch_spec for a in axes_of(e))

    @property
    def grad_specs(self) -> dict[str, Spec]:
        """Layout of the gradients the update consumes: ZeRO-2 reduces them straight to the
        optimizer-state shards."""
        return dict(self.optimizer_specs if self.zero == 2 else self.param_specs)

    def split_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axes stored parameter `name` is split over."""
        return tuple(a for e in self.param_specs[name] for a in axes_of(e))

    def grad_axes(self, name: str) -> tuple[str, ...]:
        """The batch axes the gradient of `name` is summed over (those it is not split over)."""
        return tuple(a for a in self.batch_axes if a not in self.split_axes(name))

    def zero_axes(self, name: str) -> tuple[str, ...]:
        """The batch axes a stored parameter is split over: a ZeRO-3 (FSDP) shard, gathered for use.
        Not `expert` for the expert weights: split over it they are used where they are (tokens
        travel to them); every other tensor's split over `expert` is ZeRO's or FSDP's, like `data`'s."""
        return tuple(a for a in self.split_axes(name) if a in self.batch_axes
                     and (a != EXPERT or name not in self.expert_weights))

    def replicated(self) -> list[str]:
        """Stored parameters whole on every device."""
        return [n for n, s in self.param_specs.items() if not any(s)]

    def unused_axes(self, pipe_axis: str | None = None) -> list[str]:
        """Mesh axes of size > 1 that split nothing (batch, parameters, optimizer state, pipeline
        stages): the devices along them compute the same thing."""
        used = set(self.batch_axes) | {pipe_axis}
        for spec in (*self.layer_specs.values(), *self.layer_optimizer_specs.values()):
            used.update(a for e in spec for a in axes_of(e))
        return [a for a, n in self.sizes.items() if n > 1 and a not in used]


def batch_spec(plan: Plan, sizes: Mapping[str, int]) -> Spec:
    """The plan's batch spec, validated against the mesh; by default the mesh's axes with data
    meaning (BATCH_AXES), major first; none on a mesh without one (every device then computes
    the whole batch). A `context` axis splits dimension 1, the sequence of (batch, sequence, ...)
    arguments (context parallelism; a plan names other dims with its batch spec)."""
    if plan.batch is not None:
        plan.check_batch(sizes)
        return tuple(plan.batch)
    axes = tuple(a for a in sizes if a in BATCH_AXES)
    lead = (axes[0] if len(axes) == 1 else axes) if axes else None
    if sizes.get(CONTEXT, 1) > 1:  # context parallelism: dim 1 of every batch argument is its sequence
        return (lead, CONTEXT)
    return (lead,) if axes else ()


def depth(names: Iterable[str]) -> int:
    """Layers of the deepest numbered family in `names` (blocks.0.*, blocks.1.*, ...); 0 if none."""
    layers: dict[str, set[int]] = defaultdict(set)
    for name in names:
        if (fam := family(name)) is not None:
            layers[fam[0]].add(fam[1])
    return max((len(v) for v in layers.values()), default=0)


def scan_layers_for(setting: bool | str, names: Iterable[str], platform: str, local_devices: int) -> bool:
    """compile(scan_layers=...) resolved: True/False as given; "auto" unrolls a model of at most
    UNROLL_MAX_LAYERS layers and scans deeper ones, except on a host emulating several CPU
    devices in one process, which scans. From 4 layers up the scan runs as fast as the unrolled
    blocks or faster (up to 1.29x at 12 layers) and compiles in constant time; at 2-3 layers the
    two are level, and unrolled blocks keep plain (not stacked) residuals and per-layer names.
    The measurements behind the rule: benchmarks/results/scan_layers.md."""
    if setting != "auto":
        return bool(setting)
    if platform == "cpu" and local_devices > 1:
        return True
    return depth(names) > UNROLL_MAX_LAYERS


def _agreement(shapes: Mapping, layer_specs, optimizer_specs, optimized, lr_groups) -> dict[str, Hashable]:
    return {n: (tuple(s.shape), str(s.dtype), n in optimized, (lr_groups or {}).get(n), tuple(layer_specs[n]),
                tuple(optimizer_specs[n])) for n, s in shapes.items()}


def resolve(plan: Plan, sizes: Mapping[str, int], shapes: Mapping, *, optimized: Iterable[str],
            lr_groups: Mapping[str, int] | None, scan_layers: bool) -> StateLayout:
    """The state layout of `plan` on a mesh of axis `sizes`.

    Args:
        shapes: every parameter's global shape and dtype (jax.ShapeDtypeStruct), per layer.
        optimized: the parameters the optimizer updates.
        lr_groups: the torch param group of each optimized parameter; None for an optax
            transformation given by the user, whose parameters are never stored stacked (it may
            depend on the parameter tree's structure; JAX code scans its own stacked parameters).
        scan_layers: the repeated blocks run as one layer scan, which reads block parameters
            stored stacked. A pipeline stores them per layer until `place_stages`.
    """
    sizes, optimized = dict(sizes), frozenset(optimized)
    spec = batch_spec(plan, sizes)
    data_axes = tuple(a for e in spec for a in axes_of(e))
    dims = {n: tuple(s.shape) for n, s in shapes.items()}
    planned = plan.param_specs(dims, sizes)
    params, optimizer, whole = zero.specs_for_stage(dims, planned, sizes, data_axes, plan.zero)
    experts = [n for n, spec in planned.items() if EXPERT in {a for e in spec for a in axes_of(e)}]
    agreement = _agreement(shapes, params, optimizer, optimized, lr_groups)
    stack = scan_layers and plan.pipeline is None and lr_groups is not None
    stacking = Stacking.find(shapes, agreement.get) if stack else Stacking({})
    _check_batch_args(plan, spec, sizes)
    out = StateLayout(sizes=sizes, batch_spec=spec, batch_args=plan.batch_args, zero=plan.zero, layer_specs=params,
                      layer_optimizer_specs=optimizer, stacking=stacking, param_specs=stacking.stack_specs(params),
                      optimizer_specs=stacking.stack_specs(optimizer),
                      optimized=frozenset(stacking.stored_names(optimized)), zero_whole=tuple(whole),
                      scan_layers=scan_layers, agreement=agreement,
                      offload_optimizer=plan.offload is Offload.OPTIMIZER,
                      expert_weights=frozenset(experts) | frozenset(stacking.stored_names(experts)))
    _check_mesh_used(out, plan)
    return out


def _check_mesh_used(layout: StateLayout, plan: Plan) -> None:
    """The default plan on a mesh without a data axis whose axes split nothing is a mistake:
    every device would compute the whole batch with the whole model (`Mesh(dp=8)`: the default
    plan splits the batch over `data`). The batch is never split over an axis guessed from its
    name. Other unused axes (`Mesh(data=2, rest=4)`, a batch spec given) are the report's note,
    but for `context`, whose name promises a split of the sequence xtrain does not make."""
    _check_context_used(layout, plan)
    if plan.batch is not None or any(a in BATCH_AXES for a in layout.sizes):
        return
    unused = layout.unused_axes(plan.pipeline.axis if plan.pipeline is not None else None)
    if not unused or len(unused) < sum(n > 1 for n in layout.sizes.values()):
        return
    axes = lambda rename: ", ".join(f"{rename.get(a, a)}={n}" for a, n in layout.sizes.items())
    raise PlanError(f"Mesh({axes({})}) has no {DATA!r} axis, and the default plan splits only the batch, over "
                    f"{DATA!r}: every device would compute the whole batch with the whole model. Name the "
                    f"data-parallel axis {DATA!r} (xtrain.Mesh({axes({unused[0]: DATA})})), say which axes split the "
                    f"batch (xtrain.Plan(batch=({unused[0]!r},))), or give a plan that splits parameters over them "
                    "(xtrain.plans.megatron, fsdp)")


def _check_batch_args(plan: Plan, spec: Spec, sizes: Mapping[str, int]) -> None:
    """Per-argument specs split over the batch spec's axes only (they split the same batch)."""
    allowed = {a for e in spec for a in axes_of(e)}
    if plan.batch_args and plan.pipeline is not None:
        raise UnsupportedError("Plan(batch_args=...) with pipeline parallelism is not implemented; give every batch "
                               "argument the batch spec (Plan(batch=...))")
    for index, arg in plan.batch_args:
        extra = sorted({a for e in arg for a in axes_of(e)} - allowed)
        if extra:
            raise PlanError(f"Plan(batch_args={{{index}: {arg}}}): mesh axes {extra} are not in the batch spec "
                            f"{spec}; a batch argument splits over the batch spec's axes only (e.g. the sequence "
                            f"of a mask over {CONTEXT!r} with the default batch spec {(DATA, CONTEXT)})")


def _check_context_used(layout: StateLayout, plan: Plan) -> None:
    """A `context` axis splits the sequence (the default batch spec); a plan whose batch spec
    leaves it unused is an error naming the fix."""
    n = layout.sizes.get(CONTEXT, 1)
    if CONTEXT not in layout.unused_axes(plan.pipeline.axis if plan.pipeline is not None else None):
        return
    others = {a: s for a, s in layout.sizes.items() if a != CONTEXT}
    without = ", ".join(f"{a}={s}" for a, s in others.items()) or f"{DATA}=1"
    raise PlanError(f"mesh axis {CONTEXT!r} (size {n}): the plan's batch spec {tuple(plan.batch)} does not split "
                    f"the sequence over it and the plan uses {CONTEXT!r} for nothing else, so its {n} devices would "
                    f"each compute the whole sequence. Split the sequence (dimension 1 of the batch arguments) over "
                    f"it: xtrain.Plan(batch=({DATA!r}, {CONTEXT!r})) (the default plan does), or drop the axis "
                    f"(xtrain.Mesh({without}))")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StagePlacement:
    """Which layers each pipeline stage runs, as the lowering found them in the traced graph.

    Attributes:
        layer_params: per layer, its parameters in block order (position k is the same tensor
            of every layer).
        read_outside: block parameters the graph also reads outside the blocks (tied weights).
        rows: the layer each stored row holds, stage 0's layers first (None: a padding row).
        starts: the first layer of each virtual stage.
        axis: the pipeline's mesh axis, which the rows are split over.
    """

    layer_params: tuple[tuple[str, ...], ...]
    read_outside: frozenset[str]
    rows: tuple[int | None, ...]
    starts: tuple[int, ...]
    axis: str


def place_stages(layout: StateLayout, placement: StagePlacement) -> StateLayout:
    """`layout` with each block parameter position stored as one array whose rows are the
    layers of stage 0, then stage 1, ..., rows split over the pipeline axis: a stage stores,
    updates and checkpoints only its own layers. Positions whose layers disagree (spec,
    optimizer group, trainability) or that the graph also reads outside the blocks stay per
    layer, whole on every stage."""
    groups = {}
    for members in zip(*placement.layer_params):
        fams = [family(m) for m in members]
        if any(f is None or f != (fams[0][0], k) for k, f in enumerate(fams)):
            continue
        if set(members) & placement.read_outside or len({layout.agreement[m] for m in members}) > 1:
            continue
        groups[fams[0][0]] = tuple(members)
    stacking = Stacking(groups, {n: placement.rows for n in groups}, placement.axis)
    per_layer = layout.stacking.member_names(layout.optimized)
    return dataclasses.replace(layout, stacking=stacking, param_specs=stacking.stack_specs(layout.layer_specs),
                               optimizer_specs=stacking.stack_specs(layout.layer_optimizer_specs),
                               optimized=frozenset(stacking.stored_names(per_layer)), stage_starts=placement.starts)
