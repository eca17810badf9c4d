"""The training step of the explicit lowering.

    forward   the model's global jaxpr, interpreted per device (rules insert the collectives)
    backward  JAX autodiff of that per-device forward, parameters cast to varying over the
              batch axes so autodiff does not sum their gradients itself
    sync      xtrain's bucketed all-reduce of gradients over the batch axes (gradient_sync)
    update    the optax transformation on local shards
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import optax
from jax import lax
from jax.sharding import PartitionSpec

from xtrain.frontend.model import Model
from xtrain.lowering import accumulation
from xtrain.lowering.grad_transforms import GradTransforms, finish_step
from xtrain.lowering.explicit import collectives as C
from xtrain.lowering.explicit import gradient_sync
from xtrain.lowering.explicit import ordering
from xtrain.lowering.explicit import zero as zero_update
from xtrain.lowering.explicit.collectives import Context, Sharded
from xtrain.lowering.explicit.interpreter import interpret, module_path
from xtrain.lowering.explicit.layer_scan import find_repeated_blocks
from xtrain.lowering.explicit.layout import Layout
from xtrain.lowering.xla_partitioner import TrainState
from xtrain.sharding.annotate import tracing_for
from xtrain.sharding.plan import Spec, _axes_of
from xtrain.remat import LayerRemat
from xtrain.step_options import StepOptions


def _layout(spec: Spec, ndim: int) -> Layout:
    dims = tuple(_axes_of(e) for e in spec[:ndim])
    return Layout(dims + ((),) * (ndim - len(dims)))


class Program:
    """Builds the per-device forward for one batch shape and records what it emitted."""

    def __init__(self, model: Model, mesh, param_specs: dict[str, Spec], batch_spec: Spec,
                 scan_layers: bool = True, remat: LayerRemat | None = None):
        self.model, self.mesh, self.scan_layers, self.remat = model, mesh, scan_layers, remat
        self.param_specs, self.batch_spec = param_specs, batch_spec
        self.batch_axes = tuple(a for e in batch_spec for a in _axes_of(e))
        self.ctx: Context | None = None
        self.repeated: list = []
        self.scanned: set[str] = set()  # stacked parameters the layer scan reads in place
        self.regather: C.RegatherPolicy | None = None  # ZeRO-3's re-gather (set by `build`)

    def _input_layouts(self, params, buffers, key, batch) -> list[Layout]:
        spec_tree = (
            {n: _layout(self.param_specs[n], p.ndim) for n, p in params.items()},
            {n: Layout.replicated(b.ndim) for n, b in buffers.items()},
            Layout.replicated(key.ndim),
            tuple(_layout(self.batch_spec, x.ndim) if hasattr(x, "ndim") else None for x in batch),
        )
        return jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, Layout))

    def forward(self, training: bool, global_args) -> Callable:
        """Traces the model's global jaxpr for these argument shapes (outside shard_map) and
        returns the per-device function: local params, buffers, key, batch -> loss, buffers."""

        def apply(params, buffers, key, batch):
            return self.model.apply(params, buffers, key, batch, training=training)

        with tracing_for(self.mesh):  # xtrain.shard calls in the model become sharding_constraint
            closed, out_shape = jax.make_jaxpr(apply, return_shape=True)(*global_args)
        layouts = self._input_layouts(*global_args)
        avals = jax.tree.leaves(global_args)
        repeated = self._repeated_blocks(closed.jaxpr, len(jax.tree.leaves(global_args[0])))
        by_var = dict(zip(closed.jaxpr.invars, sorted(global_args[0])))  # a dict's leaves: sorted keys
        self.scanned = {by_var[v] for blocks in repeated for v in blocks.stacked if v is not None}

        num_params = len(jax.tree.leaves(global_args[0]))

        def local(params, buffers, key, batch):
            leaves = jax.tree.leaves((params, buffers, key, batch))
            ins = [Sharded(v, l, tuple(a.shape), a.dtype, param=i < num_params)
                   for i, (v, l, a) in enumerate(zip(leaves, layouts, avals))]
            self.ctx = Context(dict(self.mesh.shape), self.model.module_paths(), batch_axes=self.batch_axes,
                               remat=self.remat if training else None,
                               regather=self.regather if training else None, unroll=not self.scan_layers)
            outs = interpret(self.ctx, closed.jaxpr, closed.consts, ins, repeated)
            outs = [C.replicate(self.ctx, o).value for o in outs]
            return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

        return local

    def _repeated_blocks(self, jaxpr, num_params: int) -> list:
        probe = Context(dict(self.mesh.shape), self.model.module_paths())
        self.repeated = find_repeated_blocks(jaxpr, lambda e: module_path(probe, e, ""), jaxpr.invars[:num_params])
        if self.remat is not None and not self.repeated:
            raise ValueError(
                f"remat={self.remat.mode.value!r} checkpoints each layer of the model's repeated blocks, but "
                f"{self.model.name} has none (no run of identical blocks.0, blocks.1, ...); use remat='off'")
        return self.repeated


def _global_args(state: TrainState, batch: tuple):
    """Global shapes of the model function's arguments: (params, buffers, key, batch)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        ({**state.params, **state.frozen}, state.buffers, state.key, batch))


