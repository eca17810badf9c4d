"""The explicit lowering's per-device program for a mesh that does not exist here.

`abstract_step` traces xtrain's training step over a `jax.sharding.AbstractMesh` of the target
size with shape-only state (`jax.ShapeDtypeStruct`): nothing is allocated and no device is
emulated, so a 128-device trn1 plan is lowered on a laptop. The result is the same jaxpr
`TrainStep.program()` gives on real devices: FLOPs (cost.flops), collectives
(lowering.explicit.accounting) and graph memory (cost.model) are read from it. A plan with a
pipeline is lowered by the pipeline step (lowering.pipeline.step), as `TrainStep` would.

`model_facts` reads what the search needs of the model itself: how many repeated blocks a
pipeline could split into stages, and the model's matmul FLOPs per step (for MFU).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from xtrain.frontend import stacked
from xtrain.frontend.model import Model
from xtrain.lowering import xla_partitioner
from xtrain.lowering.explicit import ordering
from xtrain.lowering.explicit import step as explicit_step
from xtrain.lowering.explicit.gradient_sync import GradSync
from xtrain.lowering.xla_partitioner import TrainState
from xtrain.sharding import zero as zero_mod
from xtrain.sharding.plan import Plan, Spec, _axes_of


@dataclasses.dataclass(frozen=True)
class AbstractStep:
    """A traced step: its program and the specs it was traced with."""

    program: "jax.extend.core.ClosedJaxpr"
    param_specs: dict[str, Spec]
    optimizer_specs: dict[str, Spec]
    batch_axes: tuple[str, ...]
    state_bytes: dict[str, int]     # parameters / gradients / optimizer bytes per device
    bubble: float = 0.0             # a pipeline schedule table's idle share of (tick, stage) slots


def _local_bytes(shape, dtype, spec: Spec, sizes: Mapping[str, int]) -> int:
    padded = tuple(spec) + (None,) * (len(shape) - len(spec))
    local = [d // math.prod(sizes[a] for a in _axes_of(e)) for d, e in zip(shape, padded)]
    return math.prod(local) * np.dtype(dtype).itemsize


def _state_bytes(params, opt_state, param_specs, optimizer_specs, grad_specs, sizes) -> dict[str, int]:
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    by_shape = lambda leaf, name: optimizer_specs[name] if tuple(leaf.shape) == shapes[name] else ()
    optimizer = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        name = next((getattr(e, "key", None) for e in path if getattr(e, "key", None) in shapes), None)
        spec = by_shape(leaf, name) if name else ()
        optimizer += _local_bytes(leaf.shape, leaf.dtype, spec, sizes)
    return {"parameters": sum(_local_bytes(p.shape, p.dtype, param_specs[n], sizes) for n, p in params.items()),
            "gradients": sum(_local_bytes(p.shape, p.dtype, grad_specs[n], sizes) for n, p in params.items()),
            "optimizer": optimizer}


def abstract_step(model: Model, tx: optax.GradientTransformation, sizes: Mapping[str, int], plan: Plan,
                  batch: tuple, *, grad_sync: GradSync | None = None, scan_layers: bool = True,
                  regather: bool = True, stack_blocks: bool = True) -> AbstractStep:
    """Traces the explicit lowering's training step for a mesh of axis `sizes`.

    Args:
        model: xtrain's wrapped model (frontend.Model); every parameter is treated as trained.
        tx: the optax transformation.
        sizes: mesh axis sizes in device order, e.g. {"data": 64, "tensor": 2}.
        plan: the plan (its zero stage and remat included).
        batch: the global batch as arrays or jax.ShapeDtypeStruct.
        stack_blocks: block parameters stored stacked, as xtrain.compile stores a torch
            model's (xtrain.frontend.stacked).
    """
    sizes = dict(sizes)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    params = {n: jax.ShapeDtypeStruct(p.shape, p.dtype) for n, p in model.initial_params().items()}
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    batch_spec = plan.batch_spec(sizes)
    data_axes = tuple(a for e in batch_spec for a in _axes_of(e))
    param_specs, optimizer_specs, _ = zero_mod.specs_for_stage(
        shapes, plan.param_specs(shapes, sizes), sizes, data_axes, plan.zero)
    if stacked.wanted(scan_layers, plan.pipeline, stack_blocks):  # as xtrain.compile stores a torch model
        stored = stacked.stack_blocks(model, param_specs, optimizer_specs, set(params), None)
        model, param_specs, optimizer_specs = stored.model, stored.param_specs, stored.optimizer_specs
        params = stored.stacking.stack_shapes(params)
    placed: dict = {}
    if plan.pipeline is not None:  # as TrainStep places each stage's block parameters on it
        from xtrain.lowering.pipeline import step as pipeline_step

        shapes = (params, {n: jax.ShapeDtypeStruct(b.shape, b.dtype) for n, b in model.initial_buffers().items()},
                  jax.ShapeDtypeStruct((2,), np.uint32), _shaped(batch))
        storage, starts = pipeline_step.plan_storage(model, mesh, param_specs, optimizer_specs, batch_spec,
                                                     plan.pipeline, shapes, set(params), None)
        if storage:
            placed = dict(storage=storage, layer_specs=param_specs, starts=starts)
            param_specs, optimizer_specs = storage.stack_specs(param_specs), storage.stack_specs(optimizer_specs)
            params = storage.stack_shapes(params)
    opt_state = jax.eval_shape(tx.init, params)
    state = TrainState(params=params, frozen={}, buffers={n: jax.ShapeDtypeStruct(b.shape, b.dtype)
                                                          for n, b in model.initial_buffers().items()},
                       opt_state=opt_state, step=jax.ShapeDtypeStruct((), np.int32),
                       key=jax.ShapeDtypeStruct((2,), np.uint32))
    named = lambda specs: {n: NamedSharding(mesh, PartitionSpec(*s)) for n, s in specs.items()}
    shardings = xla_partitioner.state_shardings(state, named(param_specs), mesh, named(optimizer_specs))
    train, bubble = _build(model, tx, shardings, mesh, param_specs, batch_spec, plan, optimizer_specs,
                           grad_sync or GradSync(comm_dtype=plan.precision.wire_dtype), scan_layers, regather, placed)
    shaped = _shaped(batch)
    no_lr_groups = jax.ShapeDtypeStruct((0,), np.float32)  # lrs enter per param group; none here
    program = jax.make_jaxpr(train)(state, shaped, no_lr_groups)
    grad_specs = optimizer_specs if plan.zero == 2 else param_specs
    return AbstractStep(program, param_specs, optimizer_specs, data_axes,
                        _state_bytes(params, opt_state, param_specs, optimizer_specs, grad_specs, sizes), bubble)


def _shaped(batch: tuple) -> tuple:
    return tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in batch)


def _build(model, tx, shardings, mesh, param_specs, batch_spec, plan: Plan, optimizer_specs, sync: GradSync,
           scan_layers: bool, regather: bool, placed: dict):
    """(train step, bubble) of the lowering TrainStep uses for `plan`."""
    if plan.pipeline is None:
        train, _, _ = explicit_step.build(model, tx, shardings, mesh, param_specs, batch_spec, sync, scan_layers,
                                          zero=plan.zero, optimizer_specs=optimizer_specs, regather=regather,
                                          remat=plan.layer_remat())
        return train, 0.0
    from xtrain.lowering.pipeline import step as pipeline_step

    train, _, program = pipeline_step.build(model, tx, shardings, mesh, param_specs, batch_spec, sync, plan.pipeline,
                                            zero=plan.zero, optimizer_specs=optimizer_specs,
                                            remat=plan.layer_remat(), **placed)
    return train, program.table.bubble()


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the plan search reads of the model, independent of any plan."""

    layers: int           # length of the longest run of identical blocks (0: none; no pipeline then)
    matmul_flops: float   # dot + conv FLOPs of one training step (forward and backward) on the global batch


