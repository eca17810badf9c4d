"""The compiled training step users call: `step(*batch)`, `step.eval`, `state_dict`, `report`.

`TrainStep` resolves the state layout (xtrain.sharding.layout), places the initial state and
lowers the step (xtrain.lowering.lower) for a plan; with `plan="auto"` it does so at the first
call, for the plan the cost model picks from the batch's shapes (xtrain.autoplan). Reports,
checkpoints and exports are helpers beside it (xtrain.explain, xtrain.checkpoint).

A caller that runs a user's script, such as the `xtrain report` and `xtrain plan` commands, takes
the script's first step call over with `xtrain.hooks.intercept_first_step`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from xtrain import autoplan, checkpoint, data, explain, guards, hooks, recompile, runtime
from xtrain.cost import hardware
from xtrain.frontend import tensors
from xtrain.ir import stacked
from xtrain.ir.model import Model, Trainable
from xtrain.ir.tree import rebuild
from xtrain.lowering import accumulation, input_checks, platforms, precision
from xtrain.lowering import state as state_mod
from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.lowering.gradient_sync import GradSync
from xtrain.lowering.lower import lower
from xtrain.lowering.options import StepOptions
from xtrain.lowering.pipeline.program import placement
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import StepConfig, StepProgram
from xtrain.runtime import devices as runtime_devices
from xtrain.sharding import layout as layout_mod
from xtrain.sharding.experts import expert_parallel
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import PendingPlan, Plan

AUTO = "auto"
RESIDUAL = "grad_residual/"  # checkpoint names of the TrainState's per-device leaves (int8 error feedback)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """What `xtrain.compile` was given besides the model, the mesh and the plan (see its
    docstring for each)."""

    seed: int = 0
    lowering: str = "explicit"
    grad_sync: GradSync | None = None
    scan_layers: bool | str = "auto"
    zero3_regather: bool | None = None
    init_from: str | os.PathLike | None = None
    step: StepOptions = StepOptions()


def _to_host(x: jax.Array) -> np.ndarray:
    return np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))


def host_batch(batch: tuple) -> tuple:
    """The batch's arrays on the host (numpy), for what reads only their shapes."""
    return tuple(x if x is None or isinstance(x, (bool, int, float, str)) else tensors.to_numpy(x) for x in batch)


