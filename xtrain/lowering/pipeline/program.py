"""A pipeline's program: the model traced at one microbatch's shapes, cut into prologue, repeated
blocks and epilogue (graph.py), its layers assigned to stages (partition.py), and where each
stage's layers are stored (`placement`, which the layout resolution turns into storage:
xtrain.sharding.layout.place_stages).
"""
from __future__ import annotations

import math

import jax
from jax.extend import core as jcore

from xtrain.errors import InputError, PlanError
from xtrain.ir.model import Model
from xtrain.lowering.explicit.gaps import gather_blocks
from xtrain.lowering.pipeline import executors, graph, partition, schedule
from xtrain.lowering.pipeline.stage import Layers
from xtrain.sharding.annotate import tracing_for
from xtrain.sharding.layout import StagePlacement, StateLayout
from xtrain.sharding.pipeline import Pipeline
from xtrain.sharding.plan import axes_of


def check_mesh(pipeline: Pipeline, mesh_axes: dict) -> None:
    axes = ", ".join(f"{k}={v}" for k, v in mesh_axes.items())
    if pipeline.axis not in mesh_axes:
        raise PlanError(f"Plan.with_pipeline(stages={pipeline.stages}) runs over mesh axis {pipeline.axis!r}, which "
                        f"the mesh ({axes}) does not have; use e.g. xtrain.Mesh({pipeline.axis}={pipeline.stages}, "
                        "data=-1)")
    if mesh_axes[pipeline.axis] != pipeline.stages:
        raise PlanError(f"Plan.with_pipeline(stages={pipeline.stages}) but mesh axis {pipeline.axis!r} has size "
                        f"{mesh_axes[pipeline.axis]} ({axes}); the axis size must equal the number of stages")


def check_batch(batch: tuple, layout: StateLayout, sizes: dict, pipeline: Pipeline) -> None:
    """Each batch argument's rows split over the axes of its spec's first dimension (not
    `context`, which splits the sequence), then into the microbatches."""
    for index, x in enumerate(batch):
        spec = layout.arg_spec(index)
        data = math.prod(sizes[a] for a in axes_of(spec[0])) if spec else 1
        if hasattr(x, "ndim") and x.ndim and x.shape[0] % (data * pipeline.microbatches):
            raise InputError(
                f"batch argument {index} has {x.shape[0]} rows (shape {tuple(x.shape)}), not divisible by data "
                f"degree {data} x microbatches {pipeline.microbatches} = {data * pipeline.microbatches}; use a "
                f"global batch that is a multiple of {data * pipeline.microbatches}")