def model_facts(model: Model, batch: tuple) -> ModelFacts:
    """Traces the model once (forward, then value and gradient) on `batch`'s shapes."""
    from xtrain.cost import flops
    from xtrain.lowering.explicit.collectives import Context
    from xtrain.lowering.explicit.interpreter import module_path
    from xtrain.lowering.explicit.layer_scan import find_repeated_blocks

    params = {n: jax.ShapeDtypeStruct(p.shape, p.dtype) for n, p in model.initial_params().items()}
    buffers = {n: jax.ShapeDtypeStruct(b.shape, b.dtype) for n, b in model.initial_buffers().items()}
    key = jax.ShapeDtypeStruct((2,), np.uint32)
    shaped = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in batch)
    apply = lambda p, b, k, x: model.apply(p, b, k, x, training=True)
    forward = jax.make_jaxpr(apply)(params, buffers, key, shaped)
    probe = Context({}, model.module_paths())
    param_vars = forward.jaxpr.invars[:len(params)]  # a dict's leaves come in sorted key order
    runs = find_repeated_blocks(forward.jaxpr, lambda e: module_path(probe, e, ""), param_vars)
    loss = lambda p, b, k, x: apply(p, b, k, x)[0]
    both = jax.make_jaxpr(jax.value_and_grad(loss))(params, buffers, key, shaped)
    return ModelFacts(max((r.length for r in runs), default=0), flops.count(both).matmul)


def per_device_body(program):
    """The shard_map body of a step's program: the per-device jaxpr."""
    from jax.extend import core as jcore

    for eqn in getattr(program, "jaxpr", program).eqns:
        if str(eqn.primitive) == "shard_map":
            return ordering.staged_body(eqn.params["jaxpr"])
        for sub in jcore.jaxprs_in_params(eqn.params):
            found = per_device_body(sub)
            if found is not None:
                return found
    return None
