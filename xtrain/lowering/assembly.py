"""Assembly: one pure function from (what trains, plan, mesh, options, batch shapes) to a built step.

Every consumer of a training step calls `assemble`: the compiled step users run
(xtrain.step.TrainStep), the cost model's abstract step on an AbstractMesh (xtrain.cost.program),
hence the plan search and `plan="auto"`, and ahead-of-time compiles. None of them re-derives any
part of it. In order:

  1. the model traced as the plan asks (its trace options: GQA head split, sequence-parallel
     blocks, kernels ruled out; xtrain.ir.trace_options), then under the precision policy
     (matmuls in the compute dtype: lowering.precision)
  2. a mesh axis named `expert` splits the MoE experts (sharding.experts)
  3. the state layout: every tensor's spec, ZeRO, which block families are stored stacked
     (sharding.layout.resolve)
  4. a pipeline's stages: the model traced once at the batch's shapes, its layers balanced over
     the stages and stored on the stage that runs them (lowering.pipeline.program.placement)
  5. the state's shapes and shardings on the mesh
  6. the lowering (lowering.lower): the jit-compiled step, traced at its first call

Nothing here reads a value: a built step holds shapes, specs and a program, so a model on the
meta device and a mesh of devices that are not present assemble like any other.

Traces are observable through `jax.monitoring` events (TRACE_EVENT and PLACEMENT_EVENT, with the
model's name), e.g. to check that a step traces once per batch signature.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax

from xtrain.errors import NotBuiltError, PlanError
from xtrain.ir import stacked
from xtrain.ir.model import Model, Trainable
from xtrain.lowering import precision
from xtrain.lowering import state as state_mod
from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.lowering.gradient_sync import GradSync
from xtrain.lowering.lower import check as lowering_check
from xtrain.lowering.lower import lower
from xtrain.lowering.options import StepOptions
from xtrain.lowering.pipeline import schedule
from xtrain.lowering.pipeline.program import placement
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import PLACEMENT_EVENT, TRACE_EVENT, StepConfig, StepProgram
from xtrain.sharding import layout as layout_mod
from xtrain.sharding.experts import expert_parallel
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.mesh import CONTEXT
from xtrain.sharding.plan import Plan
from xtrain.sharding.remat import LayerRemat

__all__ = ["AssemblyOptions", "BuiltStep", "PLACEMENT_EVENT", "TRACE_EVENT", "Target", "assemble", "check",
           "lrs_shape", "relowered", "shaped"]

_PLAN_REMAT = "plan"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """Where the step will run, as far as the assembly cares.

    Attributes:
        platform: "cpu", "cuda" or "neuron" (scan_layers="auto" reads it).
        local_devices: devices of one process (a host emulating several CPU devices scans).
    """

    platform: str = "cpu"
    local_devices: int = 1

    @classmethod
    def of(cls, mesh) -> "Target":
        """The target of a mesh of devices present here ("gpu" devices: "cuda")."""
        platform = mesh.devices.flat[0].platform
        return cls(platform="cuda" if platform == "gpu" else platform, local_devices=jax.local_device_count())

    @classmethod
    def default(cls, mesh) -> "Target":
        """The mesh's devices, or a CPU host for an AbstractMesh."""
        return cls.of(mesh) if isinstance(mesh, jax.sharding.Mesh) else cls()


@dataclasses.dataclass(frozen=True, kw_only=True)
class AssemblyOptions:
    """What `xtrain.compile` was given that shapes the step (its docstring says each).

    Attributes:
        lowering: "explicit" or "xla" (XLA's partitioner on the same layout).
        grad_sync: bucketing, wire dtype, hierarchy of the gradient sync; None: the plan's wire dtype.
        scan_layers: True, False or "auto" (sharding.layout.scan_layers_for).
        regather: ZeRO-3 gathers each weight again in the backward pass.
        step: accumulation, clipping, input checks and the other per-step options.
    """

    lowering: str = "explicit"
    grad_sync: GradSync | None = None
    scan_layers: bool | str = "auto"
    regather: bool = True
    step: StepOptions = StepOptions()


@dataclasses.dataclass(frozen=True)
class BuiltStep:
    """A step assembled for one plan and mesh: everything but the state's values.

    Attributes:
        plan: the plan as built (an `expert` axis resolved into it).
        mesh: the jax Mesh (or AbstractMesh) it runs on.
        layout: every tensor's spec; stage placement done for a pipeline.
        model: the model as the step stores it (precision policy, stacked block families).
        state: the TrainState's shapes (jax.ShapeDtypeStruct leaves).
        shardings: the TrainState's shardings on `mesh`.
        config: what the step skeleton was built with.
        program: the jit-compiled step (`train`, `eval`), traced at its first call.
    """

    plan: Plan
    mesh: object
    layout: StateLayout
    model: Model
    state: TrainState
    shardings: TrainState
    config: StepConfig
    program: StepProgram
    lowering: str = "explicit"

    @property
    def placed_state(self) -> TrainState:
        """The state's shapes with their shardings (memory kinds included): what the step is
        traced with, on devices or on an AbstractMesh."""
        return jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where),
                            self.state, self.shardings)

    @property
    def table(self) -> schedule.Table | None:
        """A pipeline's schedule table (which stage runs which microbatch at each tick); None without."""
        pipe = self.plan.pipeline
        if pipe is None:
            return None
        return schedule.build(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual_stages)

    @property
    def bubble(self) -> float:
        """A pipeline schedule's idle share of (tick, stage) slots; 0 without a pipeline."""
        table = self.table
        return table.bubble() if table is not None else 0.0


