"""The compiled training step users call: `step(*batch)`, `step.eval`, `state_dict`, `report`.

A `TrainStep` is in one of two states: `Deferred` (a request: mesh and plan, waiting for the
first batch's shapes) or built (`xtrain.lowering.assembly.BuiltStep`, plus the placed state).
The assembly (one pure function, shared with the cost model and the plan search) decides the
layout, the pipeline's stages and the program; the step only places the state and runs.
Plans that are built at `xtrain.compile`: every plan that needs no batch shapes. Deferred to
the first call: `plan="auto"` (the cost model picks from the batch's shapes: xtrain.step.autoplan), a
pending `plans.megatron(model, mesh)` (derived from the program traced on the batch) and a
pipeline (its stages are balanced on the model traced at the batch's shapes).

A caller that runs a user's script, such as the `xtrain report` and `xtrain plan` commands, takes
the script's first step call over with `xtrain.step.hooks.intercept_first_step`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from xtrain import checkpoint, data, runtime
from xtrain.cost import hardware
from xtrain.errors import MeshError, NotBuiltError
from xtrain.frontend import tensors
from xtrain.ir import stacked
from xtrain.ir.model import Model, Trainable
from xtrain.ir.tree import rebuild
from xtrain.lowering import accumulation, assembly, input_checks, platforms, precision
from xtrain.lowering import state as state_mod
from xtrain.lowering.assembly import AssemblyOptions, BuiltStep
from xtrain.lowering.gradient_sync import GradSync
from xtrain.lowering.options import StepOptions
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import StepProgram
from xtrain.runtime import devices as runtime_devices
from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import PendingPlan, Plan
from xtrain.step import autoplan, explain, guards, hooks, recompile

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

    def assembly(self) -> AssemblyOptions:
        """The options that shape the step (the rest say where its state comes from)."""
        return AssemblyOptions(lowering=self.lowering, grad_sync=self.grad_sync, scan_layers=self.scan_layers,
                               regather=self.zero3_regather is not False, step=self.step)


@dataclasses.dataclass(frozen=True)
class Deferred:
    """A step waiting for its first batch: the mesh and plan asked for.

    Attributes:
        mesh: the requested mesh.
        plan: a Plan (a pipeline, balanced on the traced batch), a PendingPlan or "auto".
        devices: the built mesh where it is known before the plan (not for "auto", whose pick
            chooses the mesh; not for a step left unbuilt by `xtrain plan`).
    """

    mesh: Mesh
    plan: Plan | PendingPlan | str
    devices: jax.sharding.Mesh | None = None

    def waits_for(self) -> str:
        if self.plan == AUTO:
            return "plan='auto' chooses the plan"
        if isinstance(self.plan, PendingPlan):
            return "plans.megatron derives its rules"
        return "the pipeline balances its stages on the traced model"


def _to_host(x: jax.Array) -> np.ndarray:
    return np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True))


def host_batch(batch: tuple) -> tuple:
    """The batch's arrays on the host (numpy), for what reads only their shapes."""
    return tuple(x if x is None or isinstance(x, (bool, int, float, str)) else tensors.to_numpy(x) for x in batch)


def _shapes(placed: tuple) -> tuple:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, placed)


