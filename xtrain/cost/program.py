"""The explicit lowering's per-device program for a mesh that does not exist here.

`abstract_step` traces xtrain's training step over a `jax.sharding.AbstractMesh` of the target
size with shape-only state (`jax.ShapeDtypeStruct`): nothing is allocated and no device is
emulated, so a 128-device trn1 plan is lowered on a laptop. It calls what `TrainStep` calls
(the layout resolution, the pipeline's stage placement, the step skeleton), so the result is
the jaxpr `TrainStep.program()` gives on real devices: FLOPs (ir.flops), collectives
(lowering.accounting) and graph memory (cost.model) are read from it.

`model_facts` reads what the search needs of the model itself: how many repeated blocks a
pipeline could split into stages, and the model's matmul FLOPs per step (for MFU).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Mapping

import jax
import numpy as np
import optax
from jax.extend import core as jcore
from jax.sharding import AbstractMesh

from xtrain.ir import flops, stacked
from xtrain.ir.model import Model
from xtrain.lowering import precision
from xtrain.lowering import state as state_mod
from xtrain.lowering import ordering, platforms
from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.lowering.explicit.blocks import find_repeated_blocks
from xtrain.lowering.explicit.gaps import gather_blocks
from xtrain.lowering.gradient_sync import GradSync
from xtrain.lowering.lower import lower
from xtrain.lowering.options import StepOptions
from xtrain.lowering.pipeline.program import placement
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import StepConfig
from xtrain.sharding import layout as layout_mod
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.plan import Plan, Spec, axes_of


@dataclasses.dataclass(frozen=True)
class AbstractStep:
    """A traced step: its program and the specs it was traced with."""

    program: "jax.extend.core.ClosedJaxpr"
    param_specs: dict[str, Spec]
    optimizer_specs: dict[str, Spec]
    batch_axes: tuple[str, ...]
    state_bytes: dict[str, int]     # parameters / gradients / optimizer (/ grad_residual) bytes per device
    bubble: float = 0.0             # a pipeline schedule table's idle share of (tick, stage) slots
    hlo: str | None = None          # the program lowered for `platform` (HLO text), when one was asked for


def _local_bytes(shape, dtype, spec: Spec, sizes: Mapping[str, int]) -> int:
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    local = [d // math.prod(sizes[a] for a in axes_of(e)) for d, e in zip(shape, padded)]
    return math.prod(local) * np.dtype(dtype).itemsize


def _state_bytes(params, opt_state, layout: StateLayout, sizes) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes per device (the optimizer's as `optimizer_host`
    when offloaded)."""
    param_specs, optimizer_specs, grad_specs = layout.param_specs, layout.optimizer_specs, layout.grad_specs
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    by_shape = lambda leaf, name: optimizer_specs[name] if tuple(leaf.shape) == shapes[name] else ()
    optimizer = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        name = next((getattr(e, "key", None) for e in path if getattr(e, "key", None) in shapes), None)
        spec = by_shape(leaf, name) if name else ()
        optimizer += _local_bytes(leaf.shape, leaf.dtype, spec, sizes)
    where = "optimizer_host" if layout.offload_optimizer else "optimizer"
    return {"parameters": sum(_local_bytes(p.shape, p.dtype, param_specs[n], sizes) for n, p in params.items()),
            "gradients": sum(_local_bytes(p.shape, p.dtype, grad_specs[n], sizes) for n, p in params.items()),
            "optimizer": 0, where: optimizer}