def build(model: Model, tx: optax.GradientTransformation, shardings: TrainState, mesh,
          param_specs: dict[str, Spec], batch_spec: Spec, sync: gradient_sync.GradSync,
          scan_layers: bool = True, zero: int = 0, optimizer_specs: dict[str, Spec] | None = None,
          regather: bool = True, options: StepOptions = StepOptions(), grad_tx: GradTransforms = GradTransforms(),
          remat: LayerRemat | None = None):
    """jit-compiled (train_step, eval_step, program) for the explicit lowering.

    train_step(state, batch, lrs) -> (state, {"loss", and "grad_norm" when computed})."""
    gradient_sync.check_axes(sync, dict(mesh.shape))
    program = Program(model, mesh, param_specs, batch_spec, scan_layers, remat=remat)
    specs = jax.tree.map(lambda s: s.spec, shardings)
    grad_axes = {n: tuple(a for a in program.batch_axes if a not in {x for e in param_specs[n] for x in _axes_of(e)})
                 for n in param_specs}
    update = zero_update.Update(dict(mesh.shape), program.batch_axes, param_specs, optimizer_specs or param_specs,
                                zero, tx, grad_tx, bucket_bytes=sync.bucket_bytes)
    zero3 = any(set(_axes_of(e)) & set(program.batch_axes) for spec in param_specs.values() for e in spec)
    program.regather = C.RegatherPolicy(program.batch_axes) if zero3 and regather else None
    # ZeRO-2 reduce-scatters the gradients it splits instead of all-reducing them
    sync_axes = {n: () if update.scatters(n) else a for n, a in grad_axes.items()}
    steps = options.accumulate

    def batch_specs(batch):
        return tuple(PartitionSpec(*batch_spec[: x.ndim]) if hasattr(x, "ndim") else None for x in batch)

    def train_step(state: TrainState, batch: tuple, lrs):
        forward = program.forward(True, _global_args(state, accumulation.micro_shapes(batch, steps)))

        def per_device(state: TrainState, batch, lrs):
            key = jax.random.fold_in(state.key, state.step)
            scale = state.loss_scale["scale"] if state.loss_scale is not None else None

            def loss_of(params, buffers, micro, index):
                micro_key = key if steps == 1 else jax.random.fold_in(key, index)
                loss, buffers = forward({**params, **state.frozen}, buffers, micro_key, micro)
                return accumulation.objective(loss, scale), (loss, buffers)

            if program.regather is not None and remat is None:
                # ZeRO-3: the backward pass gathers each weight again instead of keeping every
                # gathered weight alive (the layer scan does it per layer: Program.regather).
                # Not with remat: the outermost jax.checkpoint's policy decides for everything
                # inside it, the layer scan's remat policy included; the layers' weights are
                # then gathered again by that policy, the rest stay gathered (FSDP's root).
                loss_of = jax.checkpoint(loss_of, policy=program.regather)

            params = {n: lax.pcast(p, grad_axes[n], to="varying") if grad_axes[n] else p
                      for n, p in state.params.items()}
            loss, buffers, grads = accumulation.value_and_grad(loss_of, params, state.buffers, batch, steps)
            grads = gradient_sync.sync(grads, sync_axes, sync)
            new_params, opt_state, norm = update(grads, state.opt_state, state.params, lrs, scale)
            new = dataclasses.replace(state, params=new_params, buffers={**state.buffers, **buffers},
                                      opt_state=opt_state)
            return finish_step(state, new, loss, norm, grad_tx)

        mapped = jax.shard_map(ordering.in_order(per_device), mesh=mesh,
                               in_specs=(specs, batch_specs(batch), PartitionSpec()),
                               out_specs=(specs, PartitionSpec()), check_vma=True)
        return mapped(state, batch, lrs)

    def eval_step(state: TrainState, batch: tuple):
        global_args = _global_args(state, batch)
        forward = program.forward(False, global_args)

        def per_device(state: TrainState, batch):
            key = jax.random.fold_in(state.key, state.step)
            loss, _ = forward({**state.params, **state.frozen}, state.buffers, key, batch)
            return loss

        mapped = jax.shard_map(ordering.in_order(per_device), mesh=mesh, in_specs=(specs, batch_specs(batch)),
                               out_specs=PartitionSpec(), check_vma=True)
        return mapped(state, batch)

    train = jax.jit(train_step, out_shardings=(shardings, jax.sharding.NamedSharding(mesh, PartitionSpec())),
                    donate_argnums=0)
    return train, jax.jit(eval_step), program
