"""Lowering through XLA's own SPMD partitioner: the training-step skeleton in the global view.

The whole step (forward, backward, optimizer) is one global-view program; `jax.jit` with the
state's NamedShardings lets XLA propagate the parameter and batch shardings and insert the
collectives. It is the reference the explicit lowering is compared against.
"""
from __future__ import annotations

from typing import Callable

import jax

from xtrain.errors import UnsupportedError
from xtrain.ir.model import Model
from xtrain.lowering import accumulation, precision
from xtrain.lowering.findings import Findings
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import GlobalView, Gradients, StepConfig
from xtrain.lowering.zero import Update
from xtrain.sharding.annotate import tracing_for
from xtrain.sharding import segments
from xtrain.sharding.layout import StateLayout


class XlaStrategy:
    """Loss and gradients of the global-view program; `xtrain.shard` calls in the model become
    sharding constraints on `mesh`."""

    def __init__(self, model: Model, mesh, layout: StateLayout, config: StepConfig):
        if config.remat is not None:
            raise UnsupportedError(
                f"Plan({config.remat.setting}) checkpoints each layer of the explicit "
                "lowering's repeated blocks; use lowering='explicit' (or remat='off', offload='none')")
        if config.capacity_factor is not None:
            raise UnsupportedError(f"Plan(capacity_factor={config.capacity_factor}) drops MoE pairs in the explicit "
                                   "lowering's routed-experts rule; use lowering='explicit' (or capacity_factor=None)")
        if config.router_bias_rate is not None:
            raise UnsupportedError(f"Plan(router_bias_rate={config.router_bias_rate}) balances MoE layers from the "
                                   "tokens per expert the explicit lowering counts; use lowering='explicit' (or "
                                   "router_bias_rate=None)")
        self.model, self.mesh, self.config = model, mesh, config
        # fused weights split per segment are stored interleaved: the global program reads them in torch's order
        self.fused = {n: s for n, s in layout.param_specs.items() if segments.segmented_dims(s)}
        self.sizes = layout.sizes
        self.runner = GlobalView()
        self.update = Update.global_view(layout.param_specs, config.tx, config.grad_tx)

    def gradients(self, state: TrainState, batch: tuple) -> Callable[..., Gradients]:
        steps = self.config.options.accumulate
        histories = frozenset(precision.histories_of(self.model))

        def compute(state: TrainState, batch: tuple, key, scale) -> Gradients:
            def loss_of(params, buffers, micro, index):
                micro_key = key if steps == 1 else jax.random.fold_in(key, index)
                with tracing_for(self.mesh):
                    loss, buffers = self.model.apply(self._torch_order({**params, **state.frozen}), buffers,
                                                     micro_key, micro, training=True)
                return accumulation.objective(loss, scale), (loss, buffers, {})

            # delayed FP8 scaling: the amax histories differentiated, their cotangents this step's amaxes
            moved, buffers = precision.split_histories(state.buffers, histories)
            loss, buffers, grads, _ = accumulation.value_and_grad(loss_of, {**state.params, **moved}, buffers, batch,
                                                                  steps, maxed=histories)
            amaxes = {n: grads.pop(n)[:, 0] for n in histories}
            buffers = {**buffers, **precision.recorded(state.buffers, amaxes)}
            return Gradients(loss, buffers, grads, {})

        return compute

    def loss(self, state: TrainState, batch: tuple) -> Callable:
        def compute(state: TrainState, batch: tuple, key):
            with tracing_for(self.mesh):
                loss, _ = self.model.apply(self._torch_order({**state.params, **state.frozen}), state.buffers, key,
                                           batch, training=False)
            return loss

        return compute

    def notes(self, findings: Findings) -> list[str]:
        return []  # XLA partitions the global program: the explicit lowering's rules find nothing here

    def _torch_order(self, params: dict) -> dict:
        return {n: segments.to_torch(v, self.fused[n], self.sizes) if n in self.fused else v for n, v in params.items()}
