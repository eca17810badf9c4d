"""The pipeline-parallel training step: the explicit lowering's per-device program, cut into
stages and run microbatch by microbatch over the `pipe` mesh axis.

    trace     the model at one microbatch's (global) shapes; cut it into prologue, repeated
              blocks, epilogue (graph.py); assign blocks to stages (partition.py)
    forward / backward
              the schedule's executor (executors.py) over the stage function (stage.py):
              GPipe by autodiff of the forward ticks, 1F1B / interleaved by per-tick vjp
    loss      sum of per-token losses over all microbatches / their total count of tokens
    sync      one bucketed all-reduce of gradients over the data axes and `pipe`: a stage's
              gradient is zero for the layers it does not run, and a weight used by two stages
              (tied embedding and head) gets both stages' contributions
    update    as the explicit lowering (ZeRO-1 over the data axes)

Block parameters live on their stage: once the stage partition is known (at the first step:
it is balanced on the traced graph), each block parameter position is stored as one array whose
rows are stage 0's layers, then stage 1's, ... with rows split over `pipe` (stage_storage), so a
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
import optax
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from xtrain.frontend import stacked
from xtrain.frontend.model import Model
from xtrain.lowering.explicit import gradient_sync, ordering
from xtrain.lowering.explicit import zero as zero_update
from xtrain.lowering.explicit.collectives import Context, Sharded
from xtrain.lowering.explicit.interpreter import module_path
from xtrain.lowering.explicit.step import _layout
from xtrain.lowering.grad_transforms import GradTransforms, finish_step
from xtrain.remat import LayerRemat
from xtrain.step_options import StepOptions
from xtrain.lowering.pipeline import executors, graph, partition, schedule
from xtrain.lowering.pipeline.stage import Layers, Stage, stack_layers, stage_rows, take
from xtrain.lowering.xla_partitioner import TrainState
from xtrain.sharding.annotate import tracing_for
from xtrain.sharding.pipeline import Pipeline
from xtrain.sharding.plan import Spec, _axes_of


def check_mesh(pipeline: Pipeline, mesh_axes: dict) -> None:
    axes = ", ".join(f"{k}={v}" for k, v in mesh_axes.items())
    if pipeline.axis not in mesh_axes:
        raise ValueError(f"Plan.with_pipeline(stages={pipeline.stages}) runs over mesh axis {pipeline.axis!r}, which "
                         f"the mesh ({axes}) does not have; use e.g. xtrain.Mesh({pipeline.axis}={pipeline.stages}, "
                         "data=-1)")
    if mesh_axes[pipeline.axis] != pipeline.stages:
        raise ValueError(f"Plan.with_pipeline(stages={pipeline.stages}) but mesh axis {pipeline.axis!r} has size "
                         f"{mesh_axes[pipeline.axis]} ({axes}); the axis size must equal the number of stages")


def check_batch(batch: tuple, data: int, pipeline: Pipeline) -> None:
    for index, x in enumerate(batch):
        if hasattr(x, "ndim") and x.ndim and x.shape[0] % (data * pipeline.microbatches):
            raise ValueError(
                f"batch argument {index} has {x.shape[0]} rows (shape {tuple(x.shape)}), not divisible by data "
                f"degree {data} x microbatches {pipeline.microbatches} = {data * pipeline.microbatches}; use a "
                f"global batch that is a multiple of {data * pipeline.microbatches}")


class PipelineProgram:
    """Traces, cuts and partitions the model for one batch shape; describes the stages."""

    def __init__(self, model: Model, mesh, param_specs: dict[str, Spec], batch_spec: Spec, pipeline: Pipeline,
                 starts: tuple[int, ...] | None = None):
        self.model, self.mesh, self.pipeline, self.fixed_starts = model, mesh, pipeline, starts
        self.param_specs, self.batch_spec = param_specs, batch_spec
        self.sizes = dict(mesh.shape)
        check_mesh(pipeline, self.sizes)
        self.batch_axes = tuple(a for e in batch_spec for a in _axes_of(e))
        self.data = 1
        for a in self.batch_axes:
            self.data *= self.sizes[a]
        self.table = schedule.build(pipeline.schedule, pipeline.stages, pipeline.microbatches, pipeline.virtual_stages)
        self.ticks = executors.tick_tables(self.table) if pipeline.schedule != "gpipe" else None
        self.ctx: Context | None = None
        self.cut = self.layers = self.costs = None
        self.storage = stacked.Stacking({})  # block parameter families stored on their stages

    def trace(self, training: bool, global_args):
        """The cut graph of the model at one microbatch's global shapes."""
        params, buffers, key, batch = global_args
        check_batch(batch, self.data, self.pipeline)
        m = self.pipeline.microbatches
        mb = tuple(jax.ShapeDtypeStruct((x.shape[0] // m,) + x.shape[1:], x.dtype) if getattr(x, "ndim", 0) else x
                   for x in batch)
        args = (params, buffers, key, mb)

        def apply(params, buffers, key, batch):
            return self.model.apply(params, buffers, key, batch, training=training)

        with tracing_for(self.mesh):
            closed = jax.make_jaxpr(apply)(*args)
        probe = Context(self.sizes, self.model.module_paths())
        names = sorted(params)  # the order of a dict's leaves, so of the graph's parameter invars
        cut = graph.cut(closed, lambda e: module_path(probe, e, ""), names, len(jax.tree.leaves(buffers)),
                        type(self.model).__name__)
        self._partition(closed, cut, probe, len(names))
        return closed, cut, args

    def _partition(self, closed, cut, probe, num_params: int) -> None:
        blocks, chunks = cut.blocks, self.pipeline.chunks
        partition.check_enough_layers(blocks.length, chunks, blocks.prefix)
        jaxpr = closed.jaxpr
        params = set(jaxpr.invars[:num_params])
        costs = dict(partition.layer_costs(jaxpr, lambda e: module_path(probe, e, ""), params))
        paths = [f"{blocks.prefix}.{k}" for k in range(blocks.length)]
        self.prologue_cost = partition.cost_of(jaxpr.eqns[:blocks.start], params)
        self.epilogue_cost = partition.cost_of(jaxpr.eqns[blocks.stop:], params)
        self.costs = [costs[p] for p in paths]
        if self.fixed_starts is not None:  # the stages' stored layers are fixed once placed
            starts = list(self.fixed_starts)
        elif self.pipeline.split == "auto":
            weights = [c.time for c in self.costs]
            weights[0] += self.prologue_cost.time
            weights[-1] += self.epilogue_cost.time
            starts = partition.balance(weights, chunks)
        else:
            starts = partition.explicit_starts(self.pipeline.split, paths)
        self.layers = Layers.from_starts(starts, blocks.length, self.pipeline.stages, self.pipeline.virtual_stages)
        self.cut, self.paths = cut, paths

    def describe(self) -> list[str]:
        """Per (virtual) stage: its modules, FLOPs and bytes; the schedule's bubble."""
        p, table = self.pipeline, self.table
        lines = [f"pipeline: {p.schedule}, {p.stages} stages x {p.microbatches} microbatches"
                 + (f" x {p.virtual_stages} chunks" if p.virtual_stages > 1 else "")
                 + f", {len(table.ticks)} ticks, bubble {table.bubble():.1%} "
                 f"(GPipe/1F1B ideal (p-1)/(m+p-1) = {(p.stages - 1) / (p.microbatches + p.stages - 1):.1%})"]
        for vs in range(p.chunks):
            rng = self.layers.of_stage(vs, len(self.paths))
            cost = sum((self.costs[k] for k in rng), partition.ZERO)
            mods = [f"{self.paths[rng.start]}..{self.paths[rng.stop - 1]}"]
            if vs == 0:
                mods.insert(0, "prologue (embeddings)")
                cost = cost + self.prologue_cost
            if vs == p.chunks - 1:
                mods.append("epilogue (head, loss)")
                cost = cost + self.epilogue_cost
            lines.append(f"  stage {vs % p.stages}" + (f" chunk {vs // p.stages}" if p.virtual_stages > 1 else "")
                         + f": {', '.join(mods)}; {cost.flops / 1e6:.2f} MFLOP per microbatch (all of it, before data/tensor splits), params "
                         f"{cost.param_bytes / 2**20:.2f} MiB, activations {cost.activation_bytes / 2**20:.2f} MiB")
        held = [table.held(s) for s in range(p.stages)]
        lines.append(f"  activations held per stage (microbatch inputs): {held}; lockstep SPMD: "
                     + ("a tick runs a forward or a backward" if p.schedule == "gpipe"
                        else "every tick runs a forward and a backward (vjp) on every stage, masked"))
        if self.storage:
            lines.append(f"  block parameters stored on their stages: {len(self.storage.groups)} families, rows split over "
                         f"'{p.axis}' (each stage stores only its layers; gradients reduced over the data axes); the "
                         f"other parameters on every stage, gradients all-reduced over '{p.axis}' and the data axes")
        else:
            lines.append("  parameters are stored on every stage until the first step places each stage's layers "
                         "on it; gradients all-reduced over 'pipe' and the data axes")
        if not self.cut.weighted:
            lines.append("  the loss is not sum/count in the graph: microbatch losses are averaged (exact only "
                         "when every microbatch counts the same number of tokens)")
        return lines


def stage_storage(cut, layers: Layers, agree, axis: str) -> stacked.Stacking:
    """Each block parameter position stored as one array whose rows are the layers of stage 0,
    then stage 1, ... (each stage's chunks and slots in `layers` order, padding rows where a
    stage holds fewer layers), rows split over the pipe axis: a stage stores only its own
    layers. Positions whose layers disagree under `agree` (spec, optimizer group, trainability)
    or that the graph also reads outside the blocks stay per layer, whole on every stage."""
    outside = {v for part in (cut.prologue, cut.epilogue) for e in part.eqns for v in e.invars
               if isinstance(v, jcore.Var)}
    rows = tuple(int(i) if ok else None for i, ok in zip(layers.index.reshape(-1), layers.valid.reshape(-1)))
    groups = {}
    for position in range(len(cut.layer_params[0])):
        members = tuple(layer[position] for layer in cut.layer_params)
        fams = [stacked.family(m) for m in members]
        if any(f is None or f != (fams[0][0], k) for k, f in enumerate(fams)):
            continue
        if any(layer[position] in outside for layer in cut.blocks.per_layer) or len({agree(m) for m in members}) > 1:
            continue
        groups[fams[0][0]] = members
    return stacked.Stacking(groups, {n: rows for n in groups}, axis)


def plan_storage(model: Model, mesh, layer_specs: dict[str, Spec], optimizer_specs: dict[str, Spec],
                 batch_spec: Spec, pipeline: Pipeline, global_args, optimized: set[str],
                 groups: dict[str, int] | None) -> tuple[stacked.Stacking, tuple[int, ...]]:
    """(stage storage, stage partition) for the model's parameters at these argument shapes
    (per-layer params, buffers, key, batch): the partition is balanced on the traced graph."""
    program = PipelineProgram(model, mesh, layer_specs, batch_spec, pipeline)
    _, cut, _ = program.trace(True, global_args)
    agree = lambda n: (tuple(layer_specs[n]), tuple(optimizer_specs[n]), n in optimized, (groups or {}).get(n))
    return stage_storage(cut, program.layers, agree, pipeline.axis), program.layers.starts


def _batch_specs(batch_spec, batch):
    return tuple(PartitionSpec(*batch_spec[: x.ndim]) if hasattr(x, "ndim") else None for x in batch)


class _Runner:
    """Per-device pieces shared by the executors, for one trace."""

    def __init__(self, program: PipelineProgram, closed, cut, args):
        self.program, self.closed, self.cut = program, closed, cut
        self.avals = jax.tree.leaves(args)
        params, buffers, key, batch = args
        self.param_names = sorted(params)
        self.layouts = [_layout(program.param_specs[n], params[n].ndim) for n in self.param_names]
        self.layouts += [_layout((), b.ndim) for b in jax.tree.leaves(buffers)] + [_layout((), key.ndim)]
        self.layouts += [_layout(program.batch_spec, x.ndim) for x in batch if hasattr(x, "ndim")]
        self.num_params = len(self.param_names)
        self.block_names = {n for layer in cut.layer_params for n in layer}

    def env(self, named: dict, rest: list, batch_mb: list) -> dict:
        """Top-level invars of the graph -> Sharded local values for one microbatch."""
        leaves = [named[n] for n in self.param_names] + rest + batch_mb
        return {var: Sharded(v, l, tuple(a.shape), a.dtype, param=i < self.num_params)
                for i, (var, v, l, a) in enumerate(zip(self.closed.jaxpr.invars, leaves, self.layouts, self.avals))}

    def block_params(self, stage: Stage) -> list[Sharded]:
        """Sharded templates (layout of layer 0) of the body's parameter positions."""
        first = self.cut.layer_params[0]
        for layer in self.cut.layer_params[1:]:
            for a, b in zip(first, layer):
                if self.program.param_specs[a] != self.program.param_specs[b]:
                    raise ValueError(f"pipeline: parameters {a} and {b} hold the same place in their blocks but the "
                                     f"plan splits them differently ({self.program.param_specs[a]} vs "
                                     f"{self.program.param_specs[b]}); give every block the same rule")
        index = {n: i for i, n in enumerate(self.param_names)}
        return [Sharded(None, self.layouts[index[n]], tuple(self.avals[index[n]].shape), self.avals[index[n]].dtype,
                        param=True) for n in first]


def _check_options(options: StepOptions, grad_tx: GradTransforms, remat: LayerRemat | None) -> None:
    """What the pipeline lowering does not do yet: each refused with the alternative."""
    if options.accumulate != 1:
        raise ValueError(f"accumulate={options.accumulate} with a pipeline: microbatches already accumulate "
                         "gradients; raise with_pipeline(microbatches=...) instead")
    if grad_tx.loss_scale is not None:
        raise ValueError("precision='fp16' (dynamic loss scaling) is not supported with a pipeline yet; "
                         "use precision='bf16' or 'fp32'")
    if remat is not None:
        raise ValueError(f"Plan(remat={remat.mode.value!r}) with a pipeline: use "
                         "with_pipeline(..., checkpoint=True), which recomputes each stage from its input")


def _chunk_rows(cut, layers: Layers, storage: stacked.Stacking, block: dict, stage, chunks: int) -> list:
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


def _layer_shapes(params: dict, storage: stacked.Stacking) -> dict:
    """Per-layer global shapes of stored parameters (what the model function takes)."""
    out = {}
    for n, x in params.items():
        if n in storage.groups:
            out.update({m: jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for m in storage.groups[n]})
        else:
            out[n] = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return out


def build(model: Model, tx: optax.GradientTransformation, shardings: TrainState, mesh,
          param_specs: dict[str, Spec], batch_spec: Spec, sync: gradient_sync.GradSync, pipeline: Pipeline,
          zero: int = 0, optimizer_specs: dict[str, Spec] | None = None, options: StepOptions = StepOptions(),
          grad_tx: GradTransforms = GradTransforms(), remat: LayerRemat | None = None,
          storage: stacked.Stacking | None = None, layer_specs: dict[str, Spec] | None = None,
          starts: tuple[int, ...] | None = None):
    """jit-compiled (train_step, eval_step, program) of the pipeline lowering.

    `storage`: block parameter families stored on their stages (stage_storage); `param_specs`
    then name them stacked, `layer_specs` gives every layer's own spec and `starts` the stage
    partition the storage follows.

    train_step(state, batch, lrs) -> (state, {"loss", and "grad_norm" when computed})."""
    storage = storage or stacked.Stacking({})
    _check_options(options, grad_tx, remat)
    if zero > 1:
        raise ValueError(f"pipeline parallelism supports ZeRO stage 0 or 1 (got Plan(zero={zero})): its gradients "
                         "are accumulated over microbatches before the data-parallel reduction")
    gradient_sync.check_axes(sync, dict(mesh.shape))
    program = PipelineProgram(model, mesh, layer_specs or param_specs, batch_spec, pipeline, starts)
    program.storage = storage
    axis, p, m, v = pipeline.axis, pipeline.stages, pipeline.microbatches, pipeline.virtual_stages
    specs = jax.tree.map(lambda s: s.spec, shardings)
    grad_axes = {n: tuple(a for a in program.batch_axes if a not in {x for e in param_specs[n] for x in _axes_of(e)})
                 for n in param_specs}
    update = zero_update.Update(dict(mesh.shape), program.batch_axes, param_specs, optimizer_specs or param_specs,
                                zero, tx, grad_tx, bucket_bytes=sync.bucket_bytes)

    def global_args(state, batch):
        return (_layer_shapes({**state.params, **state.frozen}, storage),
                *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (state.buffers, state.key, batch)))

    def layer_view(named: dict) -> dict:
        """Per-layer names for the graph's inputs; a family stored on its stage is read only by
        the blocks (through _chunk_rows), so its layers stand as placeholders here."""
        view = {n: w for n, w in named.items() if n not in storage.groups}
        view.update({m: None for n in storage.groups if n in named for m in storage.groups[n]})
        return view

    def pipe_varying(n: str) -> tuple:
        # a family stored on its stage already varies over the pipe axis; the rest is replicated
        return grad_axes[n] + (() if n in storage.groups else (axis,))

    def split_batch(batch):
        return [x.reshape((m, x.shape[0] // m) + x.shape[1:]) for x in batch if hasattr(x, "ndim")]

    def setup(training, shapes):
        closed, cut, args = program.trace(training, shapes)
        program.ctx = Context(program.sizes, model.module_paths(), batch_axes=program.batch_axes)
        return _Runner(program, closed, cut, args), Stage(program.ctx, cut, closed.consts)

    def carry_shapes(runner, stage, named, rest, batch):
        env = runner.env(named, rest, [x[0] for x in batch])
        init = jax.eval_shape(lambda: [x.value for x in stage.prologue(dict(env))])
        return [jnp.zeros(s.shape, s.dtype) for s in init]

    def stage_fn(runner, stage, templates, named, rest):
        """run(chunk params, other params, x, (batch_mb, i), chunk) for this device."""
        index = lax.axis_index(axis)

        def run(chunk_params, other, x, mb, c):
            batch_mb, i = mb
            # microbatch i draws its own dropout stream (the same in its forward and backward ticks)
            keyed = rest[:-1] + [jax.random.fold_in(rest[-1], i)]
            env = runner.env({**named, **other}, keyed, batch_mb)
            params = [dataclasses.replace(t, value=w) for t, w in zip(templates, chunk_params)]
            valid = take(program.layers.valid, index)[c]
            return stage(env, x, params, valid, (index == 0) & (c == 0), (index == p - 1) & (c == v - 1))

        return run

    def gpipe_grads(run, rows, block, other, x0, mbs):
        """Autodiff of the forward ticks: the backward ticks in reverse, every activation kept
        (or, with checkpoint, every stage input)."""
        def loss_of(block, other):
            chunks = [w[0] for w in rows(block)]
            tick = lambda x, mb, active: run(chunks, other, x, mb, 0)
            total, count = executors.gpipe_forward(jax.checkpoint(tick) if pipeline.checkpoint else tick,
                                                   x0, mbs, p, m, axis)
            total, count = lax.psum(total, axis), lax.psum(count, axis)
            return total / count, (total, count)

        (loss, _), (g_block, g_other) = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)(block, other)
        return loss, g_block, g_other

    def table_grads(run, rows, block, other, x0, mbs):
        """The 1F1B-family table: gradients of the loss *sum*, divided by the total count at the
        end (the count is known only after the last forward; the scaling is linear)."""
        chunks, pull = jax.vjp(rows, block)
        total, count, g_chunks, g_other = executors.table_grads(run, chunks, other, x0, mbs, program.ticks, p, v, axis)
        (g_block,) = pull(g_chunks)
        total, count = lax.psum(total, axis), lax.psum(count, axis)
        scale = lambda g: g / count.astype(g.dtype)
        return total / count, jax.tree.map(scale, g_block), jax.tree.map(scale, g_other)

    def loss_and_grads(state, batch, key, shapes):
        runner, stage = setup(True, shapes)
        params = {n: lax.pcast(w, pipe_varying(n), to="varying") if pipe_varying(n) else w
                  for n, w in state.params.items()}
        named = {**params, **state.frozen}
        rest = jax.tree.leaves(state.buffers) + [key]
        mbs = split_batch(batch)
        view = layer_view(named)
        x0 = carry_shapes(runner, stage, view, rest, mbs)
        templates = runner.block_params(stage)
        run = stage_fn(runner, stage, templates, view, rest)
        index = lax.axis_index(axis)
        in_block = runner.block_names | set(storage.groups)
        block = {n: w for n, w in named.items() if n in in_block}
        other = {n: w for n, w in params.items() if n not in in_block}

        def rows(block):
            return _chunk_rows(runner.cut, program.layers, storage, block, index, v)

        grads_of = gpipe_grads if pipeline.schedule == "gpipe" else table_grads
        loss, g_block, g_other = grads_of(run, rows, block, other, x0, mbs)
        grads = {n: g for n, g in {**g_block, **g_other}.items() if n in state.params}
        return loss, grads

    def train_step(state: TrainState, batch: tuple, lrs):
        shapes = global_args(state, batch)

        def per_device(state, batch, lrs):
            key = jax.random.fold_in(state.key, state.step)
            loss, grads = loss_and_grads(state, batch, key, shapes)
            grads = gradient_sync.sync(grads, {n: pipe_varying(n) for n in grad_axes}, sync)
            new_params, opt_state, norm = update(grads, state.opt_state, state.params, lrs)
            return finish_step(state, dataclasses.replace(state, params=new_params, opt_state=opt_state), loss,
                               norm, grad_tx)

        mapped = jax.shard_map(ordering.in_order(per_device), mesh=mesh,
                               in_specs=(specs, _batch_specs(batch_spec, batch), PartitionSpec()),
                               out_specs=(specs, PartitionSpec()), check_vma=True)
        return mapped(state, batch, lrs)

    def eval_step(state: TrainState, batch: tuple):
        shapes = global_args(state, batch)

        def per_device(state, batch):
            key = jax.random.fold_in(state.key, state.step)
            runner, stage = setup(False, shapes)
            named = {**state.params, **state.frozen}
            rest = jax.tree.leaves(state.buffers) + [key]
            mbs = split_batch(batch)
            view = layer_view(named)
            x0 = carry_shapes(runner, stage, view, rest, mbs)
            run = stage_fn(runner, stage, runner.block_params(stage), view, rest)
            chunks = _chunk_rows(runner.cut, program.layers, storage, named, lax.axis_index(axis), v)
            if v == 1:
                total, count = executors.gpipe_forward(lambda x, mb, active: run([w[0] for w in chunks], {}, x, mb, 0),
                                                       x0, mbs, p, m, axis)
            else:  # the interleaved table's forwards (its backwards run too, on zero cotangents: eval is rare)
                total, count, _, _ = executors.table_grads(run, chunks, {}, x0, mbs, program.ticks, p, v, axis)
            return lax.psum(total, axis) / lax.psum(count, axis)

        mapped = jax.shard_map(ordering.in_order(per_device), mesh=mesh, in_specs=(specs, _batch_specs(batch_spec, batch)),
                               out_specs=PartitionSpec(), check_vma=True)
        return mapped(state, batch)

    train = jax.jit(train_step, out_shardings=(shardings, jax.sharding.NamedSharding(mesh, PartitionSpec())),
                    donate_argnums=0)
    return train, jax.jit(eval_step), program
