"""The compiled training step users call: `step(*batch)`, `step.eval`, `state_dict`, `report`."""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from xtrain import data
from xtrain.frontend.model import Model
from xtrain.lowering import report as report_mod
from xtrain.lowering import xla_partitioner
from xtrain.lowering.explicit import accounting
from xtrain.lowering.explicit import step as explicit_step
from xtrain.lowering.explicit.gradient_sync import GradSync
from xtrain.lowering.xla_partitioner import TrainState
from xtrain.sharding import zero as zero_mod
from xtrain.sharding.plan import Plan, _axes_of

REPORT_ONLY = "XTRAIN_REPORT_ONLY"  # set by `xtrain report`: print the first step's report, exit


def _to_host(x: jax.Array) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _regather_default() -> bool:
    """ZeRO-3 re-gathers weights in the backward pass (remat) except on XLA's CPU runtime: there
    the re-gather inside the layer scan deadlocks its collective rendezvous (seen with jax
    0.10.2 on 8 emulated devices; the weights are then kept from the forward pass)."""
    from xtrain.runtime import backend

    return backend() != "cpu"


class TrainStep:
    """A model compiled for a mesh and plan. Call it with one global batch per step."""

    def __init__(self, model: Model, mesh: jax.sharding.Mesh, plan: Plan,
                 tx: optax.GradientTransformation, optimized: set[str], seed: int = 0,
                 lowering: str = "explicit", grad_sync: GradSync | None = None, scan_layers: bool = True,
                 zero3_regather: bool | None = None):
        self.model, self.mesh, self.plan, self.tx = model, mesh, plan, tx
        self.lowering = lowering
        mesh_axes = dict(mesh.shape)
        params = model.initial_params()
        shapes = {n: p.shape for n, p in params.items()}
        self.batch_spec = plan.batch_spec(mesh_axes)
        data_axes = tuple(a for e in self.batch_spec for a in _axes_of(e))
        self.param_specs, self.optimizer_specs, self.zero_whole = zero_mod.specs_for_stage(
            shapes, plan.param_specs(shapes, mesh_axes), mesh_axes, data_axes, plan.zero)
        named = lambda specs: {n: NamedSharding(mesh, PartitionSpec(*s)) for n, s in specs.items()}
        state = self._initial_state(params, optimized, seed)
        self.shardings = xla_partitioner.state_shardings(state, named(self.param_specs), mesh,
                                                         named(self.optimizer_specs))
        self.state: TrainState = jax.device_put(state, self.shardings)
        if plan.pipeline is not None:
            self._train, self._eval, self._program = self._pipeline(grad_sync, lowering)
        elif lowering == "explicit":
            self._train, self._eval, self._program = explicit_step.build(
                model, tx, self.shardings, mesh, self.param_specs, self.batch_spec, grad_sync or GradSync(),
                scan_layers, zero=plan.zero, optimizer_specs=self.optimizer_specs,
                regather=_regather_default() if zero3_regather is None else zero3_regather)
        else:
            self._train, self._eval = xla_partitioner.compile_steps(model, tx, self.shardings, mesh)
        self._last_batch: tuple | None = None

    def _pipeline(self, grad_sync: GradSync | None, lowering: str):
        from xtrain.lowering.pipeline import step as pipeline_step

        if lowering != "explicit":
            raise ValueError(f"pipeline parallelism needs lowering='explicit' (got {lowering!r})")
        return pipeline_step.build(self.model, self.tx, self.shardings, self.mesh, self.param_specs, self.batch_spec,
                                   grad_sync or GradSync(), self.plan.pipeline, zero=self.plan.zero,
                                   optimizer_specs=self.optimizer_specs)

    def _initial_state(self, params: dict, optimized: set[str], seed: int) -> TrainState:
        opt_params = {n: v for n, v in params.items() if n in optimized}
        return TrainState(
            params=opt_params,
            frozen={n: v for n, v in params.items() if n not in optimized},
            buffers=self.model.initial_buffers(),
            opt_state=jax.jit(self.tx.init)(opt_params),
            step=np.int32(0),
            key=jax.random.key_data(jax.random.key(seed)),
        )

    # -- running ---------------------------------------------------------------------------
    def _place(self, batch: tuple) -> tuple:
        return data.shard_batch(batch, self.mesh, self.batch_spec)

    def __call__(self, *batch: Any) -> dict[str, float]:
        """Runs one optimizer step on a global batch; returns {"loss": float}.

        Under XTRAIN_REPORT_ONLY=1 (`xtrain report script.py`) the first call prints the
        step's report instead and exits the process (status 0) without training."""
        if os.environ.get(REPORT_ONLY, "") not in ("", "0"):
            self._report_and_exit(batch)
        placed = self._place(batch)
        self._last_batch = placed
        self.state, loss = self._train(self.state, placed)
        return {"loss": float(loss)}

    def _report_and_exit(self, batch: tuple) -> None:
        text = str(self.report(*batch))
        if jax.process_index() == 0:
            print(text, flush=True)
        raise SystemExit(0)

    def eval(self, *batch: Any) -> dict[str, float]:
        """The loss in eval mode (dropout off, running statistics); updates nothing."""
        return {"loss": float(self._eval(self.state, self._place(batch)))}

    @property
    def step_count(self) -> int:
        return int(self.state.step)

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, "Any"]:
        """Full (unsharded) tensors under the model's own names; for torch modules every key
        of `module.state_dict()`, loadable with `load_state_dict(strict=True)`."""
        import torch

        params = {n: _to_host(v) for n, v in {**self.state.params, **self.state.frozen}.items()}
        buffers = {n: _to_host(v) for n, v in self.state.buffers.items()}
        out = self.model.export_state(params, buffers)
        return {k: torch.from_numpy(np.array(v)) for k, v in out.items()}

    # -- explanation -----------------------------------------------------------------------
    def _shapes(self, batch: tuple) -> tuple:
        placed = self._place(batch) if batch else self._last_batch
        if placed is None:
            raise RuntimeError("needs the batch shapes: pass a batch or run step(*batch) once first")
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, placed)

    def program(self, *batch: Any):
        """The program xtrain emits for XLA (a ClosedJaxpr) for `batch`'s shapes or the last batch."""
        return jax.make_jaxpr(self._train)(self.state, self._shapes(batch))

    def compiled(self, *batch: Any):
        """The XLA-compiled training step (jax `Compiled`) for `batch`'s shapes, or for the
        last batch trained on. `.as_text()` gives the optimized HLO."""
        return self._train.lower(self.state, self._shapes(batch)).compile()

    def report(self, *batch: Any) -> report_mod.Report:
        """Collectives and per-device memory of the compiled training step, for `batch`'s
        shapes or the last batch trained on."""
        compiled = self.compiled(*batch)
        sizes = dict(self.mesh.shape)
        replicated = [n for n, s in self.param_specs.items() if not s]
        notes = [f"{len(replicated)} of {len(self.param_specs)} parameters replicated on every device"]
        if self.zero_whole:
            notes.append(f"ZeRO-{self.plan.zero} keeps {len(self.zero_whole)} tensors whole (no dimension divisible "
                         f"by the data size): {self.zero_whole[:8]}{' ...' if len(self.zero_whole) > 8 else ''}")
        if self.lowering == "explicit":
            found = accounting.collectives(self.program(*batch), sizes, self.model.module_paths())
            notes += self._program.describe() if self.plan.pipeline is not None else []
            for prim, paths in sorted(self._program.ctx.fallbacks.items()):
                notes.append(f"no partition rule for {prim}: gathered and run replicated in {sorted(paths)}")
        else:
            found = report_mod.collectives_from_hlo(compiled.as_text(), sizes)
        from xtrain.plans import largest_replicated

        # ZeRO-2 reduces gradients straight to the optimizer-state shards
        grad_specs = self.optimizer_specs if self.plan.zero == 2 else self.param_specs
        grads = {n: NamedSharding(self.mesh, PartitionSpec(*s)) for n, s in grad_specs.items()}
        return report_mod.Report(self.lowering, sizes, found, report_mod.memory_of(compiled), notes,
                                 report_mod.state_memory(self.state, grads), list(self.plan.notes),
                                 largest_replicated(self))