class PipelineProgram:
    """Traces, cuts and partitions the model for one batch shape; describes the stages."""

    def __init__(self, model: Model, mesh, layout: StateLayout, pipeline: Pipeline):
        self.model, self.mesh, self.pipeline, self.layout = model, mesh, pipeline, layout
        self.fixed_starts = layout.stage_starts  # the stages' stored layers are fixed once placed
        self.param_specs, self.batch_spec = layout.layer_specs, layout.batch_spec
        self.sizes = dict(mesh.shape)
        check_mesh(pipeline, self.sizes)
        self.batch_axes = layout.batch_axes
        self.table = schedule.build(pipeline.schedule, pipeline.stages, pipeline.microbatches, pipeline.virtual_stages)
        self.ticks = executors.tick_tables(self.table) if pipeline.schedule != "gpipe" else None
        self.cut = self.layers = self.costs = None
        self.storage = layout.stacking  # block parameter families stored on their stages

    def trace(self, training: bool, global_args):
        """The cut graph of the model at one microbatch's global shapes."""
        params, buffers, key, batch = global_args
        check_batch(batch, self.layout, self.sizes, self.pipeline)
        m = self.pipeline.microbatches
        mb = tuple(jax.ShapeDtypeStruct((x.shape[0] // m,) + x.shape[1:], x.dtype) if getattr(x, "ndim", 0) else x
                   for x in batch)
        args = (params, buffers, key, mb)

        def apply(params, buffers, key, batch):
            return self.model.apply(params, buffers, key, batch, training=training)

        with tracing_for(self.mesh):
            closed = jax.make_jaxpr(apply)(*args)
        closed = gather_blocks(closed, self.model.module_paths())  # per-layer side terms after the blocks
        names = sorted(params)  # the order of a dict's leaves, so of the graph's parameter invars
        cut = graph.cut(closed, self.model.module_paths(), names, len(jax.tree.leaves(buffers)),
                        self.model.name)
        self._partition(closed, cut, len(names))
        return closed, cut, args

    def _partition(self, closed, cut, num_params: int) -> None:
        blocks, chunks = cut.blocks, self.pipeline.chunks
        partition.check_enough_layers(blocks.length, chunks, blocks.prefix)
        jaxpr = closed.jaxpr
        params = set(jaxpr.invars[:num_params])
        costs = dict(partition.layer_costs(jaxpr, self.model.module_paths(), params))
        paths = [blocks.path(k) for k in range(blocks.length)]
        self.prologue_cost = partition.cost_of(jaxpr.eqns[:blocks.start], params)
        self.epilogue_cost = partition.cost_of(jaxpr.eqns[blocks.stop:], params)
        self.costs = [costs[p] for p in paths]
        if self.fixed_starts is not None:
            starts = list(self.fixed_starts)
        elif self.pipeline.split == "auto":
            weights = [c.time for c in self.costs]
            weights[0] += self.prologue_cost.time
            weights[-1] += self.epilogue_cost.time
            starts = partition.balance(weights, chunks)
        else:
            starts = partition.explicit_starts(self.pipeline.split, paths)
        self.layers = Layers.from_starts(starts, blocks.length, self.pipeline.stages, self.pipeline.virtual_stages,
                                         self.table.place)
        self.cut, self.paths = cut, paths

    def describe(self) -> list[str]:
        """Per (virtual) stage: its modules, FLOPs and bytes; the schedule's bubble."""
        p, table = self.pipeline, self.table
        lines = [f"pipeline: {p.schedule}, {p.stages} stages x {p.microbatches} microbatches"
                 + (f" x {p.virtual_stages} chunks" if p.virtual_stages > 1 else "")
                 + f", {len(table.ticks)} ticks, bubble {table.bubble():.1%} "
                 f"(lockstep, F = B = W = 1; GPipe/1F1B ideal (p-1)/(m+p-1) = "
                 f"{(p.stages - 1) / (p.microbatches + p.stages - 1):.1%})"]
        if self.cut.blocks.variants:
            lines.append(f"  {self.cut.blocks.prefix}: one family; {self.cut.blocks.variants.describe()}")
        if self.cut.blocks.collected:
            body, n = self.cut.blocks.body, self.cut.blocks.num_carry
            size = sum(v.aval.size * v.aval.dtype.itemsize for v in body.outvars[n:]) * len(self.paths)
            lines.append(f"  {len(self.cut.blocks.collected)} value(s) each layer computes are read by the loss "
                         f"(e.g. {self.cut.blocks.collected[0].what}): every layer's travel with the activation to "
                         f"the last stage, whole, {size / 2**10:.1f} KiB per microbatch")
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
            stage, chunk = table.place(vs)
            lines.append(f"  stage {stage}" + (f" chunk {chunk}" if p.virtual_stages > 1 else "")
                         + f": {', '.join(mods)}; {cost.flops / 1e6:.2f} MFLOP per microbatch (all of it, before data/tensor splits), params "
                         f"{cost.param_bytes / 2**20:.2f} MiB, activations {cost.activation_bytes / 2**20:.2f} MiB")
        held = [table.held(s) for s in range(p.stages)]
        if table.split_backward:
            lines.append(f"  {'(microbatch, chunk) pairs' if p.virtual_stages > 1 else 'microbatches'} held per stage "
                         f"(the forward's residuals, from F to W): {held}; lockstep "
                         "SPMD: a tick runs one F, B or W per stage (lax.switch), no masked or recomputed work")
        else:
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


def placement(model: Model, mesh, layout: StateLayout, pipeline: Pipeline, global_args) -> StagePlacement:
    """Where each stage's layers are stored, for the model traced at these argument shapes
    (per-layer params, buffers, key, batch): the stage partition is balanced on the graph."""
    program = PipelineProgram(model, mesh, layout, pipeline)
    _, cut, _ = program.trace(True, global_args)
    blocks, layers = cut.blocks, program.layers
    outside = {v for part in (cut.prologue, cut.epilogue) for e in part.eqns for v in e.invars
               if isinstance(v, jcore.Var)}
    read_outside = {name for per_layer, names_ in zip(blocks.per_layer, cut.layer_params)
                    for var, name in zip(per_layer, names_) if var in outside}
    rows = tuple(int(i) if ok else None for i, ok in zip(layers.index.reshape(-1), layers.valid.reshape(-1)))
    return StagePlacement(layer_params=tuple(tuple(p) for p in cut.layer_params), read_outside=frozenset(read_outside),
                          rows=rows, starts=tuple(layers.starts), axis=pipeline.axis)
