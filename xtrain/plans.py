"""Presets: the usual parallel layouts as ordinary, printable, editable Plans.

    plan = xtrain.plans.megatron(model, mesh)              # tensor parallel over "tensor"
    plan = xtrain.plans.fsdp(model, mesh, base=plan)       # ... x ZeRO-3 over "data"
    print(plan)                                            # one rule per parameter group + notes

`model` is a torch module (described by the front end), a {name: shape} mapping or a JAX
parameter pytree; `mesh` an xtrain.Mesh or its {axis: size}. The presets themselves are
torch-free (xtrain.sharding.presets). `assert_sharded` is the check to run on the result.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from xtrain.errors import PlanError
from xtrain.frontend.jax_function import param_shapes
from xtrain.frontend.structure import describe
from xtrain.frontend.torch_module import TorchModel
from xtrain.ir.structure import Structure
from xtrain.ir.analysis import dimflow
from xtrain.ir.trace_options import SequenceParallel, TraceOptions
from xtrain.sharding import presets, tensor_parallel
from xtrain.sharding.mesh import CONTEXT, DATA, TENSOR, Mesh, job_devices
from xtrain.sharding.plan import PendingPlan, Plan, Spec
from xtrain.sharding.presets import MIN_SIZE, ddp

Shapes = dict[str, tuple[int, ...]]

__all__ = ["MIN_SIZE", "assert_sharded", "ddp", "fsdp", "hybrid", "largest_replicated", "megatron", "zero"]


def _sizes(mesh: Mesh | Mapping[str, int]) -> dict[str, int]:
    if isinstance(mesh, Mesh):
        if -1 not in mesh.axes.values():
            return dict(mesh.axes)
        return mesh.resolve(len(job_devices()))  # starts JAX: only for a -1 axis
    return dict(mesh)


def _is_torch(model: Any) -> bool:
    return hasattr(model, "named_parameters") and hasattr(model, "named_modules")


def _shapes(model: Any) -> Shapes:
    """{parameter name: shape} of a torch module (canonical names of tied tensors, as xtrain
    names them), a {name: shape} mapping, or a JAX params pytree."""
    if _is_torch(model):
        return dict(_structure(model).shapes)
    if isinstance(model, Mapping) and all(isinstance(v, (tuple, list)) for v in model.values()):
        return {n: tuple(v) for n, v in model.items()}
    return param_shapes(model)


def _structure(model: Any) -> Structure:
    if not _is_torch(model):
        raise PlanError(f"xtrain.plans.megatron reads a torch module's structure; got {type(model).__name__}. "
                         "Write the rules yourself with xtrain.Plan(params={...})")
    return describe(model)


def fsdp(model: Any, mesh: Mesh | Mapping[str, int], *, axis: str | tuple[str, ...] = DATA,
         min_size: int = MIN_SIZE, base: Plan | None = None) -> Plan:
    """ZeRO-3 / FSDP: every parameter split over `axis` on its largest divisible dimension.

    Args:
        model: a torch module, a {name: shape} mapping or a JAX params pytree.
        mesh: the mesh (or its {axis: size}).
        axis: the mesh axis (or axes) parameters are split over; gathered before each use.
        min_size: tensors with fewer elements (biases, norm scales) stay whole.
        base: a plan to add FSDP to (e.g. `megatron(...)` for TP x ZeRO-3): its splits are
            kept and `axis` is added on the largest dimension left divisible; its batch spec
            and notes carry over.

    Returns:
        A Plan with one rule per split parameter group; `notes` lists what stayed whole.
    """
    return presets.fsdp(_shapes(model), _sizes(mesh), axis=axis, min_size=min_size, base=base)


def zero(stage: int, model: Any = None, mesh: Mesh | Mapping[str, int] | None = None, **fsdp_kwargs) -> Plan:
    """ZeRO by stage over the data axis. 0: `ddp()`; 1 and 2: `Plan(zero=stage)` (optimizer
    state, and for 2 gradients, split; xtrain picks each tensor's dimension at compile time);
    3: `fsdp(model, mesh, ...)` when given the model and mesh (explicit, printable rules), else
    `Plan(zero=3)`."""
    if stage == 3 and model is not None and mesh is not None:
        return presets.zero(3, _shapes(model), _sizes(mesh), **fsdp_kwargs)
    return presets.zero(stage)


def hybrid(model: Any, mesh: Mesh | Mapping[str, int], *, shard_axis: str = DATA,
           replicate_axes: tuple[str, ...] | None = None, min_size: int = MIN_SIZE) -> Plan:
    """HSDP: parameters split over `shard_axis` (FSDP within each group), replicated across
    `replicate_axes` (default: every other mesh axis); the batch spans all of them (a `context`
    axis splits the sequence instead: context parallelism).

    e.g. Mesh(replica=2, data=4): 2 groups of 4 devices, each holding one full copy of the
    parameters split 4 ways; gradients reduce-scatter within a group, all-reduce across.
    """
    return presets.hybrid(_shapes(model), _sizes(mesh), shard_axis=shard_axis, replicate_axes=replicate_axes,
                          min_size=min_size)


def megatron(model, mesh: Mesh | Mapping[str, int], *, axis: str = TENSOR, vocab_parallel: bool = True,
             sequence_parallel: bool = False, example: tuple | None = None, loss_fn: Callable | None = None) -> Plan:
    """Megatron-LM tensor parallel derived from the model's traced program: each matmul whose
    output dimension reaches a matmul that contracts it (through elementwise ops, heads,
    attention, gated products, slices of fused projections) is a column -> row pair split over
    `axis`; the token embedding and LM head are split on the vocabulary where the graph reads
    them as a lookup table and logits (xtrain.sharding.tensor_parallel says how). Module names
    and containers play no part; they only name what was found in `plan.notes`. Grouped-query
    attention whose key/value heads `axis` does not divide splits the query heads only: the
    plan's trace options (`plan.trace.head_split`) have xtrain's sdpa repeat keys and values per
    query head when a step of this plan traces the model (xtrain.frontend.sdpa; `model` itself
    is left as it is).

    Args:
        model: a torch.nn.Module.
        mesh: the mesh (or its {axis: size}); must have `axis`.
        axis: the tensor-parallel mesh axis.
        vocab_parallel: split the token embedding and LM head on the vocabulary; False keeps
            them whole (the logits then stay whole too).
        sequence_parallel: also split the residual stream between the blocks' tensor-parallel
            regions over the sequence on `axis` (Megatron-SP: each all-reduce becomes a
            reduce-scatter and an all-gather). The blocks are found in the graph (the modules
            holding each layer's row-parallel matmuls); their inputs and outputs are annotated
            as `xtrain.shard(x, (batch axis, axis, None))` would, while a step of this plan traces
            the model (`plan.trace.sequence_parallel`; forward hooks installed for that trace
            only). The activations must be (batch, sequence, ...).
            With a `context` axis the sequence splits over context, then `axis` within each chunk.
        example: one batch as `step(*batch)` takes it (only shapes are read), to trace now.
            Without it the plan is pending: `xtrain.compile` derives its rules at the step's
            first call, and `print(plan)` says so; rules added to it before then win.
        loss_fn: the `loss_fn` given to `xtrain.compile`, when the forward does not return the loss.

    Returns:
        A Plan with one rule per parameter group and notes (batch: the default, the "data" axis).
    """
    if not _is_torch(model):
        raise PlanError(f"xtrain.plans.megatron traces a torch module; got {type(model).__name__}. "
                         "Write the rules yourself with xtrain.Plan(params={...})")
    sizes = _sizes(mesh)
    presets.require_axes((axis,), sizes, "megatron")

    def derive(wrapped, batch: tuple) -> Plan:
        trace = TraceOptions(head_split=sizes[axis])  # the heads as a step of this plan traces them
        flow = dimflow.of_model(wrapped.specialised(trace), batch, sizes[axis])
        shapes = {n: tuple(s.shape) for n, s in wrapped.param_shapes().items()}
        plan = presets.megatron(flow, shapes, sizes, axis=axis, vocab_parallel=vocab_parallel)
        if sequence_parallel:
            plan, trace = _sequence_parallel(plan, trace, flow, sizes, axis)
        return dataclasses.replace(plan, trace=trace)

    if example is None:
        return PendingPlan(derive=derive)
    batch = tuple(np.asarray(x.detach().cpu()) if hasattr(x, "detach") else np.asarray(x) for x in example)
    return derive(TorchModel(model, loss_fn), batch)


def _sequence_parallel(plan: Plan, trace: TraceOptions, flow, sizes: dict[str, int], axis: str):
    """`plan` and `trace` with the blocks' inputs and outputs split over the sequence on `axis`
    (under context parallelism the sequence is split over context, then `axis` within it)."""
    spec = (DATA if DATA in sizes else None, (CONTEXT, axis) if sizes.get(CONTEXT, 1) > 1 else axis, None)
    blocks = tensor_parallel.block_paths(flow)
    note = (f"sequence parallel: the inputs and outputs of {presets.listing(blocks)} split {spec} (batch, "
            f"sequence over {axis}, width): each block's all-reduces become reduce-scatter + all-gather")
    trace = dataclasses.replace(trace, sequence_parallel=SequenceParallel(blocks=tuple(blocks), spec=spec))
    return dataclasses.replace(plan, notes=plan.notes + (note,)), trace


# -- checks ---------------------------------------------------------------------------------
def _specs_and_shapes(step_or_plan, model, mesh) -> tuple[dict[str, Spec], Shapes]:
    if isinstance(step_or_plan, Plan):
        if model is None or mesh is None:
            raise PlanError("checking a Plan needs the model (or its {name: shape}) and the mesh")
        shapes = _shapes(model)
        return step_or_plan.param_specs(shapes, _sizes(mesh)), shapes
    state = step_or_plan.state
    shapes = {n: tuple(v.shape) for n, v in {**state.params, **state.frozen}.items()}
    return dict(step_or_plan.param_specs), shapes


def largest_replicated(step_or_plan, model: Any = None, mesh: Mesh | Mapping[str, int] | None = None,
                       *, top: int = 5) -> list[tuple[str, tuple[int, ...]]]:
    """The `top` largest parameters kept whole on every device, largest first.

    Args:
        step_or_plan: a compiled step (`xtrain.compile(...)`) or a Plan.
        model: for a Plan: the model (or {name: shape}) it is meant for.
        mesh: for a Plan: the mesh it is meant for.
        top: how many parameters to list.
    """
    return presets.largest_replicated(*_specs_and_shapes(step_or_plan, model, mesh), top=top)


def assert_sharded(step_or_plan, model: Any = None, mesh: Mesh | Mapping[str, int] | None = None,
                   *, max_replicated: float = 0.05) -> float:
    """Fails when more than `max_replicated` of the parameter elements are whole on every
    device (MaxText's `assert_params_sufficiently_sharded`). Returns that fraction.

    Raises:
        PlanError: naming the largest replicated tensors and their shapes.
    """
    specs, shapes = _specs_and_shapes(step_or_plan, model, mesh)
    fraction = presets.replicated_fraction(specs, shapes)
    if fraction > max_replicated:
        worst = presets.largest_replicated(specs, shapes)
        raise PlanError(
            f"{fraction:.1%} of the parameter elements are replicated on every device (allowed: "
            f"{max_replicated:.0%}); largest: {', '.join(f'{n} {s}' for n, s in worst)}. Add rules for them, "
            "or combine with xtrain.plans.fsdp(model, mesh, base=plan)")
    return fraction
