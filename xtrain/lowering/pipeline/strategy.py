"""The pipeline's strategy for the training-step skeleton (xtrain.lowering.train_step): the
explicit lowering's per-device program, cut into stages and run microbatch by microbatch over
the `pipe` mesh axis.

    trace     the model at one microbatch's (global) shapes; cut it into prologue, repeated
              blocks, epilogue (graph.py); assign blocks to stages (partition.py; program.py)
    forward / backward
              the schedule's executor (executors.py) over the stage function (stage.py):
              GPipe by autodiff of the forward ticks, 1F1B / interleaved by per-tick vjp
    loss      sum of per-token losses over all microbatches / their total count of tokens
    counts    what the rules count per layer (an MoE layer's tokens per expert), from the ticks
              that run a real forward, summed over microbatches, devices and stages
    sync      one bucketed all-reduce of gradients over the data axes and `pipe`: a stage's
              gradient is zero for the layers it does not run, and a weight used by two stages
              (tied embedding and head) gets both stages' contributions
    update    as the explicit lowering (ZeRO-1 over the data axes)

Block parameters live on their stage: once the stage partition is known (at the first step:
it is balanced on the traced graph), each block parameter position is stored as one array whose
rows are stage 0's layers, then stage 1's, ... with rows split over `pipe` (program.placement), so a
stage stores, updates and checkpoints only its own layers and their optimizer state; their
gradients are reduced over the data axes only. Embeddings, head and final norm stay whole on
every stage (the first and last stages both use them: tied weights stay in sync by the
all-reduce over `pipe`).

Trainium: the activations travel by `ppermute` around the full ring of stages (its permutes
must be rings of adjacent cores: lay `pipe` over neighbouring cores). The gradient all-reduce
spans `pipe` and the data axes; its replica groups are aligned contiguous blocks of cores only
when those are the mesh's innermost axes, e.g. Mesh(tensor=2, pipe=2, data=2) rather than
Mesh(pipe=2, tensor=2, data=2); check a plan with examples/train_gpt.py --emulate.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.errors import PlanError, UnsupportedError
from xtrain.ir.model import Model
from xtrain.ir.stacked import Stacking
from xtrain.lowering import collectives, zero
from xtrain.lowering.explicit.forward import layout_of
from xtrain.lowering.context import Context
from xtrain.lowering.findings import Findings, collected
from xtrain.lowering.sharded import Sharded
from xtrain.lowering.grad_transforms import GradTransforms
from xtrain.lowering.options import StepOptions
from xtrain.lowering.pipeline import executors, zero_bubble
from xtrain.lowering.pipeline.schedule import ZERO_BUBBLE
from xtrain.lowering.pipeline.program import PipelineProgram
from xtrain.lowering.pipeline.stage import Layers, Stage, layer_counts, stack_layers, stage_rows, take
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import Gradients, PerDevice, StepConfig
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.mesh import CONTEXT
from xtrain.sharding.pipeline import Pipeline
from xtrain.sharding.plan import axes_of
from xtrain.sharding.remat import LayerRemat


class _Runner:
    """Per-device pieces shared by the executors, for one trace."""

    def __init__(self, program: PipelineProgram, closed, cut, args):
        self.program, self.closed, self.cut = program, closed, cut
        self.avals = jax.tree.leaves(args)
        params, buffers, key, batch = args
        self.param_names = sorted(params)
        specs, batch_axes = program.param_specs, set(program.batch_axes)
        self.layouts = [layout_of(specs[n], params[n].ndim) for n in self.param_names]
        self.layouts += [layout_of((), b.ndim) for b in jax.tree.leaves(buffers)] + [layout_of((), key.ndim)]
        self.layouts += [layout_of(program.batch_spec, x.ndim) for x in batch if hasattr(x, "ndim")]
        self.zero = {n: tuple(a for e in specs[n] for a in axes_of(e) if a in batch_axes) for n in self.param_names}
        self.block_names = {n for layer in cut.layer_params for n in layer}

    def env(self, named: dict, rest: list, batch_mb: list) -> dict:
        """Top-level invars of the graph -> Sharded local values for one microbatch."""
        leaves = [named[n] for n in self.param_names] + rest + batch_mb
        zero = [self.zero[n] for n in self.param_names]
        return {var: Sharded(v, l, tuple(a.shape), a.dtype, zero=zero[i] if i < len(zero) else ())
                for i, (var, v, l, a) in enumerate(zip(self.closed.jaxpr.invars, leaves, self.layouts, self.avals))}

    def block_params(self) -> list[Sharded]:
        """Sharded templates (layout of layer 0) of the body's parameter positions."""
        first, specs = self.cut.layer_params[0], self.program.param_specs
        for layer in self.cut.layer_params[1:]:
            for a, b in zip(first, layer):
                if specs[a] != specs[b]:
                    raise PlanError(f"pipeline: parameters {a} and {b} hold the same place in their blocks but the "
                                    f"plan splits them differently ({specs[a]} vs {specs[b]}); give every block the "
                                    "same rule")
        index = {n: i for i, n in enumerate(self.param_names)}
        return [Sharded(None, self.layouts[index[n]], tuple(self.avals[index[n]].shape), self.avals[index[n]].dtype,
                        zero=self.zero[n]) for n in first]