def assemble(trainable: Trainable, plan: Plan, mesh, options: AssemblyOptions = AssemblyOptions(), *,
             batch: tuple | None = None, target: Target | None = None) -> BuiltStep:
    """Builds the training step of `trainable` for `plan` on `mesh`.

    Args:
        trainable: the model and its optimizer (xtrain.ir.model.Trainable).
        plan: how tensors are split over the mesh.
        mesh: a jax.sharding.Mesh, or an AbstractMesh for a mesh that is not here.
        options: the compile options that shape the step.
        batch: the global batch (arrays or jax.ShapeDtypeStruct): needed by a pipeline plan,
            whose stages are balanced on the model traced at these shapes; unread otherwise.
        target: where it runs (default: the mesh's devices, or a CPU host for an AbstractMesh).

    Returns:
        The built step; nothing is placed or compiled yet.
    """
    target = target or Target.default(mesh)
    plan, model, layout = _resolved(trainable, plan, mesh, options, target)
    if plan.pipeline is not None:
        layout = _placed_stages(model, mesh, layout, plan, batch)
    model = stacked.stored_model(model, layout.stacking)
    config = _config(trainable, plan, options, layout, target)
    state = _state_shapes(model, layout, trainable.tx, plan, config.sync)
    shardings = state_mod.shardings(state, layout, mesh)
    program = lower(model, mesh, layout, shardings, config, lowering=options.lowering, pipeline=plan.pipeline)
    return BuiltStep(plan, mesh, layout, model, state, shardings, config, program, options.lowering)


def check(trainable: Trainable, plan: Plan, mesh, options: AssemblyOptions = AssemblyOptions(), *,
          target: Target | None = None) -> None:
    """Raises what `assemble` would raise before it needs the batch: a plan, a mesh or options
    that cannot work (what a step deferred to its first call checks at compile)."""
    target = target or Target.default(mesh)
    plan, _, layout = _resolved(trainable, plan, mesh, options, target)
    lowering_check(mesh, layout, _config(trainable, plan, options, layout, target), lowering=options.lowering,
                   pipeline=plan.pipeline)


def check_remat_has_blocks(model: Model, plan: Plan) -> None:
    """Per-layer activation checkpointing needs repeated blocks (`layers.0`, `layers.1`, ...).
    Whether they are identical needs the trace; whether the model has numbered sibling modules
    at all is known from its module paths, so a model without any is refused at compile."""
    remat, paths = plan.layer_remat(), model.module_paths()
    if remat is None or not paths:  # a JAX function has no module paths: the trace decides
        return
    children = {p.rpartition(".")[0] for p in paths if p.rpartition(".")[2] == "1"}
    if not any((f"{prefix}.0" if prefix else "0") in paths for prefix in children):
        raise PlanError(f"{remat.setting} checkpoints each layer of the model's repeated blocks, but "
                        f"{getattr(model, 'name', 'the model')} has no numbered sibling modules (blocks.0, blocks.1, "
                        "...) to repeat; use remat='off'" + (" and offload='none'" if remat.offload else ""))


def _resolved(trainable: Trainable, plan: Plan, mesh, options: AssemblyOptions,
              target: Target) -> tuple[Plan, Model, StateLayout]:
    """Steps 1-3: the plan with its expert split, the model under the precision policy, the layout."""
    if options.lowering == "explicit":  # the other lowering refuses per-layer remat outright (lower.check)
        check_remat_has_blocks(trainable.model, plan)
    sizes = dict(mesh.shape)
    _check_context(plan, sizes)
    _check_schedule(plan, target)
    traced = trainable.model.specialised(plan.trace_options(sizes, options.lowering))  # head split, kernels
    model = precision.apply_policy(traced, plan.precision)
    shapes = model.param_shapes()
    plan = expert_parallel(plan, trainable.experts, sizes, {n: tuple(s.shape) for n, s in shapes.items()},
                           getattr(trainable.model, "name", "the model"))
    scan = layout_mod.scan_layers_for(options.scan_layers, shapes, target.platform, target.local_devices)
    layout = layout_mod.resolve(plan, sizes, shapes, optimized=trainable.optimized,
                                lr_groups=trainable.lr_groups, scan_layers=scan)
    return plan, model, layout


