"""The compiled training step users call: `step(*batch)`, `step.eval`, `state_dict`, `report`."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from xtrain import data, precision, recompile
from xtrain.lowering import accumulation, nan_check
from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.optim import LearningRates
from xtrain.remat import Remat
from xtrain.step_options import StepOptions
from xtrain.frontend import stacked
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


class TrainStep:
    """A model compiled for a mesh and plan. Call it with one global batch per step."""

    def __init__(self, model: Model, mesh: jax.sharding.Mesh, plan: Plan,
                 tx: optax.GradientTransformation, optimized: set[str], seed: int = 0,
                 lowering: str = "explicit", grad_sync: GradSync | None = None, scan_layers: bool | str = "auto",
                 zero3_regather: bool | None = None, init_from: str | os.PathLike | None = None,
                 options: StepOptions = StepOptions(), learning_rates: LearningRates | None = None):
        model = precision.apply_policy(model, plan.precision)
        self.mesh, self.plan, self.tx = mesh, plan, tx
        self.lowering, self.options, self.learning_rates = lowering, options, learning_rates
        grad_tx = GradTransforms(options.clip_grad_norm, learning_rates.groups if learning_rates else None,
                                 options.detect_nan, plan.precision.loss_scale)
        mesh_axes = dict(mesh.shape)
        shapes = {n: p.shape for n, p in model.param_shapes().items()}
        self.batch_spec = plan.batch_spec(mesh_axes)
        data_axes = tuple(a for e in self.batch_spec for a in _axes_of(e))
        self.param_specs, self.optimizer_specs, self.zero_whole = zero_mod.specs_for_stage(
            shapes, plan.param_specs(shapes, mesh_axes), mesh_axes, data_axes, plan.zero)
        self.model, self.stacking = model, stacked.Stacking({})
        self.scan_layers = stacked.scan_layers_for(scan_layers, shapes, mesh.devices.flat[0].platform,
                                                   jax.local_device_count())
        self._layers_note = (f"repeated blocks ({stacked.depth(shapes)} layers) run "
                             f"{'as one layer scan' if self.scan_layers else 'unrolled, one after another'} "
                             f"(scan_layers={scan_layers!r})")
        if stacked.wanted(self.scan_layers, plan.pipeline, learning_rates is not None):
            stored = stacked.stack_blocks(model, self.param_specs, self.optimizer_specs, optimized,
                                          learning_rates.groups)
            self.model, self.stacking, optimized = stored.model, stored.stacking, stored.optimized
            self.param_specs, self.optimizer_specs = stored.param_specs, stored.optimizer_specs
        model, abstract = self.model, self.model.param_shapes()
        named = lambda specs: {n: NamedSharding(mesh, PartitionSpec(*s)) for n, s in specs.items()}
        if init_from is None:
            params, buffers = model.initial_params(), model.initial_buffers()
        else:  # sharded init: each process reads only its devices' regions of the file
            params, buffers = self._load_initial(init_from, abstract, named(self.param_specs))
        state = self._initial_state(params, buffers, optimized, seed)
        self.shardings = xla_partitioner.state_shardings(state, named(self.param_specs), mesh,
                                                         named(self.optimizer_specs))
        self.state: TrainState = jax.device_put(state, self.shardings)
        self._stages_placed = False
        if plan.pipeline is not None:
            self._train, self._eval, self._program = self._pipeline(grad_sync, lowering, options, grad_tx)
        elif lowering == "explicit":
            self._build = functools.partial(
                explicit_step.build, model, tx, self.shardings, mesh, self.param_specs, self.batch_spec,
                grad_sync or GradSync(comm_dtype=plan.precision.wire_dtype),
                self.scan_layers, zero=plan.zero, optimizer_specs=self.optimizer_specs,
                regather=zero3_regather is not False, grad_tx=grad_tx)
            self._train, self._eval, self._program = self._build(options=options, remat=plan.layer_remat())
        else:
            if plan.remat is not Remat.OFF:
                raise ValueError(f"Plan(remat={plan.remat.value!r}) checkpoints each layer of the explicit "
                                 "lowering's repeated blocks; use lowering='explicit' or remat='off'")
            self._train, self._eval = xla_partitioner.compile_steps(model, tx, self.shardings, mesh, options, grad_tx)
        self._last_batch: tuple | None = None
        self._compiled_for: list[recompile.Signature] = []  # batch signatures compiled so far

    def _load_initial(self, source, abstract: dict, shardings: dict) -> tuple[dict, dict]:
        from xtrain import checkpoint

        aliases: dict[str, list[str]] = {}
        for alias, name in getattr(self.model, "param_aliases", {}).items():
            aliases.setdefault(name, []).append(alias)
        params = checkpoint.load_sharded(source, abstract, shardings, aliases)
        return params, self.model.initial_buffers(source)

    def _pipeline(self, grad_sync: GradSync | None, lowering: str, options: StepOptions, grad_tx: GradTransforms,
                  **placed):
        from xtrain.lowering.pipeline import step as pipeline_step

        if lowering != "explicit":
            raise ValueError(f"pipeline parallelism needs lowering='explicit' (got {lowering!r})")
        self._pipeline_args = (grad_sync, lowering, options, grad_tx)
        return pipeline_step.build(self.model, self.tx, self.shardings, self.mesh, self.param_specs, self.batch_spec,
                                   grad_sync or GradSync(comm_dtype=self.plan.precision.wire_dtype),
                                   self.plan.pipeline, zero=self.plan.zero, optimizer_specs=self.optimizer_specs,
                                   options=options, grad_tx=grad_tx, remat=self.plan.layer_remat(), **placed)

    def _place_stages(self, placed: tuple) -> None:
        """Pipeline plans, before the first step runs: move each block parameter family onto
        the stage that runs it (stored stacked, rows split over the pipe axis), so a stage
        stores only its own layers and their optimizer state. The stage partition is balanced
        on the traced graph, which needs the batch shapes: hence now, not at compile."""
        if self.plan.pipeline is None or self._stages_placed:
            return
        from xtrain.lowering.pipeline import step as pipeline_step

        self._stages_placed = True
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                              ({**self.state.params, **self.state.frozen}, self.state.buffers, self.state.key, placed))
        storage, starts = pipeline_step.plan_storage(
            self.model, self.mesh, self.param_specs, self.optimizer_specs, self.batch_spec, self.plan.pipeline, shapes,
            set(self.state.params), self.learning_rates.groups if self.learning_rates else None)
        if not storage:
            return
        layer_specs = self.param_specs
        self.param_specs = storage.stack_specs(layer_specs)
        self.optimizer_specs = storage.stack_specs(self.optimizer_specs)
        self.state, self.shardings = self._restacked(storage)
        self.stacking = storage
        self._train, self._eval, self._program = self._pipeline(
            *self._pipeline_args, storage=storage, layer_specs=layer_specs, starts=starts)

    def _restacked(self, storage: stacked.Stacking) -> tuple[TrainState, TrainState]:
        """The state with `storage`'s families stacked (its optimizer state alike), placed."""
        from xtrain.checkpoint.layout import named_leaves, rebuild

        named = lambda specs: {n: NamedSharding(self.mesh, PartitionSpec(*s)) for n, s in specs.items()}

        def convert(state: TrainState) -> TrainState:
            stack = lambda d: storage.stack_dict(d, stack=jnp.stack, zeros=jnp.zeros_like)
            params, old = stack(state.params), named_leaves(state.opt_state)

            def leaf(name: str, like):
                param = name.rsplit("/", 1)[-1]  # e.g. "0/mu/blocks.*.attn.q.weight": the parameter's name
                prefix = name[:len(name) - len(param)]
                if param not in storage.groups:
                    return old[name]
                members = storage.groups[param]
                return jnp.stack([old[prefix + members[r]] if r is not None else jnp.zeros(like.shape[1:], like.dtype)
                                  for r in storage.rows_of(param)])

            template = jax.eval_shape(self.tx.init, params)
            opt_state = rebuild(template, {n: leaf(n, like) for n, like in named_leaves(template).items()})
            return dataclasses.replace(state, params=params, frozen=stack(state.frozen), opt_state=opt_state)

        shape = jax.eval_shape(convert, self.state)
        shardings = xla_partitioner.state_shardings(shape, named(self.param_specs), self.mesh,
                                                    named(self.optimizer_specs))
        return jax.jit(convert, out_shardings=shardings)(self.state), shardings

    def _user_model(self) -> Model:
        """The model under its own per-layer parameter names (what `stacking` unstacks to)."""
        return self.model.inner if isinstance(self.model, stacked.StackedModel) else self.model

    def _initial_state(self, params: dict, buffers: dict, optimized: set[str], seed: int) -> TrainState:
        opt_params = {n: v for n, v in params.items() if n in optimized}
        return TrainState(
            params=opt_params,
            frozen={n: v for n, v in params.items() if n not in optimized},
            buffers=buffers,
            opt_state=jax.jit(self.tx.init)(opt_params),
            step=np.int32(0),
            key=jax.random.key_data(jax.random.key(seed)),
            loss_scale=precision.initial_state(self.plan.precision),
        )

    # -- running ---------------------------------------------------------------------------
    def _place(self, batch: tuple) -> tuple:
        return data.shard_batch(batch, self.mesh, self.batch_spec)

    def _data_size(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in _axes_of(self.batch_spec[0])])) if self.batch_spec else 1

    def _lrs(self) -> jax.Array:
        """The current lr of every param group (a torch scheduler may have changed them),
        replicated on the mesh (every process holds the same values)."""
        lrs = self.learning_rates.current() if self.learning_rates else np.zeros((0,), np.float32)
        return jax.make_array_from_callback(lrs.shape, NamedSharding(self.mesh, PartitionSpec()), lambda i: lrs[i])

    def __call__(self, *batch: Any) -> dict[str, float]:
        """Runs one optimizer step on a global batch; returns {"loss": float}, plus "grad_norm"
        (before clipping) when clipping, and "skipped" / "loss_scale" under fp16.

        Under XTRAIN_REPORT_ONLY=1 (`xtrain report script.py`) the first call prints the
        step's report instead and exits the process (status 0) without training."""
        if os.environ.get(REPORT_ONLY, "") not in ("", "0"):
            self._report_and_exit(batch)
        placed = self._place(batch)
        accumulation.check_divisible(placed, self.options.accumulate, self._data_size())
        self._place_stages(placed)
        self._guard(placed)
        self._last_batch = placed
        before = self._nan_evidence(placed)
        self.state, out = self._train(self.state, placed, self._lrs())
        if self.learning_rates:
            self.learning_rates.mark_stepped()
        out = {k: (bool(v) if k == "skipped" else float(v)) for k, v in out.items()}
        if self.options.detect_nan and out.get("skipped"):
            self._raise_nonfinite(out, before)
        return out

    def _guard(self, placed: tuple) -> None:
        now = recompile.signature(placed)
        recompile.check(self._compiled_for, now, self.options.shape_limit)
        if now not in self._compiled_for:
            self._compiled_for.append(now)

    def _nan_evidence(self, placed: tuple):
        """detect_nan: what the forward reads this step (the state is donated to the step)."""
        if not self.options.detect_nan:
            return None
        copy = lambda t: jax.tree.map(lambda x: x.copy(), t)
        key = jax.random.fold_in(self.state.key, self.state.step)
        params = self.stacking.unstack_dict({**self.state.params, **self.state.frozen})  # copies (slices) of rows
        return copy(params), copy(self.state.buffers), key, placed

    def _raise_nonfinite(self, out: dict, evidence) -> None:
        bad = nan_check.first_nonfinite(self._user_model(), *evidence)
        where = ("every forward tensor is finite; the backward pass produced the non-finite gradient"
                 if bad is None else f"first non-finite tensor: output of {bad.primitive} (shape {bad.shape}) in "
                 f"module {bad.module or '<top level>'!r}")
        raise FloatingPointError(
            f"step {self.step_count}: loss {out['loss']}, gradient norm {out.get('grad_norm')}; {where}. The update "
            "was skipped: parameters and optimizer state are those before this step")

    def _report_and_exit(self, batch: tuple) -> None:
        text = str(self.report(*batch))
        if jax.process_index() == 0:
            print(text, flush=True)
        raise SystemExit(0)

    def eval(self, *batch: Any) -> dict[str, float]:
        """The loss in eval mode (dropout off, running statistics); updates nothing."""
        placed = self._place(batch)
        self._place_stages(placed)
        loss = self._eval(self.state, placed)
        return {"loss": float(loss[0] / loss[1] if isinstance(loss, tuple) else loss)}

    @property
    def compilations(self) -> int:
        """Programs the training step has compiled: 1 after the first call, more only when
        allow_recompile let a new batch shape through (a new lr never adds one)."""
        return self._train._cache_size()

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
        out = self._user_model().export_state(self.stacking.unstack_dict(params), buffers)
        return {k: torch.from_numpy(np.array(v)) for k, v in out.items()}

    # -- checkpoints (xtrain.checkpoint) -------------------------------------------------------
    def save(self, path: str | os.PathLike, extra: dict | None = None, *, blocking: bool = True):
        """Saves the whole training state (parameters, frozen parameters, buffers, optimizer
        state, step count, RNG key: every field of the TrainState) to the directory `path`.
        Every process calls it and writes only its own shards. The save is atomic: `path`
        appears only once every process has finished.

        Args:
            extra: JSON-serialisable data stored alongside (e.g. the data position); `load`
                returns it.
            blocking: False copies the state to host now and writes it in a background thread;
                call `.wait()` on the returned handle (or save again) before relying on it.

        Returns:
            An `xtrain.checkpoint.SaveHandle`; `.wait()` returns the committed path.
        """
        from xtrain import checkpoint

        return checkpoint.save(self.state, path, step=self.step_count, extra=extra, blocking=blocking,
                               rows=self.stacking.row_table())

    def load(self, path: str | os.PathLike) -> dict:
        """Restores a checkpoint written by `save`, under any mesh and plan (tensors are stored
        under logical names and global shapes and are resharded on load: each process reads
        only the regions its devices hold). Returns the `extra` dict saved with it."""
        from xtrain import checkpoint
        from xtrain.checkpoint.layout import rebuild

        values, manifest = checkpoint.restore(path, self.state, rows=self.stacking.row_table())
        self.state = rebuild(self.state, values)
        return manifest["extra"]

    def export(self, path: str | os.PathLike):
        """Writes `state_dict()` (full tensors under the torch module's own names) to `path`:
        `.safetensors`, or `.pt`/`.pth`/`.bin` for torch.save. Every process calls it (the
        tensors are gathered); process 0 writes. Loads with `module.load_state_dict` or, written
        as `model.safetensors` next to an HF config, with `from_pretrained`."""
        from xtrain import checkpoint

        return checkpoint.export(self.state_dict(), path)

    # -- explanation -----------------------------------------------------------------------
    def _shapes(self, batch: tuple) -> tuple:
        placed = self._place(batch) if batch else self._last_batch
        if placed is None:
            raise RuntimeError("needs the batch shapes: pass a batch or run step(*batch) once first")
        self._place_stages(placed)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, placed)

    def program(self, *batch: Any):
        """The program xtrain emits for XLA (a ClosedJaxpr) for `batch`'s shapes or the last batch."""
        return jax.make_jaxpr(self._train)(self.state, self._shapes(batch), self._lrs())

    def compiled(self, *batch: Any):
        """The XLA-compiled training step (jax `Compiled`) for `batch`'s shapes, or for the
        last batch trained on. `.as_text()` gives the optimized HLO."""
        return self._train.lower(self.state, self._shapes(batch), self._lrs()).compile()

    def _remat_note(self, batch: tuple, memory: dict[str, int]) -> str:
        """What activation checkpointing saves: this step's temporaries vs the same step
        compiled without it."""
        train = self._build(options=self.options, remat=None)[0]
        without = report_mod.memory_of(train.lower(self.state, self._shapes(batch), self._lrs()).compile())
        saved = without["temporaries"] - memory["temporaries"]
        return (f"activation checkpointing remat={self.plan.remat.value!r}: temporaries {memory['temporaries']} B "
                f"per device vs {without['temporaries']} B without (saves {saved} B)")

    def _stacking_notes(self) -> list[str]:
        if not self.stacking or self.plan.pipeline is not None:
            return []
        groups = self.stacking.groups
        unscanned = sorted(n for n in groups if n not in self._program.scanned)
        lengths = sorted({len(m) for m in groups.values()})
        notes = [f"{len(groups)} block parameter families stored stacked ({'/'.join(map(str, lengths))} layers each); "
                 f"the layer scan reads {len(groups) - len(unscanned)} of them in place"]
        if unscanned:
            notes.append(f"stored stacked but outside any layer scan (each layer sliced out every step): {unscanned[:6]}"
                         f"{' ...' if len(unscanned) > 6 else ''}")
        return notes

    def report(self, *batch: Any) -> report_mod.Report:
        """Collectives and per-device memory of the compiled training step, for `batch`'s
        shapes or the last batch trained on."""
        compiled = self.compiled(*batch)
        sizes = dict(self.mesh.shape)
        replicated = [n for n, s in self.param_specs.items() if not any(s)]
        notes = [f"{len(replicated)} of {len(self.param_specs)} parameters replicated on every device"]
        if self.zero_whole:
            notes.append(f"ZeRO-{self.plan.zero} keeps {len(self.zero_whole)} tensors whole (no dimension divisible "
                         f"by the data size): {self.zero_whole[:8]}{' ...' if len(self.zero_whole) > 8 else ''}")
        if self.plan.remat is not Remat.OFF:
            notes.append(self._remat_note(batch, report_mod.memory_of(compiled)))
        if self.lowering == "explicit":
            found = accounting.collectives(self.program(*batch), sizes, self.model.module_paths())
            notes += [self._layers_note] if self.plan.pipeline is None else []
            notes += self._stacking_notes()
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