def _check_options(options: StepOptions, grad_tx: GradTransforms, remat: LayerRemat | None) -> None:
    """What the pipeline lowering does not do yet: each refused with the alternative."""
    if options.accumulate != 1:
        raise PlanError(f"accumulate={options.accumulate} with a pipeline: microbatches already accumulate "
                        "gradients; raise with_pipeline(microbatches=...) instead")
    if grad_tx.loss_scale is not None:
        raise UnsupportedError("precision='fp16' (dynamic loss scaling) is not supported with a pipeline yet; "
                               "use precision='bf16' or 'fp32'")
    if remat is not None:
        raise PlanError(f"Plan({remat.setting}) with a pipeline: use "
                        "with_pipeline(..., checkpoint=True), which recomputes each stage from its input")


def _chunk_rows(cut, layers: Layers, storage: Stacking, block: dict, stage, chunks: int) -> list:
    """This stage's chunks of every block parameter position, (v, Lc, ...): a family stored on
    its stage is its local rows as they are; a position stored per layer is gathered."""
    first = {members[0]: name for name, members in storage.groups.items()}
    out = []
    for position in range(len(cut.layer_params[0])):
        name = first.get(cut.layer_params[0][position])
        if name is not None:
            local = block[name]
            out.append(local.reshape((chunks, local.shape[0] // chunks) + local.shape[1:]))
        else:
            out.append(stage_rows(stack_layers(block, [[layer[position]] for layer in cut.layer_params]),
                                  layers, stage)[0])
    return out


def _layer_shapes(params: dict, storage: Stacking) -> dict:
    """Per-layer global shapes of stored parameters (what the model function takes)."""
    out = {}
    for n, x in params.items():
        if n in storage.groups:
            out.update({m: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for m in storage.groups[n]})
        else:
            out[n] = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return out


def check(config: StepConfig, layout: StateLayout) -> None:
    """What the pipeline step refuses (before anything is traced)."""
    _check_options(config.options, config.grad_tx, config.remat)
    if layout.zero > 1:
        raise UnsupportedError(f"pipeline parallelism supports ZeRO stage 0 or 1 (got Plan(zero={layout.zero})): "
                               "its gradients are accumulated over microbatches before the data-parallel reduction")


class PipelineStrategy:
    """Loss and gradients by the pipeline schedule (see the module docstring)."""

    def __init__(self, model: Model, mesh, layout: StateLayout, state_specs: TrainState, config: StepConfig,
                 pipeline: Pipeline):
        check(config, layout)
        if pipeline.schedule in ZERO_BUBBLE and dict(mesh.shape).get(CONTEXT, 1) > 1:
            raise UnsupportedError(
                f"with_pipeline(schedule={pipeline.schedule!r}) on a mesh that splits sequences over {CONTEXT!r} "
                f"({dict(mesh.shape)[CONTEXT]}): zero bubble's split backward does not run the stages' ring or Ulysses "
                "attention yet (its devices would wait on each other's collectives); use schedule='1f1b' or 'gpipe' "
                "with context parallel, or zero bubble without it")
        self.model, self.pipeline, self.storage = model, pipeline, layout.stacking
        self.fallback, self.context, self.capacity_factor = config.fallback, config.context, config.capacity_factor
        self.platform = config.platform
        self.program = PipelineProgram(model, mesh, layout, pipeline)
        self.runner = PerDevice(mesh, state_specs, layout.batch_spec)
        self.update = zero.Update.of_layout(layout, config.tx, config.grad_tx, config.sync)
        # a family stored on its stage already varies over the pipe axis; the rest is replicated
        self.pending = {n: layout.grad_axes(n) + (() if n in self.storage.groups else (pipeline.axis,))
                        for n in layout.param_specs}

    def _global_args(self, state: TrainState, batch: tuple):
        return (_layer_shapes({**state.params, **state.frozen}, self.storage),
                *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state.buffers, state.key, batch)))

    def _layer_view(self, named: dict) -> dict:
        """Per-layer names for the graph's inputs; a family stored on its stage is read only by
        the blocks (through _chunk_rows), so its layers stand as placeholders here."""
        groups = self.storage.groups
        view = {n: w for n, w in named.items() if n not in groups}
        view.update({m: None for n in groups if n in named for m in groups[n]})
        return view

    def _split_batch(self, batch) -> list:
        m = self.pipeline.microbatches
        return [x.reshape((m, x.shape[0] // m) + x.shape[1:]) for x in batch if hasattr(x, "ndim")]

    def _setup(self, training: bool, shapes):
        program = self.program
        closed, cut, args = program.trace(training, shapes)
        ctx = Context.of(program.sizes, module_paths=self.model.module_paths(), batch_axes=program.batch_axes,
                         fallback=self.fallback, context=self.context, capacity_factor=self.capacity_factor,
                         platform=self.platform)
        return _Runner(program, closed, cut, args), Stage(ctx, cut, closed.consts, self.program.table.split_backward)

    def _stage_fn(self, runner: _Runner, stage: Stage, named: dict, rest: list):
        """(run, x0): run(chunk params, other params, x, (batch_mb, i), chunk) for this device,
        and the zero activation the pipeline starts from."""
        axis, table = self.pipeline.axis, self.program.table
        index, templates, layers = lax.axis_index(axis), runner.block_params(), self.program.layers

        def run(chunk_params, other, x, mb, c):
            batch_mb, i = mb
            # microbatch i draws its own dropout stream (the same in its forward and backward ticks)
            keyed = rest[:-1] + [jax.random.fold_in(rest[-1], i)]
            env = runner.env({**named, **other}, keyed, batch_mb)
            params = [dataclasses.replace(t, value=w) for t, w in zip(templates, chunk_params)]
            slots = take(layers.index, index)[c], take(layers.valid, index)[c]
            return stage(env, x, params, slots, table.holds(index, c, 0), table.holds(index, c, table.virtual_stages - 1))

        return run

    def _x0(self, runner: _Runner, stage: Stage, named: dict, rest: list, mbs: list) -> list:
        env = runner.env(named, rest, [x[0] for x in mbs])
        init = jax.eval_shape(lambda: [x.value for x in stage.prologue(dict(env))])
        return [jnp.zeros(s.shape, s.dtype) for s in init]

    def _gpipe_grads(self, run, rows, block, other, x0, mbs):
        """Autodiff of the forward ticks: the backward ticks in reverse, every activation kept
        (or, with checkpoint, every stage input)."""
        pipe = self.pipeline

        def loss_of(block, other):
            chunks = [w[0] for w in rows(block)]
            tick = lambda x, mb, active: run(chunks, other, x, mb, 0)
            total, count, counts = executors.gpipe_forward(jax.checkpoint(tick) if pipe.checkpoint else tick,
                                                           x0, mbs, pipe.stages, pipe.microbatches, pipe.axis)
            total, count = collectives.all_reduce(total, (pipe.axis,)), collectives.all_reduce(count, (pipe.axis,))
            return total / count, counts

        (loss, counts), (g_block, g_other) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(block, other)
        return loss, g_block, g_other, counts

    def _table_grads(self, run, rows, block, other, x0, mbs, note=None):
        """The 1F1B-family and zero-bubble tables: gradients of the loss *sum*, divided by the total count at the
        end (the count is known only after the last forward; the scaling is linear)."""
        pipe = self.pipeline
        chunks, pull = jax.vjp(rows, block)
        args = (run, chunks, other, x0, mbs, self.program.ticks, pipe.stages, pipe.virtual_stages, pipe.axis)
        if self.program.table.split_backward:
            total, count, g_chunks, g_other, counts = zero_bubble.split_grads(*args, note=note)
        else:
            total, count, g_chunks, g_other, counts = executors.table_grads(*args)
        (g_block,) = pull(g_chunks)
        total, count = collectives.all_reduce(total, (pipe.axis,)), collectives.all_reduce(count, (pipe.axis,))
        scale = lambda g: g / count.astype(g.dtype)
        return total / count, jax.tree.map(scale, g_block), jax.tree.map(scale, g_other), counts

    def gradients(self, state: TrainState, batch: tuple):
        shapes = self._global_args(state, batch)

        def compute(state: TrainState, batch: tuple, key, scale) -> Gradients:
            runner, stage = self._setup(True, shapes)
            params = {n: lax.pcast(w, self.pending[n], to="varying") if self.pending[n] else w
                      for n, w in state.params.items()}
            named, rest, mbs = {**params, **state.frozen}, jax.tree.leaves(state.buffers) + [key], self._split_batch(batch)
            view = self._layer_view(named)
            x0 = self._x0(runner, stage, view, rest, mbs)
            run = self._stage_fn(runner, stage, view, rest)
            index = lax.axis_index(self.pipeline.axis)
            in_block = runner.block_names | set(self.storage.groups)
            block = {n: w for n, w in named.items() if n in in_block}
            other = {n: w for n, w in params.items() if n not in in_block}
            rows = lambda block: _chunk_rows(runner.cut, self.program.layers, self.storage, block, index,
                                             self.pipeline.virtual_stages)
            if self.pipeline.schedule == "gpipe":
                loss, g_block, g_other, counts = self._gpipe_grads(run, rows, block, other, x0, mbs)
            else:
                loss, g_block, g_other, counts = self._table_grads(run, rows, block, other, x0, mbs, stage.ctx.note)
            grads = {n: g for n, g in {**g_block, **g_other}.items() if n in state.params}
            blocks = runner.cut.blocks  # each MoE layer's tokens per expert, under its own module path
            counts = layer_counts(counts, self.program.layers, index, blocks.prefix, blocks.length, self.pipeline.axis,
                                  blocks.first)
            return Gradients(loss, {}, grads, self.pending, counts, findings=self._findings(stage))

        return compute

    def loss(self, state: TrainState, batch: tuple):
        shapes, pipe = self._global_args(state, batch), self.pipeline

        def compute(state: TrainState, batch: tuple, key):
            runner, stage = self._setup(False, shapes)
            named, rest, mbs = {**state.params, **state.frozen}, jax.tree.leaves(state.buffers) + [key], \
                self._split_batch(batch)
            view = self._layer_view(named)
            x0 = self._x0(runner, stage, view, rest, mbs)
            run = self._stage_fn(runner, stage, view, rest)
            chunks = _chunk_rows(runner.cut, self.program.layers, self.storage, named, lax.axis_index(pipe.axis),
                                 pipe.virtual_stages)
            if pipe.virtual_stages == 1:
                total, count, _ = executors.gpipe_forward(
                    lambda x, mb, active: run([w[0] for w in chunks], {}, x, mb, 0), x0, mbs, pipe.stages,
                    pipe.microbatches, pipe.axis)
            else:  # the interleaved / zbv table's forwards (its backwards run too, on zero cotangents: eval is rare)
                table = zero_bubble.split_grads if self.program.table.split_backward else executors.table_grads
                total, count, _, _, _ = table(run, chunks, {}, x0, mbs, self.program.ticks, pipe.stages,
                                              pipe.virtual_stages, pipe.axis)
            return collectives.all_reduce(total, (pipe.axis,)) / collectives.all_reduce(count, (pipe.axis,))

        return compute

    def _findings(self, stage: Stage) -> Findings:
        """What the stages' rules recorded (ring attention, fallbacks), the family of blocks the
        stages split, and the layers of each (stage, chunk)."""
        return collected([stage.ctx.record], repeated=(stage.cut.blocks,),
                         stage_layers=tuple(self.program.layers.valid.sum(-1).ravel().tolist()))

    def notes(self, findings: Findings) -> list[str]:
        return self.program.describe() + findings.report_notes()