def _check_schedule(plan: Plan, target: Target) -> None:
    """A zero-bubble schedule branches per stage (lax.switch): Trainium runs no conditionals. Delayed
    FP8 scaling's histories are not carried through a pipeline's stages."""
    pipe = plan.pipeline
    if pipe is not None and plan.precision.delayed:
        raise PlanError("Precision(scaling='delayed') records each FP8 weight's amax history as training state, "
                        "which the pipeline step does not carry through its stages yet: use scaling='current' "
                        "with Pipeline(...), or no pipeline")
    if pipe is not None and pipe.schedule in schedule.ZERO_BUBBLE and target.platform == "neuron":
        raise PlanError(f"Pipeline(schedule={pipe.schedule!r}) branches on what each stage does at each tick, and "
                        "Trainium (Neuron) runs no conditionals: use schedule='1f1b' or 'interleaved' there")


def _check_context(plan: Plan, sizes: dict[str, int]) -> None:
    """Plan(context=...) asks for Ulysses: the mesh has a `context` axis its group size divides."""
    if plan.context.ulysses == 1:
        return
    if sizes.get(CONTEXT, 1) == 1:
        raise PlanError(f"Plan(context={plan.context.name!r}) runs attention over the mesh axis {CONTEXT!r}, which "
                        f"this mesh ({sizes}) lacks; add it (e.g. Mesh(data=2, context=4)) or use context='ring'")
    plan.context.degrees(sizes[CONTEXT])


def relowered(built: BuiltStep, *, remat: LayerRemat | None) -> StepProgram:
    """`built`'s program with another activation checkpointing policy (same layout, same state):
    what a report compares the plan's policy with."""
    config = dataclasses.replace(built.config, remat=remat)
    return lower(built.model, built.mesh, built.layout, built.shardings, config, lowering=built.lowering,
                 pipeline=built.plan.pipeline)


def lrs_shape(trainable: Trainable) -> jax.ShapeDtypeStruct:
    """The per-step learning rates' shape: one per torch param group (none for optax's own lr)."""
    groups = trainable.lr_groups
    return jax.ShapeDtypeStruct((max(groups.values(), default=-1) + 1 if groups else 0,), np.float32)


def _placed_stages(model: Model, mesh, layout: StateLayout, plan: Plan, batch: tuple | None) -> StateLayout:
    """The layout with each block family stored on the pipeline stage that runs it (one trace of
    the model at the batch's shapes balances the stages)."""
    if batch is None:
        raise NotBuiltError("a pipeline plan's stages are balanced on the traced model: assemble it with the batch "
                         "(its shapes)")
    params = model.param_shapes()
    buffers = model.buffer_shapes()
    key = jax.ShapeDtypeStruct((2,), np.uint32)
    jax.monitoring.record_event(PLACEMENT_EVENT, model=getattr(model, "name", ""))
    where = placement(model, mesh, layout, plan.pipeline, (params, buffers, key, shaped(batch)))
    return layout_mod.place_stages(layout, where)


def _config(trainable: Trainable, plan: Plan, options: AssemblyOptions, layout: StateLayout,
            target: Target) -> StepConfig:
    grad_tx = GradTransforms.of(options.step, trainable.lr_groups, plan.precision.loss_scale)
    return StepConfig(tx=trainable.tx, options=options.step, grad_tx=grad_tx,
                      sync=options.grad_sync or GradSync(comm_dtype=plan.precision.wire_dtype),
                      remat=plan.layer_remat(), capacity_factor=plan.capacity_factor,
                      router_bias_rate=plan.router_bias_rate, context=plan.context,
                      regather=options.regather,
                      fallback=plan.fallback_policy(), platform=target.platform,
                      offload_optimizer=layout.offload_optimizer)


def _state_shapes(model: Model, layout: StateLayout, tx: optax.GradientTransformation, plan: Plan,
                  sync: GradSync) -> TrainState:
    """The shapes of the TrainState a fresh run of `model` starts from (state_mod.initial)."""
    shapes = model.param_shapes()
    trained = {n: s for n, s in shapes.items() if n in layout.optimized}
    scale = precision.initial_state(plan.precision)
    return TrainState(params=trained, frozen={n: s for n, s in shapes.items() if n not in layout.optimized},
                      buffers=model.buffer_shapes(),
                      opt_state=jax.eval_shape(tx.init, trained), step=jax.ShapeDtypeStruct((), np.int32),
                      key=jax.ShapeDtypeStruct((2,), np.uint32),
                      loss_scale=jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), scale),
                      grad_residual=state_mod.residual_shapes(layout, shapes) if sync.int8 else None)


def shaped(batch: tuple) -> tuple:
    """The batch's arrays as jax.ShapeDtypeStruct (other arguments as they are)."""
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in batch)