class TrainStep:
    """A model compiled for a mesh and plan. Call it with one global batch per step."""

    def __init__(self, trainable: Trainable, mesh: Mesh, plan: Plan | str, options: CompileOptions = CompileOptions()):
        self.trainable, self.options, self.search = trainable, options, None
        self._intercept = hooks.first_step()
        self._pending_load: str | os.PathLike | None = None
        self._stage: Deferred | BuiltStep
        self._programs: dict = {}  # batch signature -> the emitted program (a report reads it several times)
        self.state: TrainState | None = None  # placed when the step is built
        self._last_batch: tuple | None = None
        self._compiled_for: list[recompile.Signature] = []  # batch signatures compiled so far
        builds = self._intercept is None or self._intercept.build
        if plan == AUTO:
            devices = len(jax.devices())
            if np.prod(list(mesh.resolve(devices).values())) != devices:
                raise MeshError(f"plan='auto': {mesh} does not cover the {devices} devices")
            self._stage = Deferred(mesh, plan)
        elif isinstance(plan, PendingPlan):
            self._stage = Deferred(mesh, plan, mesh.build())
        elif plan.pipeline is not None and builds:  # what needs no batch is checked now
            self._stage = Deferred(mesh, plan, mesh.build())
            assembly.check(trainable, plan, self._stage.devices, options.assembly())
        elif builds:
            self._build(mesh.build(), plan)
        else:
            self._stage = Deferred(mesh, plan)

    # -- building --------------------------------------------------------------------------
    def _build(self, mesh: jax.sharding.Mesh, plan: Plan, batch: tuple | None = None) -> None:
        """Assembles the step (xtrain.lowering.assembly) and places its initial state."""
        runtime_devices.check_plan_precision(plan.precision.compute.value)  # Neuron reads its flags at start
        emulated = getattr(runtime.emulated_cluster(), "instance", None)  # bf16 on V100s (or emulated p3s): an error
        hardware.check_device_precision(mesh.devices.flat[0].device_kind, plan.precision.compute.value, emulated)
        built = assembly.assemble(self.trainable, plan, mesh, self.options.assembly(),
                                  batch=None if batch is None else assembly.shaped(batch))
        self.state = self._placed(built, self._initial_state(built))
        self._stage = built
        if self._pending_load is not None:
            path, self._pending_load = self._pending_load, None
            self.load(path, verify=False)  # verified when load() deferred it

    def _initial_state(self, built: BuiltStep) -> TrainState:
        model, layout = built.model, built.layout
        if self.options.init_from is None:
            params, buffers = model.initial_params(), model.initial_buffers()
        else:  # sharded init: each process reads only its devices' regions of the file
            params = checkpoint.load_sharded(self.options.init_from, model.param_shapes(),
                                             state_mod.named(built.mesh, layout.param_specs), _aliases(model))
            buffers = model.initial_buffers(checkpoint.read_stored(self.options.init_from, model.buffer_names()))
        residual = state_mod.residual_zeros(layout, model.param_shapes()) if built.config.sync.int8 else None
        return state_mod.initial(params, buffers, layout.optimized, self.trainable.tx, self.options.seed,
                                 precision.initial_state(built.plan.precision), residual)

    @staticmethod
    def _placed(built: BuiltStep, state: TrainState) -> TrainState:
        return state_mod.in_order(jax.device_put(state, built.shardings), built.layout, built.shardings,
                                  to_torch=False)

    def _choose_plan(self, batch: tuple) -> None:
        """plan="auto": the cost model's pick for the current devices, agreed by every process
        (xtrain.step.autoplan); `self.search` keeps the search."""
        self.search = autoplan.search_plans(self.trainable, host_batch(batch), pipelines=self._searches_pipelines)
        best = autoplan.agreed_pick(self.search)
        tensor = autoplan.search.tensor_plan(self.trainable.model, host_batch(batch)) \
            if self.trainable.structure is not None else None
        plan = best.plan(tensor)
        if any(r.fallbacks for r in self.search.rows if r.candidate is best):  # costed with its gathers
            plan = dataclasses.replace(plan, fallback="replicate")
        self._build(Mesh(**best.mesh).build(), plan, host_batch(batch))

    @property
    def _searches_pipelines(self) -> bool:
        return self.options.step.accumulate == 1  # the pipeline step refuses accumulate > 1

    def _ensure_built(self, batch: tuple) -> BuiltStep:
        stage = self._stage
        if isinstance(stage, Deferred):
            if stage.plan == AUTO:
                self._choose_plan(batch)
            else:
                plan = stage.plan.resolved(self.trainable.model, host_batch(batch)) \
                    if isinstance(stage.plan, PendingPlan) else stage.plan
                self._build(stage.devices or stage.mesh.build(), plan, host_batch(batch))
        return self._stage

    @property
    def built(self) -> BuiltStep:
        """The assembled step (layout, stored model, shardings, config, program); an error before
        a deferred step's first call."""
        return self._built_for(".built")

    def _built_for(self, what: str) -> BuiltStep:
        if isinstance(self._stage, Deferred):
            raise NotBuiltError(f"{self._stage.waits_for()} at the first step(*batch) (it needs the batch shapes); "
                               f"call the step once before {what}")
        return self._stage

    # -- what it was built as --------------------------------------------------------------
    @property
    def plan(self) -> Plan | PendingPlan | str:
        return self._stage.plan

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The device mesh. Before plan="auto" has chosen its plan it is not known (an error);
        under `xtrain plan` (a step left unbuilt) a one-device mesh of this host stands in, so a
        script reaches its first step."""
        stage = self._stage
        if not isinstance(stage, Deferred):
            return stage.mesh
        if stage.devices is not None:
            return stage.devices
        if stage.plan != AUTO:
            return Mesh(data=1).build(jax.local_devices()[:1])
        return self._built_for(".mesh").mesh

    layout = property(lambda self: self._built_for(".layout").layout)
    model = property(lambda self: self._built_for(".model").model)
    shardings = property(lambda self: self._built_for(".shardings").shardings)
    lowering = property(lambda self: self.options.lowering)

    @property
    def lowered(self) -> StepProgram:
        """The lowered step (its strategy's notes feed the report)."""
        return self._built_for(".lowered").program

    @property
    def batch_spec(self):
        return self._stage.layout.batch_spec if isinstance(self._stage, BuiltStep) else ("data",)

    @property
    def param_specs(self) -> dict:
        """Every stored parameter's spec (xtrain.sharding.layout: `step.layout` holds the rest)."""
        return dict(self._built_for(".param_specs").layout.param_specs)

    @property
    def scan_layers(self) -> bool:
        return self._built_for(".scan_layers").layout.scan_layers

    # -- running ---------------------------------------------------------------------------
    def _place(self, batch: tuple) -> tuple:
        layout = self.built.layout
        return data.shard_batch(batch, self.mesh, layout.batch_spec, dict(layout.batch_args))

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
        under fp16, "expert_tokens" ({MoE layer: tokens per expert}), "attention_blocks" ({attention: block
        pairs computed} where a mask of packed documents skips blocks); a skipped step raises unless fp16 skipped it."""
        if self._intercept is not None:
            intercept, self._intercept = self._intercept, None
            if intercept.build:
                self._ensure_built(batch)
            intercept.run(self, batch)
        guards.check_not_empty(batch)
        built = self._ensure_built(batch)
        placed = self._place(batch)
        accumulation.check_divisible(placed, self.options.step.accumulate, self._data_size())
        self._guard(placed)
        self._last_batch = placed
        self.state, out = built.program.train(self.state, placed, self._lrs())
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
        built = self._ensure_built(batch)
        placed = self._place(batch)
        if self.options.step.check_inputs:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                  (self.state.buffers, self.state.key, placed))
            guards.raise_for_inputs(self.step_count, input_checks.for_model(built.model, *shapes).checks, placed,
                                    during="eval")
        loss = built.program.eval(self.state, placed)
        return {"loss": float(loss[0] / loss[1] if isinstance(loss, tuple) else loss)}

    @property
    def compilations(self) -> int:
        """Programs the training step has compiled: 1 after the first call, more only when
        allow_recompile let a new batch shape through (a new lr never adds one)."""
        return self._stage.program.train._cache_size() if isinstance(self._stage, BuiltStep) else 0

    @property
    def step_count(self) -> int:
        if isinstance(self._stage, Deferred):
            return checkpoint.read_manifest(self._pending_load)["step"] if self._pending_load is not None else 0
        return int(self.state.step)

    # -- state -----------------------------------------------------------------------------
    def user_model(self) -> Model:
        """The model under its own per-layer parameter names (what `stacking` unstacks to)."""
        return self.model.inner if isinstance(self.model, stacked.StackedModel) else self.model

    def state_dict(self) -> dict[str, Any]:
        """Full (unsharded) tensors under the model's own names; for torch modules every key
        of `module.state_dict()`, loadable with `load_state_dict(strict=True)`. Before a deferred
        step's first call: the model's initial state."""
        if isinstance(self._stage, Deferred):
            if self._pending_load is not None:
                self._built_for(f"state_dict() of the checkpoint loaded from {self._pending_load}")
            model = self.trainable.model
            return tensors.state_dict(model.export_state(model.initial_params(), model.initial_buffers()))
        layout, shardings = self.layout, self.shardings
        state = state_mod.in_order(self.state, layout, shardings, to_torch=True)  # fused splits: torch's order
        params = {n: _to_host(v) for n, v in {**state.params, **state.frozen}.items()}
        buffers = {n: _to_host(v) for n, v in self.state.buffers.items()}
        out = self.user_model().export_state(layout.stacking.unstack_dict(params), buffers)
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
        built = self._built_for("save()")
        return checkpoint.save(state_mod.in_order(self.state, built.layout, built.shardings, to_torch=True), path,
                               step=self.step_count, extra=extra, blocking=blocking,
                               rows=built.layout.stacking.row_table())

    def load(self, path: str | os.PathLike, *, verify: bool = True) -> dict:
        """Restores a checkpoint written by `save`, under any mesh and plan (tensors are stored
        under logical names and global shapes and are resharded on load: each process reads
        only the regions its devices hold). Returns the `extra` dict saved with it. Before a
        deferred step's first call the checkpoint is verified now and restored onto the built
        step at the first call (the normal restart path under plan="auto").

        Args:
            verify: check every byte read against the checksums written with it (a corrupt
                file is a CheckpointError naming it; the state is then unchanged). False
                skips the checksums (the manifest and shapes are still checked)."""
        if isinstance(self._stage, Deferred):
            manifest = checkpoint.verify_all(path) if verify else checkpoint.read_manifest(path)
            self._pending_load = path
            return manifest["extra"]
        built = self.built
        values, manifest = checkpoint.restore(path, self.state, rows=built.layout.stacking.row_table(),
                                              per_device=(RESIDUAL,), verify=verify,
                                              optional=(precision.SUFFIX,))
        self.state = state_mod.in_order(rebuild(self.state, values), built.layout, built.shardings, to_torch=False)
        return manifest["extra"]

    def export(self, path: str | os.PathLike | None = None):
        """Writes `state_dict()` (full tensors under the torch module's own names) to `path`:
        `.safetensors`, or `.pt`/`.pth`/`.bin` for torch.save. Every process calls it (the
        tensors are gathered); process 0 writes. Loads with `module.load_state_dict` or, written
        as `model.safetensors` next to an HF config, with `from_pretrained`. No path, in a SageMaker
        job: SM_MODEL_DIR/model.safetensors, uploaded when the job ends. Returns the path."""
        return checkpoint.export(self.state_dict(), runtime.sagemaker.export_path() if path is None else path)

    # -- explanation (xtrain.step.explain) ---------------------------------------------------
    def batch_shapes(self, batch: tuple) -> tuple:
        """`batch` (or, when empty, the last batch trained on) as placed on the mesh, as
        jax.ShapeDtypeStruct with shardings; builds a deferred step first."""
        if batch:
            self._ensure_built(batch)
        if isinstance(self._stage, Deferred):
            self._built_for("program(), compiled() or report() without a batch")
        placed = self._place(batch) if batch else self._last_batch
        if placed is None:
            raise NotBuiltError("needs the batch shapes: pass a batch or run step(*batch) once first")
        return _shapes(placed)

    def program(self, *batch: Any, remat="plan"):
        """The program xtrain emits for XLA (a ClosedJaxpr) for `batch`'s shapes or the last batch
        (traced once per batch signature); `remat`: under another activation checkpointing policy
        (LayerRemat or None), for comparison."""
        shapes = self.batch_shapes(batch)
        key = (recompile.signature(shapes), "plan" if remat == "plan" else repr(remat))
        if key not in self._programs:
            built = self.built
            program = built.program if remat == "plan" else assembly.relowered(built, remat=remat)
            self._programs[key] = program.train.trace(self.state, shapes, self._lrs()).jaxpr
        return self._programs[key]

    def compiled(self, *batch: Any, remat="plan"):
        """The XLA-compiled training step (jax `Compiled`) for `batch`'s shapes, or for the
        last batch trained on; `remat`: another activation checkpointing policy (LayerRemat or
        None) for comparison. `.as_text()` gives the optimized HLO."""
        shapes = self.batch_shapes(batch)
        built = self.built
        program = built.program if remat == "plan" else assembly.relowered(built, remat=remat)
        return program.train.lower(self.state, shapes, self._lrs()).compile()

    def lower(self, *batch: Any, platform: str | None = None):
        """The training step (jax `Lowered`) for `platform` ("cuda", "neuron", "cpu"; None: these
        devices) without its devices, for `batch`'s shapes or the last batch: what XLA receives
        there before its own passes (xtrain.lowering.platforms). `.as_text(dialect="hlo")`: HLO."""
        shapes = self.batch_shapes(batch)
        traced = self.built.program.train.trace(self.state, shapes, self._lrs())
        return traced.lower(lowering_platforms=platforms.lowering_platforms(platform))

    def report(self, *batch: Any, compare: bool = False):
        """Collectives and per-device memory of the compiled training step, for `batch`'s
        shapes or the last batch trained on (xtrain.step.explain.report). `compare`: also compile the
        step without its activation checkpointing / offload, for the notes' measured figures."""
        return explain.report(self, *batch, compare=compare)


def _aliases(model: Model) -> dict[str, list[str]]:
    """Tied tensors' other names, per canonical name (a file may store either)."""
    aliases = getattr(model, "param_aliases", {})
    return {name: [a for a, n in aliases.items() if n == name] for name in set(aliases.values())}