class TrainStep:
    """A model compiled for a mesh and plan. Call it with one global batch per step."""

    def __init__(self, trainable: Trainable, mesh: Mesh, plan: Plan | str, options: CompileOptions = CompileOptions()):
        self.trainable, self.options, self.search = trainable, options, None
        self._intercept = hooks.first_step()
        self._pending_load: str | os.PathLike | None = None
        self._built, self._mesh = False, None
        self._request, self.plan = (mesh, plan), plan
        if isinstance(plan, PendingPlan):  # its rules come from the program traced on the first batch
            self._mesh = mesh.build()
        elif plan == AUTO:
            devices = len(jax.devices())
            if np.prod(list(mesh.resolve(devices).values())) != devices:
                raise ValueError(f"plan='auto': {mesh} does not cover the {devices} devices")
        elif self._intercept is None or self._intercept.build:
            self._build(mesh.build(), plan)

    # -- building --------------------------------------------------------------------------
    def _build(self, mesh: jax.sharding.Mesh, plan: Plan) -> None:
        runtime_devices.check_plan_precision(plan.precision.compute.value)  # Neuron reads its flags at start
        emulated = getattr(runtime.emulated_cluster(), "instance", None)  # bf16 on V100s (or emulated p3s): an error
        hardware.check_device_precision(mesh.devices.flat[0].device_kind, plan.precision.compute.value, emulated)
        model = precision.apply_policy(self.trainable.model.specialised(plan.trace_options(dict(mesh.shape), self.options.lowering)), plan.precision)
        shapes = model.param_shapes()
        plan = expert_parallel(plan, self.trainable.experts, dict(mesh.shape),
                               {n: tuple(s.shape) for n, s in shapes.items()},
                               getattr(self.trainable.model, "name", "the model"))
        self._mesh, self.plan = mesh, plan
        scan = layout_mod.scan_layers_for(self.options.scan_layers, shapes, mesh.devices.flat[0].platform,
                                          jax.local_device_count())
        self.layout = layout_mod.resolve(plan, dict(mesh.shape), shapes, optimized=self.trainable.optimized,
                                         lr_groups=self.trainable.lr_groups, scan_layers=scan)
        self.model = stacked.stored_model(model, self.layout.stacking)
        self.state = self._placed(self._initial_state())
        self._program = self._lower(self.layout)
        self._last_batch: tuple | None = None
        self._compiled_for: list[recompile.Signature] = []  # batch signatures compiled so far
        self._built = True
        if self._pending_load is not None:
            path, self._pending_load = self._pending_load, None
            self.load(path, verify=False)  # verified when load() deferred it

    def _config(self, remat="plan") -> StepConfig:
        plan, options = self.plan, self.options
        grad_tx = GradTransforms.of(options.step, self.trainable.lr_groups, plan.precision.loss_scale)
        return StepConfig(tx=self.trainable.tx, options=options.step, grad_tx=grad_tx,
                          sync=options.grad_sync or GradSync(comm_dtype=plan.precision.wire_dtype),
                          remat=plan.layer_remat() if remat == "plan" else remat, capacity_factor=plan.capacity_factor,
                          regather=options.zero3_regather is not False, offload_optimizer=self.layout.offload_optimizer)

    def _lower(self, layout: StateLayout, remat="plan") -> StepProgram:
        return lower(self.model, self.mesh, layout, self.shardings, self._config(remat), lowering=self.options.lowering,
                     pipeline=self.plan.pipeline)

    def _initial_state(self) -> TrainState:
        model, layout = self.model, self.layout
        if self.options.init_from is None:
            params, buffers = model.initial_params(), model.initial_buffers()
        else:  # sharded init: each process reads only its devices' regions of the file
            params = checkpoint.load_sharded(self.options.init_from, model.param_shapes(),
                                             state_mod.named(self.mesh, layout.param_specs), self._aliases())
            buffers = model.initial_buffers(checkpoint.read_stored(self.options.init_from, model.buffer_names()))
        residual = state_mod.residual_zeros(layout, model.param_shapes()) if self._config().sync.int8 else None
        return state_mod.initial(params, buffers, layout.optimized, self.trainable.tx, self.options.seed,
                                 precision.initial_state(self.plan.precision), residual)

    def _aliases(self) -> dict[str, list[str]]:
        """Tied tensors' other names, per canonical name (a file may store either)."""
        aliases = getattr(self.model, "param_aliases", {})
        return {name: [a for a, n in aliases.items() if n == name] for name in set(aliases.values())}

    def _placed(self, state: TrainState) -> TrainState:
        self.shardings = state_mod.shardings(state, self.layout, self.mesh)
        return state_mod.in_order(jax.device_put(state, self.shardings), self.layout, self.shardings, to_torch=False)

    def _place_stages(self, placed: tuple) -> None:
        """Pipeline plans, before the first step runs: move each block parameter family onto
        the stage that runs it (stored stacked, rows split over the pipe axis), so a stage
        stores only its own layers and their optimizer state. The stage partition is balanced
        on the traced graph, which needs the batch shapes: hence now, not at compile."""
        if self.plan.pipeline is None or self.layout.stage_starts is not None:
            return
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                              ({**self.state.params, **self.state.frozen}, self.state.buffers, self.state.key, placed))
        where = placement(self.model, self.mesh, self.layout, self.plan.pipeline, shapes)
        self.layout = layout_mod.place_stages(self.layout, where)
        if self.layout.stacking:
            shape = jax.eval_shape(lambda s: state_mod.restacked(s, self.layout.stacking, self.trainable.tx), self.state)
            self.shardings = state_mod.shardings(shape, self.layout, self.mesh)
            restack = jax.jit(lambda s: state_mod.restacked(s, self.layout.stacking, self.trainable.tx),
                              out_shardings=self.shardings)
            self.model = stacked.stored_model(self.model, self.layout.stacking)
            self.state = restack(self.state)
        self._program = self._lower(self.layout)

    def _choose_plan(self, batch: tuple) -> None:
        """plan="auto": the cost model's pick for the current devices, agreed by every process
        (xtrain.autoplan); `self.search` keeps the search."""
        self.search = autoplan.search_plans(self.trainable, host_batch(batch), pipelines=self._searches_pipelines)
        best = autoplan.agreed_pick(self.search)
        tensor = autoplan.search.tensor_plan(self.trainable.model, host_batch(batch)) \
            if self.trainable.structure is not None else None
        self._build(Mesh(**best.mesh).build(), best.plan(tensor))

    @property
    def _searches_pipelines(self) -> bool:
        return self.options.step.accumulate == 1  # the pipeline step refuses accumulate > 1

    def _ensure_built(self, batch: tuple) -> None:
        if not self._built:
            mesh, plan = self._request
            if isinstance(plan, PendingPlan):
                plan = plan.resolved(self.trainable.model, host_batch(batch))
            self._choose_plan(batch) if plan == AUTO else self._build(mesh.build(), plan)

    def _require_built(self, what: str) -> None:
        if not self._built:
            which = "plan='auto' chooses the plan" if self.plan == AUTO else "plans.megatron derives its rules"
            raise RuntimeError(f"{which} at the first step(*batch) (it needs the batch shapes); "
                               f"call the step once before {what}")

    # -- running ---------------------------------------------------------------------------
    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The device mesh. Before plan="auto" has chosen its plan it is not known (an error);
        under `xtrain plan` (a step left unbuilt) a one-device mesh of this host stands in, so a
        script reaches its first step."""
        if self._mesh is not None:
            return self._mesh
        if self.plan != AUTO:
            return Mesh(data=1).build(jax.local_devices()[:1])
        self._require_built(".mesh")

    batch_spec = property(lambda self: self.layout.batch_spec if self._built else ("data",))

    lowering = property(lambda self: self.options.lowering)

    @property
    def param_specs(self) -> dict:
        """Every stored parameter's spec (xtrain.sharding.layout: `step.layout` holds the rest)."""
        self._require_built(".param_specs")
        return dict(self.layout.param_specs)

    @property
    def scan_layers(self) -> bool:
        self._require_built(".scan_layers")
        return self.layout.scan_layers

    def _place(self, batch: tuple) -> tuple:
        return data.shard_batch(batch, self.mesh, self.layout.batch_spec, dict(self.layout.batch_args))

    def _data_size(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.layout.batch_axes]))

    def _lrs(self) -> jax.Array:
        """The current lr of every param group (a torch scheduler may have changed them),
        replicated on the mesh (every process holds the same values)."""
        rates = self.trainable.learning_rates
        lrs = rates.current() if rates is not None else np.zeros((0,), np.float32)
        return jax.make_array_from_callback(lrs.shape, NamedSharding(self.mesh, PartitionSpec()), lambda i: lrs[i])

    def __call__(self, *batch: Any) -> dict[str, float]:
        """One optimizer step on a global batch: {"loss": float}, "grad_norm" (before clipping) and
        "skipped" when the step can skip updates (clipping, detect_nan, input checks, fp16), "loss_scale"
        under fp16, "expert_tokens" ({MoE layer: tokens per expert}); a skipped step raises unless fp16 skipped it."""
        if self._intercept is not None:
            intercept, self._intercept = self._intercept, None
            if intercept.build:
                self._ensure_built(batch)
            intercept.run(self, batch)
        guards.check_not_empty(batch)
        self._ensure_built(batch)
        placed = self._place(batch)
        accumulation.check_divisible(placed, self.options.step.accumulate, self._data_size())
        self._place_stages(placed)
        self._guard(placed)
        self._last_batch = placed
        self.state, out = self._program.train(self.state, placed, self._lrs())
        if self.trainable.learning_rates is not None:
            self.trainable.learning_rates.mark_stepped()
        out = {k: bool(v) if k == "skipped" else jax.tree.map(np.asarray, v) if isinstance(v, dict) else float(v)
               for k, v in out.items()}
        if out.get("skipped"):
            guards.explain_skip(self, out, placed)
        return out

    def _guard(self, placed: tuple) -> None:
        now = recompile.signature(placed)
        recompile.check(self._compiled_for, now, self.options.step.shape_limit)
        if now not in self._compiled_for:
            self._compiled_for.append(now)

    def eval(self, *batch: Any) -> dict[str, float]:
        """The loss in eval mode (dropout off, running statistics); updates nothing. The batch's
        indices are checked on the host first (input checks), as the training step does."""
        guards.check_not_empty(batch)
        self._ensure_built(batch)
        placed = self._place(batch)
        self._place_stages(placed)
        if self.options.step.check_inputs:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  (self.state.buffers, self.state.key, placed))
            guards.raise_for_inputs(self.step_count, input_checks.for_model(self.model, *shapes).checks, placed,
                                    during="eval")
        loss = self._program.eval(self.state, placed)
        return {"loss": float(loss[0] / loss[1] if isinstance(loss, tuple) else loss)}

    @property
    def compilations(self) -> int:
        """Programs the training step has compiled: 1 after the first call, more only when
        allow_recompile let a new batch shape through (a new lr never adds one)."""
        return self._program.train._cache_size() if self._built else 0

    @property
    def step_count(self) -> int:
        if not self._built:
            return checkpoint.read_manifest(self._pending_load)["step"] if self._pending_load is not None else 0
        return int(self.state.step)

    # -- state -----------------------------------------------------------------------------
    def user_model(self) -> Model:
        """The model under its own per-layer parameter names (what `stacking` unstacks to)."""
        return self.model.inner if isinstance(self.model, stacked.StackedModel) else self.model

    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) tensors under the model's own names; for torch modules every key
        of `module.state_dict()`, loadable with `load_state_dict(strict=True)`. Before plan="auto"
        has chosen its plan: the model's initial state."""
        if not self._built:
            if self._pending_load is not None:
                self._require_built(f"state_dict() of the checkpoint loaded from {self._pending_load}")
            model = self.trainable.model
            return tensors.state_dict(model.export_state(model.initial_params(), model.initial_buffers()))
        state = state_mod.in_order(self.state, self.layout, self.shardings, to_torch=True)  # fused splits: torch's order
        params = {n: _to_host(v) for n, v in {**state.params, **state.frozen}.items()}
        buffers = {n: _to_host(v) for n, v in self.state.buffers.items()}
        out = self.user_model().export_state(self.layout.stacking.unstack_dict(params), buffers)
        return tensors.state_dict(out)

    def save(self, path: str | os.PathLike, extra: dict | None = None, *, blocking: bool = True):
        """Saves the whole training state (parameters, frozen parameters, buffers, optimizer
        state, step count, RNG key: every field of the TrainState) to the directory `path`.
        Every process calls it and writes only its own shards. The save is atomic: `path`
        appears only once every process has finished.

        Args:
            extra: JSON-serialisable data stored alongside (e.g. the data position); `load`
                returns it.
            blocking: False copies the state to host now and writes it in a background thread;
                call `.wait()` on the returned handle before relying on it. Saves to one path run
                one after another (one still writing delays the next): the later save's stays, whole.

        Returns:
            An `xtrain.checkpoint.SaveHandle`; `.wait()` returns the committed path.
        """
        self._require_built("save()")
        return checkpoint.save(state_mod.in_order(self.state, self.layout, self.shardings, to_torch=True), path,
                               step=self.step_count, extra=extra, blocking=blocking, rows=self.layout.stacking.row_table())

    def load(self, path: str | os.PathLike, *, verify: bool = True) -> dict:
        """Restores a checkpoint written by `save`, under any mesh and plan (tensors are stored
        under logical names and global shapes and are resharded on load: each process reads
        only the regions its devices hold). Returns the `extra` dict saved with it. Before
        plan="auto" has chosen its plan the checkpoint is verified now and restored onto the
        chosen plan at the first step (the normal restart path).

        Args:
            verify: check every byte read against the checksums written with it (a corrupt
                file is a CheckpointError naming it; the state is then unchanged). False
                skips the checksums (the manifest and shapes are still checked)."""
        if not self._built:
            manifest = checkpoint.verify_all(path) if verify else checkpoint.read_manifest(path)
            self._pending_load = path
            return manifest["extra"]
        rows = self.layout.stacking.row_table()
        values, manifest = checkpoint.restore(path, self.state, rows=rows, per_device=(RESIDUAL,), verify=verify)
        self.state = state_mod.in_order(rebuild(self.state, values), self.layout, self.shardings, to_torch=False)
        return manifest["extra"]

    def export(self, path: str | os.PathLike | None = None):
        """Writes `state_dict()` (full tensors under the torch module's own names) to `path`:
        `.safetensors`, or `.pt`/`.pth`/`.bin` for torch.save. Every process calls it (the
        tensors are gathered); process 0 writes. Loads with `module.load_state_dict` or, written
        as `model.safetensors` next to an HF config, with `from_pretrained`. No path, in a SageMaker
        job: SM_MODEL_DIR/model.safetensors, uploaded when the job ends. Returns the path."""
        return checkpoint.export(self.state_dict(), runtime.sagemaker.export_path() if path is None else path)

    # -- explanation (xtrain.explain) --------------------------------------------------------
    def _shapes(self, batch: tuple) -> tuple:
        if batch:
            self._ensure_built(batch)
        self._require_built("program(), compiled() or report() without a batch")
        placed = self._place(batch) if batch else self._last_batch
        if placed is None:
            raise RuntimeError("needs the batch shapes: pass a batch or run step(*batch) once first")
        self._place_stages(placed)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, placed)

    def program(self, *batch: Any):
        """The program xtrain emits for XLA (a ClosedJaxpr) for `batch`'s shapes or the last batch."""
        shapes = self._shapes(batch)  # first: a pipeline places its stages (new state and program)
        return jax.make_jaxpr(self._program.train)(self.state, shapes, self._lrs())

    def compiled(self, *batch: Any, remat="plan"):
        """The XLA-compiled training step (jax `Compiled`) for `batch`'s shapes, or for the
        last batch trained on. `.as_text()` gives the optimized HLO."""
        shapes = self._shapes(batch)
        program = self._program if remat == "plan" else self._lower(self.layout, remat)
        return program.train.lower(self.state, shapes, self._lrs()).compile()

    def lower(self, *batch: Any, platform: str | None = None):
        """The training step (jax `Lowered`) for `platform` ("cuda", "neuron", "cpu"; None: these
        devices) without its devices, for `batch`'s shapes or the last batch: what XLA receives
        there before its own passes (xtrain.lowering.platforms). `.as_text(dialect="hlo")`: HLO."""
        shapes = self._shapes(batch)  # first: a pipeline places its stages (new state and program)
        traced = self._program.train.trace(self.state, shapes, self._lrs())
        return traced.lower(lowering_platforms=platforms.lowering_platforms(platform))

    def report(self, *batch: Any):
        """Collectives and per-device memory of the compiled training step, for `batch`'s
        shapes or the last batch trained on (xtrain.explain.report)."""
        return explain.report(self, *batch)

    @property
    def lowered(self) -> StepProgram:
        """The lowered step (its strategy's notes feed the report)."""
        self._require_built(".lowered")
        return self._program
