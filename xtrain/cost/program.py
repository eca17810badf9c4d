"""The explicit lowering's per-device program for a mesh that does not exist here.

`abstract_step` traces xtrain's training step over a `jax.sharding.AbstractMesh` of the target
size with shape-only state (`jax.ShapeDtypeStruct`): nothing is allocated and no device is
emulated, so a 128-device trn1 plan is lowered on a laptop. The step is the one `xtrain.compile`
builds, assembled by the same function (xtrain.lowering.assembly), so its jaxpr is the one
`TrainStep.program()` gives on real devices: FLOPs (ir.analysis.flops), collectives
(lowering.accounting) and graph memory (cost.model) are read from it.

`model_facts` reads what the search needs of the model itself: how many repeated blocks a
pipeline could split into stages, and the model's matmul FLOPs per step (for MFU).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Iterable, Mapping

import jax
import numpy as np
import optax
from jax.extend import core as jcore
from jax.sharding import AbstractMesh

from xtrain.cost import liveness
from xtrain.ir.analysis import flops
from xtrain.ir.model import Model, Trainable
from xtrain.lowering import assembly, ordering, platforms
from xtrain.lowering import state as state_mod
from xtrain.lowering.assembly import AssemblyOptions
from xtrain.lowering.explicit.blocks import find_repeated_blocks
from xtrain.lowering.explicit.gaps import gather_blocks
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
    # primitive -> module paths run replicated for lack of a partition rule (Plan(fallback="replicate"))
    fallbacks: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


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


@dataclasses.dataclass(frozen=True)
class OneGroup:
    """The learning rates of a torch optimizer with every parameter in one param group (what the
    plan search assumes of a model given with an optax transformation of lr 1)."""

    groups: Mapping[str, int]

    def current(self) -> np.ndarray:
        return np.ones((1,), np.float32)

    def mark_stepped(self) -> None:
        pass


def trainable_of(model: Model, tx: optax.GradientTransformation, experts: Iterable[str] = ()) -> Trainable:
    """`model` trained by `tx` with every parameter optimized, in one param group (stored as a
    torch model's step stores it: block families stacked for the layer scan); `experts`: its
    MoE expert weights (Trainable.experts)."""
    names = frozenset(model.param_shapes())
    return Trainable(model=model, tx=tx, optimized=names, learning_rates=OneGroup({n: 0 for n in names}),
                     experts=frozenset(experts))


def abstract_step(trainable: Trainable, sizes: Mapping[str, int], plan: Plan, batch: tuple, *,
                  options: AssemblyOptions = AssemblyOptions(scan_layers=True),
                  platform: str | None = None, built_for: str | None = None) -> AbstractStep:
    """Traces the explicit lowering's training step for a mesh of axis `sizes` on shapes: the
    step `xtrain.compile` builds (xtrain.lowering.assembly), nothing allocated.

    Args:
        trainable: the model and its optimizer (`trainable_of(model, tx)` for a bare model).
        sizes: mesh axis sizes in device order, e.g. {"data": 64, "tensor": 2}.
        plan: the plan (its zero stage and remat included).
        batch: the global batch as arrays or jax.ShapeDtypeStruct.
        options: the compile options that shape the step (the step's own: CompileOptions.assembly()).
        platform: also lower the step for this platform ("neuron", "cuda"; lowering.platforms)
            and keep its HLO text (`hlo`), e.g. for the Neuron conformance checker.
        built_for: the platform the step is built for (assembly.Target: a CUDA step dispatches
            MoE rows by ragged all-to-all); default `platform`, else "cpu".
    """
    sizes = dict(sizes)
    mesh = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    built = assembly.assemble(trainable, plan, mesh, options, batch=batch,
                              target=assembly.Target(platform=built_for or platform or "cpu",
                                                     local_devices=math.prod(sizes.values())))
    traced = built.program.train.trace(built.placed_state, assembly.shaped(batch), assembly.lrs_shape(trainable))
    hlo = None
    if platform is not None:
        with warnings.catch_warnings():  # shape-only inputs carry no sharding to alias outputs to
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            hlo = traced.lower(lowering_platforms=platforms.lowering_platforms(platform)).as_text(dialect="hlo")
    layout, state = built.layout, built.state
    state_bytes = _state_bytes({**state.params, **state.frozen}, state.opt_state, layout, sizes)
    if state.grad_residual is not None:  # int8 error feedback: one gradient's worth per device
        specs = state_mod.residual_specs(layout)
        state_bytes["grad_residual"] = sum(_local_bytes(r.shape, r.dtype, specs[n], sizes)
                                           for n, r in state.grad_residual.items())
    return AbstractStep(traced.jaxpr, dict(layout.param_specs), dict(layout.optimizer_specs), layout.batch_axes,
                        state_bytes, built.bubble, hlo, dict(built.program.findings.fallbacks))


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the plan search reads of the model, independent of any plan."""

    layers: int           # length of the longest run of identical blocks (0: none; no pipeline then)
    matmul_flops: float   # model FLOPs of one training step on the global batch (xtrain.ir.analysis.flops.model_flops)


def state_totals(model: Model, tx: optax.GradientTransformation) -> tuple[int, int]:
    """Bytes of all the model's parameters and of the optimizer state `tx` keeps for them (shapes
    only: a model on the meta device too)."""
    params = dict(model.param_shapes())
    optimizer = jax.eval_shape(tx.init, params)
    return (sum(map(liveness.nbytes, params.values())),
            sum(liveness.nbytes(x) for x in jax.tree.leaves(optimizer)))


def model_facts(model: Model, batch: tuple) -> ModelFacts:
    """Traces the model once (forward, then value and gradient) on `batch`'s shapes."""
    params = dict(model.param_shapes())  # shapes only: a model on the meta device plans too
    buffers = model.buffer_shapes()
    key = jax.ShapeDtypeStruct((2,), np.uint32)
    shaped = assembly.shaped(batch)
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