def abstract_step(model: Model, tx: optax.GradientTransformation, sizes: Mapping[str, int], plan: Plan,
                  batch: tuple, *, grad_sync: GradSync | None = None, scan_layers: bool = True,
                  regather: bool = True, stack_blocks: bool = True, platform: str | None = None) -> AbstractStep:
    """Traces the explicit lowering's training step for a mesh of axis `sizes`: the same layout
    resolution, stage placement and step skeleton as `xtrain.compile`'s step, on shapes.

    Args:
        model: xtrain's wrapped model (xtrain.ir.Model); every parameter is treated as trained.
        tx: the optax transformation.
        sizes: mesh axis sizes in device order, e.g. {"data": 64, "tensor": 2}.
        plan: the plan (its zero stage and remat included).
        batch: the global batch as arrays or jax.ShapeDtypeStruct.
        stack_blocks: block parameters stored stacked, as xtrain.compile stores a torch
            model's (xtrain.ir.stacked).
        platform: also lower the step for this platform ("neuron", "cuda"; lowering.platforms)
            and keep its HLO text (`hlo`), e.g. for the Neuron conformance checker.
    """
    sizes = dict(sizes)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    model = precision.apply_policy(model, plan.precision)  # as TrainStep: matmuls in the compute dtype
    shapes = model.param_shapes()
    layout = layout_mod.resolve(plan, sizes, shapes, optimized=set(shapes),
                                lr_groups={} if stack_blocks else None, scan_layers=scan_layers)
    model = stacked.stored_model(model, layout.stacking)
    buffers = {n: jax.ShapeDtypeStruct(b.shape, b.dtype) for n, b in model.initial_buffers().items()}
    key = jax.ShapeDtypeStruct((2,), np.uint32)
    if plan.pipeline is not None:  # as the step places each stage's block parameters on it
        where = placement(model, mesh, layout, plan.pipeline, (dict(shapes), buffers, key, _shaped(batch)))
        layout = layout_mod.place_stages(layout, where)
        model = stacked.stored_model(model, layout.stacking)
    params = model.param_shapes()
    opt_state = jax.eval_shape(tx.init, params)
    sync = grad_sync or GradSync(comm_dtype=plan.precision.wire_dtype)
    residual = state_mod.residual_shapes(layout, params) if sync.int8 else None
    scale = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), precision.initial_state(plan.precision))
    state = TrainState(params=params, frozen={}, buffers=buffers, opt_state=opt_state,
                       step=jax.ShapeDtypeStruct((), np.int32), key=key, loss_scale=scale, grad_residual=residual)
    # the default step's gradient norm and skip (detect_nan, input checks), and fp16's loss scale
    config = StepConfig(tx=tx, sync=sync, remat=plan.layer_remat(), regather=regather,
                        grad_tx=GradTransforms.of(StepOptions(), loss_scale=plan.precision.loss_scale),
                        offload_optimizer=layout.offload_optimizer)
    lowered = lower(model, mesh, layout, state_mod.shardings(state, layout, mesh), config, pipeline=plan.pipeline)
    no_lr_groups = jax.ShapeDtypeStruct((0,), np.float32)  # lrs enter per param group; none here
    traced = lowered.train.trace(state, _shaped(batch), no_lr_groups)
    hlo = None
    if platform is not None:
        with warnings.catch_warnings():  # shape-only inputs carry no sharding to alias outputs to
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            hlo = traced.lower(lowering_platforms=platforms.lowering_platforms(platform)).as_text(dialect="hlo")
    bubble = lowered.strategy.program.table.bubble() if plan.pipeline is not None else 0.0
    state_bytes = _state_bytes(params, opt_state, layout, sizes)
    if residual is not None:  # int8 error feedback: one gradient's worth per device
        specs = state_mod.residual_specs(layout)
        state_bytes["grad_residual"] = sum(_local_bytes(r.shape, r.dtype, specs[n], sizes) for n, r in residual.items())
    return AbstractStep(traced.jaxpr, dict(layout.param_specs), dict(layout.optimizer_specs), layout.batch_axes,
                        state_bytes, bubble, hlo)


def _shaped(batch: tuple) -> tuple:
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in batch)


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the plan search reads of the model, independent of any plan."""

    layers: int           # length of the longest run of identical blocks (0: none; no pipeline then)
    matmul_flops: float   # model FLOPs of one training step on the global batch (xtrain.ir.flops.model_flops)


def model_facts(model: Model, batch: tuple) -> ModelFacts:
    """Traces the model once (forward, then value and gradient) on `batch`'s shapes."""
    params = {n: jax.ShapeDtypeStruct(p.shape, p.dtype) for n, p in model.initial_params().items()}
    buffers = {n: jax.ShapeDtypeStruct(b.shape, b.dtype) for n, b in model.initial_buffers().items()}
    key = jax.ShapeDtypeStruct((2,), np.uint32)
    shaped = _shaped(batch)
    apply = lambda p, b, k, x: model.apply(p, b, k, x, training=True)
    forward = gather_blocks(jax.make_jaxpr(apply)(params, buffers, key, shaped), model.module_paths())
    param_vars = forward.jaxpr.invars[:len(params)]  # a dict's leaves come in sorted key order
    runs = find_repeated_blocks(forward.jaxpr, model.module_paths(), param_vars)
    return ModelFacts(max((r.length for r in runs), default=0), flops.model_flops(model, params, buffers, key, shaped))


def per_device_body(program):
    """The shard_map body of a step's program: the per-device jaxpr."""
    for eqn in getattr(program, "jaxpr", program).eqns:
        if str(eqn.primitive) == "shard_map":
            return ordering.staged_body(eqn.params["jaxpr"])
        for sub in jcore.jaxprs_in_params(eqn.params):
            found = per_device_body(sub)
            if found is not None:
                return found
    return None
