"""The explicit lowering's per-device program for a mesh that does not exist here.

`abstract_step` traces xtrain's training step over a `jax.sharding.AbstractMesh` of the target
size with shape-only state (`jax.ShapeDtypeStruct`): nothing is allocated and no device is
emulated, so a 128-device trn1 plan is lowered on a laptop. The result is the same jaxpr
`TrainStep.program()` gives on real devices: FLOPs (cost.flops), collectives
(lowering.explicit.accounting) and graph memory (cost.model) are read from it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import numpy as np
import optax
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

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
                  regather: bool = True) -> AbstractStep:
    """Traces the explicit lowering's training step for a mesh of axis `sizes`.

    Args:
        model: xtrain's wrapped model (frontend.Model); every parameter is treated as trained.
        tx: the optax transformation.
        sizes: mesh axis sizes in device order, e.g. {"data": 64, "tensor": 2}.
        plan: the plan (its zero stage and remat included).
        batch: the global batch as arrays or jax.ShapeDtypeStruct.
    """
    sizes = dict(sizes)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    params = {n: jax.ShapeDtypeStruct(p.shape, p.dtype) for n, p in model.initial_params().items()}
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    batch_spec = plan.batch_spec(sizes)
    data_axes = tuple(a for e in batch_spec for a in _axes_of(e))
    param_specs, optimizer_specs, _ = zero_mod.specs_for_stage(
        shapes, plan.param_specs(shapes, sizes), sizes, data_axes, plan.zero)
    opt_state = jax.eval_shape(tx.init, params)
    state = TrainState(params=params, frozen={}, buffers={n: jax.ShapeDtypeStruct(b.shape, b.dtype)
                                                          for n, b in model.initial_buffers().items()},
                       opt_state=opt_state, step=jax.ShapeDtypeStruct((), np.int32),
                       key=jax.ShapeDtypeStruct((2,), np.uint32))
    named = lambda specs: {n: NamedSharding(mesh, PartitionSpec(*s)) for n, s in specs.items()}
    shardings = xla_partitioner.state_shardings(state, named(param_specs), mesh, named(optimizer_specs))
    train, _, _ = explicit_step.build(model, tx, shardings, mesh, param_specs, batch_spec, grad_sync or GradSync(),
                                      scan_layers, zero=plan.zero, optimizer_specs=optimizer_specs,
                                      regather=regather, remat=plan.layer_remat())
    shaped = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x for x in batch)
    no_lr_groups = jax.ShapeDtypeStruct((0,), np.float32)  # lrs enter per param group; none here
    program = jax.make_jaxpr(train)(state, shaped, no_lr_groups)
    grad_specs = optimizer_specs if plan.zero == 2 else param_specs
    return AbstractStep(program, param_specs, optimizer_specs, data_axes,
                        _state_bytes(params, opt_state, param_specs, optimizer_specs, grad_specs, sizes))


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
