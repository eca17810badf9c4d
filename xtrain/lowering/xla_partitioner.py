"""Lowering through XLA's own SPMD partitioner: `jax.jit` with NamedShardings.

The whole step (forward, backward, optimizer) is one global-view program; XLA propagates the
parameter and batch shardings and inserts the collectives. It is the reference the explicit
lowering is compared against.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from xtrain.frontend.model import Model
from xtrain.lowering import accumulation
from xtrain.lowering.grad_transforms import GradTransforms, finish_step
from xtrain.sharding.annotate import tracing_for
from xtrain.step_options import StepOptions


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything a training step reads and writes (all jax arrays)."""

    params: dict[str, Any]      # optimized parameters
    frozen: dict[str, Any]      # parameters the optimizer does not update
    buffers: dict[str, Any]     # module buffers (BatchNorm statistics, ...)
    opt_state: Any
    step: Any                   # int32 scalar: steps run (a step fp16 skipped counts)
    key: Any                    # base PRNG key; step k uses fold_in(key, k)
    loss_scale: Any = None      # fp16: {"scale": f32, "good_steps": i32} (xtrain.precision)


def _replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def state_shardings(state: TrainState, param_shardings: Mapping[str, NamedSharding], mesh,
                    optimizer_shardings: Mapping[str, NamedSharding] | None = None) -> TrainState:
    """Shardings for a TrainState: parameters per plan, optimizer moments like their parameter
    (or per `optimizer_shardings`, for ZeRO 1-2), everything else replicated."""
    shapes = {n: s for n, s in jax.tree.map(lambda x: x.shape, {**state.params, **state.frozen}).items()}
    optimizer_shardings = optimizer_shardings or param_shardings

    def opt_leaf(path, leaf):
        for entry in path:
            name = getattr(entry, "key", None)
            if name in param_shardings and getattr(leaf, "shape", None) == shapes[name]:
                return optimizer_shardings[name]
        return _replicated(mesh)

    return TrainState(
        params={n: param_shardings[n] for n in state.params},
        frozen={n: param_shardings[n] for n in state.frozen},
        buffers={n: _replicated(mesh) for n in state.buffers},
        opt_state=jax.tree_util.tree_map_with_path(opt_leaf, state.opt_state),
        step=_replicated(mesh),
        key=_replicated(mesh),
        loss_scale=jax.tree.map(lambda _: _replicated(mesh), state.loss_scale),
    )


def make_train_step(model: Model, tx: optax.GradientTransformation, mesh=None, options: StepOptions = StepOptions(),
                    grad_tx: GradTransforms = GradTransforms()) -> Callable:
    """The pure step: (state, batch, lrs) -> (new state, outputs); `xtrain.shard` calls in the
    model constrain to `mesh`."""

    def train_step(state: TrainState, batch: tuple, lrs):
        key = jax.random.fold_in(state.key, state.step)
        scale = state.loss_scale["scale"] if state.loss_scale is not None else None

        def loss_of(params, buffers, micro, index):
            micro_key = key if options.accumulate == 1 else jax.random.fold_in(key, index)
            with tracing_for(mesh):
                loss, buffers = model.apply({**params, **state.frozen}, buffers, micro_key, micro, training=True)
            return accumulation.objective(loss, scale), (loss, buffers)

        loss, buffers, grads = accumulation.value_and_grad(loss_of, state.params, state.buffers, batch,
                                                           options.accumulate)
        grads, norm = grad_tx.before_update(grads, {}, scale)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, grad_tx.scale_lr(updates, lrs))
        new = dataclasses.replace(state, params=params, buffers={**state.buffers, **buffers}, opt_state=opt_state)
        return finish_step(state, new, loss, norm, grad_tx)

    return train_step


def make_eval_step(model: Model, mesh=None) -> Callable:
    def eval_step(state: TrainState, batch: tuple):
        key = jax.random.fold_in(state.key, state.step)
        with tracing_for(mesh):
            loss, _ = model.apply({**state.params, **state.frozen}, state.buffers, key, batch, training=False)
        return loss

    return eval_step


def compile_steps(model: Model, tx: optax.GradientTransformation, shardings: TrainState, mesh,
                  options: StepOptions = StepOptions(), grad_tx: GradTransforms = GradTransforms()):
    """jit-compiled (train_step, eval_step) with the state's shardings fixed."""
    replicated = _replicated(mesh)
    train = jax.jit(make_train_step(model, tx, mesh, options, grad_tx), out_shardings=(shardings, replicated),
                    donate_argnums=0)
    evaluate = jax.jit(make_eval_step(model, mesh), out_shardings=replicated)
    return train, evaluate
