"""The explicit lowering's strategy: the model's global jaxpr interpreted per device (rules insert
the collectives), its repeated blocks as the layer scan, and JAX autodiff of that per-device
forward. Parameters are cast to varying over the batch axes first, so autodiff does not sum
their gradients itself: the skeleton's gradient sync does (xtrain.lowering.train_step).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from jax import lax

from xtrain.errors import PlanError
from xtrain.ir.model import Model
from xtrain.lowering import accumulation, collectives, gradient_sync, precision
from xtrain.lowering import zero as zero_mod
from xtrain.lowering import zero3_int8
from xtrain.lowering.explicit import layer_scan
from xtrain.lowering.explicit import rules  # noqa: F401  (registers the partition rules)
from xtrain.lowering import sharded as C
from xtrain.lowering.explicit.blocks import examine
from xtrain.lowering.explicit.gaps import gather_blocks
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.sharded import Layout
from xtrain.lowering.context import Context, LoweringOptions
from xtrain.lowering.findings import Findings, collected
from xtrain.lowering.sharded import Sharded
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import Gradients, PerDevice, StepConfig
from xtrain.sharding.annotate import tracing_for
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.plan import Spec, axes_of
from xtrain.sharding.segments import segmented_dims


FEEDBACK = "\x00int8 residual of "  # the differentiated inputs of ZeRO-3's int8 residuals (zero3_int8)


def layout_of(spec: Spec, ndim: int) -> Layout:
    """The Layout of a value split by `spec` (entries past `ndim` ignored, missing ones whole)."""
    dims = tuple(axes_of(e) for e in spec[:ndim])
    segments = tuple((d, e.sizes) for d, e in segmented_dims(spec[:ndim]))
    return Layout(dims + ((),) * (ndim - len(dims)), segments=segments)


def global_args(state: TrainState, batch: tuple, histories=frozenset()):
    """Global shapes of the model function's arguments: (params, buffers, key, batch). Delayed
    FP8 scaling's amax histories are passed with the parameters (a layer's own inputs, which the
    layer scan stacks; differentiated, their cotangents are the step's amaxes)."""
    moved, buffers = precision.split_histories(state.buffers, histories)
    params = {**state.params, **state.frozen, **moved}
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, buffers, state.key, batch))


@dataclasses.dataclass(frozen=True)
class Forward:
    """The per-device forward of one batch shape, and what tracing the model found.

    `run(params, buffers, key, batch, shards=None) -> ((loss, buffers), counts)` on local
    values; each call interprets the program once and keeps what its rules recorded in
    `records` (`findings()` collects them once the backward pass is traced too)."""

    run: Callable
    repeated: tuple           # the families of repeated blocks (blocks.RepeatedBlocks) the layer scan runs
    block_notes: tuple[str, ...]  # families with per-layer variants or outputs; blocks that are not one
    scanned: frozenset[str]   # stacked parameters the layer scan reads in place
    synced: frozenset[str]    # parameters whose gradients the layer scans all-reduce in their backward pass
    scattered: frozenset[str]  # ZeRO-2 parameters they reduce-scatter (their gradients: this device's block)
    records: list = dataclasses.field(default_factory=list)

    def findings(self) -> Findings:
        return collected(self.records, repeated=self.repeated, block_notes=self.block_notes, scanned=self.scanned)


class Program:
    """Builds the per-device forward for one batch shape."""

    def __init__(self, model: Model, mesh, layout: StateLayout, config: StepConfig):
        self.model, self.mesh, self.layout, self.remat = model, mesh, layout, config.remat
        self.capacity_factor, self.context = config.capacity_factor, config.context
        self.fallback, self.platform = config.fallback, config.platform
        self.sync = config.sync
        self.in_layer: dict[str, tuple[str, ...]] = {}  # name -> axes: may be all-reduced inside the layer scan
        # ZeRO-2: name -> (ZeRO dim, data axes): may be reduce-scattered inside the layer scan
        self.scatter_in_layer: dict[str, tuple[int, tuple[str, ...]]] = {}
        zero3 = any(layout.zero_axes(n) for n in layout.param_specs)
        self.regather = zero_mod.RegatherPolicy(layout.batch_axes) if zero3 and config.regather else None

    def _inputs(self, values, global_args, feedback=None) -> list[Sharded]:
        """Sharded values of the model function's arguments (params, buffers, key, batch);
        `feedback`: name -> this device's int8 residual of a ZeRO-3 parameter (zero3_int8)."""
        params, buffers, key, batch = global_args
        names = sorted(params)  # the order of a dict's leaves (delayed FP8 scaling's histories: whole)
        layouts = ([layout_of(self.layout.param_specs.get(n, ()), params[n].ndim) for n in names]
                   + [Layout.replicated(b.ndim) for b in jax.tree.leaves(buffers)] + [Layout.replicated(key.ndim)]
                   + [layout_of(self.layout.arg_spec(i), x.ndim) for i, x in enumerate(batch) if hasattr(x, "ndim")])
        zero = [self.layout.zero_axes(n) if n in self.layout.param_specs else () for n in names]
        avals = jax.tree.leaves(global_args)
        feedback = feedback or {}
        return [Sharded(v, l, tuple(a.shape), a.dtype, zero=zero[i] if i < len(names) else (),
                        feedback=feedback.get(names[i]) if i < len(names) else None)
                for i, (v, l, a) in enumerate(zip(values, layouts, avals))]

    def _options(self, training: bool, synced: dict) -> LoweringOptions:
        return LoweringOptions(sizes=dict(self.mesh.shape), module_paths=self.model.module_paths(),
                               batch_axes=self.layout.batch_axes, remat=self.remat if training else None,
                               regather=self.regather if training else None, unroll=not self.layout.scan_layers,
                               capacity_factor=self.capacity_factor, context=self.context, fallback=self.fallback,
                               platform=self.platform, synced=synced, sync=self.sync)

    def forward(self, training: bool, global_args) -> Forward:
        """Traces the model's global jaxpr for these argument shapes (outside shard_map) and
        returns the per-device forward (Forward.run: local params, buffers, key, batch ->
        ((loss, buffers), counts: {name: {module path: count}}, e.g. "expert_tokens": (experts,)
        tokens routed to each expert of each MoE layer))."""

        def apply(params, buffers, key, batch):
            return self.model.apply(params, buffers, key, batch, training=training)

        with tracing_for(self.mesh):  # xtrain.shard calls in the model become sharding_constraint
            closed, out_shape = jax.make_jaxpr(apply, return_shape=True)(*global_args)
        closed = gather_blocks(closed, self.model.module_paths())  # per-layer side terms after the blocks
        repeated, block_notes = self._repeated_blocks(closed.jaxpr, len(jax.tree.leaves(global_args[0])))
        by_var = dict(zip(closed.jaxpr.invars, sorted(global_args[0])))  # a dict's leaves: sorted keys
        synced, scattered = self._synced(repeated, by_var, closed.jaxpr) if training else ({}, {})
        in_blocks = {v for blocks in repeated for v in [*blocks.stacked, *(v for layer in blocks.per_layer for v in layer)]}
        options, records = self._options(training, synced), []

        def local(params, buffers, key, batch, shards=None, feedback=None):
            """`shards`: name -> this device's block of each `scattered` parameter (differentiated
            in its place; `params` holds the whole); `feedback`: name -> int8 residual of each
            ZeRO-3 parameter (differentiated: its cotangent is the next one, zero3_int8)."""
            ins = self._inputs(jax.tree.leaves((params, buffers, key, batch)), global_args, feedback)
            blocks = {v: (shards[by_var[v]], dim, axes) for v, (dim, axes) in scattered.items()} if shards else {}
            ctx = Context(dataclasses.replace(options, scattered=blocks))
            records.append(ctx.record)
            if feedback:  # the parameters outside the repeated blocks: gathered here, once
                positions = [i for i, v in enumerate(closed.jaxpr.invars[:len(by_var)]) if v not in in_blocks]
                chunk = self.sync.int8_chunk
                for i, x in zip(positions, zero3_int8.gather(ctx, [ins[i] for i in positions],
                                                             [None] * len(positions), chunk)):
                    ins[i] = x
            regions, live = layer_scan.regions(ctx, closed.jaxpr, repeated)
            outs = interpret(ctx, closed.jaxpr, closed.consts, ins, regions=regions, live=live)
            outs = [C.replicate(ctx, o).value for o in outs]
            losses = len(jax.tree.leaves(out_shape[0]))
            outs = outs[:losses] + [_invariant(ctx, o) for o in outs[losses:]]
            return jax.tree.unflatten(jax.tree.structure(out_shape), outs), _counts(ctx, outs[:losses])

        return Forward(local, tuple(repeated), tuple(block_notes),
                       frozenset(by_var[v] for blocks in repeated for v in blocks.stacked if v is not None),
                       frozenset(by_var[v] for v in synced), frozenset(by_var[v] for v in scattered), records)

    def _synced(self, repeated: list, by_var: dict, jaxpr) -> tuple[dict, dict]:
        """(jaxpr var -> axes of the `in_layer` parameters, jaxpr var -> (ZeRO dim, axes) of the
        `scatter_in_layer` ones whose only reader is a scan's stacked position) that the layer
        scans sync per layer."""
        wanted = {v: self.in_layer[n] for v, n in by_var.items() if n in self.in_layer}
        once = layer_scan.read_once(jaxpr, repeated) if self.scatter_in_layer else set()
        split = {v: self.scatter_in_layer[n] for v, n in by_var.items() if n in self.scatter_in_layer and v in once}
        synced, scattered = {}, {}
        for blocks in repeated:
            found = {v: wanted[v] for position in layer_scan.synced_positions(wanted, blocks)
                     for v in layer_scan.position_sources(blocks, position)}
            shards = {v: split[v] for v in blocks.stacked if v in split}
            layer_bytes = sum(v.aval.size * v.aval.dtype.itemsize for v in [*found, *shards]) // blocks.length
            if gradient_sync.per_layer(self.sync, layer_bytes):
                synced.update(found)
                scattered.update(shards)
        return synced, scattered

    def _repeated_blocks(self, jaxpr, num_params: int) -> tuple[list, list[str]]:
        """The families of repeated blocks, and the report's notes on them."""
        examined = examine(jaxpr, self.model.module_paths(), jaxpr.invars[:num_params])
        notes = [f"{b.span()}: one family of repeated blocks; "
                 f"{b.variants.describe()}" for b in examined.found if b.variants]
        notes += [f"{b.span()}: {len(b.collected)} value(s) each layer "
                  f"computes are read after the blocks and leave them per layer (stacked along a layer "
                  f"dim in the layer scan), e.g. {b.collected[0].what}" for b in examined.found if b.collected]
        notes += examined.notes
        if self.remat is not None and not examined.found:
            why = f" ({'; '.join(examined.notes)})" if examined.notes else " (no run of identical blocks.0, blocks.1, ...)"
            raise PlanError(
                f"{self.remat.setting} checkpoints each layer of the model's repeated blocks, but "
                f"{self.model.name} has none{why}; use remat='off'"
                + (" and offload='none'" if self.remat.offload else ""))
        return examined.found, notes


def _varying(x, axes: tuple[str, ...]):
    """`x` (whole, invariant) typed varying over `axes`."""
    return lax.pcast(x, axes, to="varying") if axes else x


def _invariant(ctx: Context, buffer):
    """A buffer the forward updated (BatchNorm's running statistics), whole and typed the same on
    every device. Whole values computed from parameters (cast to varying over the batch axes for
    the gradient sync) are typed varying even where equal: after a gather of activations, each
    device computes the global batch's statistics. They are taken from the first device (torch
    DDP's broadcast_buffers), an all-reduce of the buffer's bytes; statistics of a split batch
    are reduced over it by their rules and need nothing."""
    axes = tuple(a for a in ctx.sizes if a in collectives.vma(buffer))
    if not axes:
        return buffer
    with jax.named_scope("xtrain.buffers"):
        return collectives.broadcast_first(buffer, axes)


def _counts(ctx: Context, losses: list) -> dict:
    """The per-step counts the rules recorded, summed over the devices that split them: the
    counts of one dtype pending over the same axes in one all-reduce (alone, a layer's tokens per
    expert is the very sum HF's load-balancing loss makes, and XLA would merge the two), once
    the losses are computed (an optimization barrier): left free, XLA's GPU scheduler placed it
    inside the last MoE layer, where it took the GEMMs that hide that layer's first dispatch."""
    out: dict = {}
    pending: dict = {}
    for (name, path), count in sorted(ctx.record.counts.items()):
        if count.layout.partial and not any(count.layout.dims):
            pending.setdefault((count.layout.partial, count.dtype), []).append((name, path, count.value))
        else:
            out.setdefault(name, {})[path] = C.replicate(ctx, count).value
    for (axes, _), items in pending.items():
        values, _ = lax.optimization_barrier(([v for *_, v in items], losses))
        with jax.named_scope("xtrain.counts"):  # the report's source of this all-reduce
            totals = collectives.all_reduce_joined(values, axes)
        for (name, path, _), total in zip(items, totals):
            out.setdefault(name, {})[path] = total
    return out


class ExplicitStrategy:
    """Loss and gradients by the explicit lowering (see the module docstring)."""

    def __init__(self, model: Model, mesh, layout: StateLayout, state_specs: TrainState, config: StepConfig):
        self.program = Program(model, mesh, layout, config)
        self.layout, self.config = layout, config
        self.runner = PerDevice(mesh, state_specs, layout.batch_spec, layout.batch_args)
        self.update = zero_mod.Update.of_layout(layout, config.tx, config.grad_tx, config.sync)
        self.grad_axes = {n: layout.grad_axes(n) for n in layout.param_specs}
        self.histories = frozenset(precision.histories_of(model))  # delayed FP8 scaling's amax histories
        # ZeRO-2 reduce-scatters the gradients it splits instead of all-reducing them
        self.pending = {n: () if self.update.scatters(n) else a for n, a in self.grad_axes.items()}
        if gradient_sync.reduces_in_backward(config.sync, config.options.accumulate):
            self.program.in_layer = {n: a for n, a in self.grad_axes.items()
                                     if a and not layout.zero_axes(n) and not self.update.scatters(n)}
            # ZeRO-2: reduce-scattered per layer instead (a split of the layer dim cannot be)
            self.program.scatter_in_layer = {n: (self.update.dims[n], self.update.axes[n])
                                             for n in self.grad_axes if self.update.scatters(n) and self.update.dims[n]}

    def gradients(self, state: TrainState, batch: tuple) -> Callable[..., Gradients]:
        steps = self.config.options.accumulate
        histories = self.histories
        forward = self.program.forward(True, global_args(state, accumulation.micro_shapes(batch, steps), histories))
        regather, scattered, synced = self.program.regather, forward.scattered, forward.synced
        # ZeRO-3 shards whose gradients leave the backward pass reduced (not HSDP's, which an
        # all-reduce over the other batch axes follows: theirs reduce as before)
        fed = sorted(n for n in self.layout.optimized if self.layout.zero_axes(n) and not self.layout.grad_axes(n)) \
            if self.config.sync.int8 else []

        def compute(state: TrainState, batch: tuple, key, scale) -> Gradients:
            def loss_of(params, buffers, micro, index):
                micro_key = key if steps == 1 else jax.random.fold_in(key, index)
                feedback = {n: params.pop(FEEDBACK + n) for n in fed}
                whole = {**params, **{n: state.params[n] for n in scattered}, **state.frozen}
                (loss, buffers), counts = forward.run(whole, buffers, micro_key, micro, {n: params[n] for n in scattered},
                                                      feedback)
                return accumulation.objective(loss, scale), (loss, buffers, counts)

            if regather is not None and self.config.remat is None:
                # ZeRO-3: the backward pass gathers each weight again instead of keeping every
                # gathered weight alive (the layer scan does it per layer: Program.regather).
                # Not with remat: the outermost jax.checkpoint's policy decides for everything
                # inside it, the layer scan's remat policy included; the layers' weights are
                # then gathered again by that policy, the rest stay gathered (FSDP's root).
                loss_of = jax.checkpoint(loss_of, policy=regather)
            # `synced`: all-reduced by the layer scan inside the backward pass
            params = {n: lax.pcast(p, self.grad_axes[n], to="varying") if self.grad_axes[n] and n not in synced else p
                      for n, p in state.params.items()}
            # ZeRO-2 reduce-scattered by the layer scan: differentiated as this device's block
            params.update({n: self.update.shard(n, state.params[n]) for n in scattered})
            # ZeRO-3 with int8 gradients: each micro-batch's share of the residual, differentiated
            # (its cotangent: what this step's quantization dropped, un-normalised)
            params.update({FEEDBACK + n: state.grad_residual[n] / steps for n in fed})
            # delayed FP8 scaling: each amax history differentiated, varying over the batch axes as the
            # parameters are (so its cotangent, this step's amaxes, is not summed), then typed back by a max
            moved, buffers = precision.split_histories(state.buffers, histories)
            params.update({n: _varying(h, self.layout.batch_axes) for n, h in moved.items()})
            loss, buffers, grads, counts = accumulation.value_and_grad(loss_of, params, buffers, batch, steps,
                                                                       raw=frozenset(FEEDBACK + n for n in fed),
                                                                       maxed=histories)
            dropped = {n: grads.pop(FEEDBACK + n) for n in fed}
            amaxes = collectives.all_max({n: grads.pop(n)[:, 0] for n in histories})  # one all-reduce
            buffers = {**buffers, **precision.recorded(state.buffers, amaxes)}
            pending = {n: () if n in synced else a for n, a in self.pending.items()}
            return Gradients(loss, buffers, grads, pending, counts, frozenset(scattered), forward.findings(), dropped)

        return compute

    def loss(self, state: TrainState, batch: tuple) -> Callable:
        histories = self.histories
        forward = self.program.forward(False, global_args(state, batch, histories))

        def compute(state: TrainState, batch: tuple, key):
            moved, buffers = precision.split_histories(state.buffers, histories)
            return forward.run({**state.params, **state.frozen, **moved}, buffers, key, batch)[0][0]

        return compute

    def notes(self, findings: Findings) -> list[str]:
        fp8 = [f"FP8 delayed scaling: {len(self.histories)} amax histories (training state), each device's amaxes "
               "max-reduced once per step in one all-reduce"] if self.histories else []
        return self._stacking_notes(findings.scanned) + findings.report_notes() + fp8

    def _stacking_notes(self, scanned: frozenset[str]) -> list[str]:
        groups = self.layout.stacking.groups
        if not groups:
            return []
        unscanned = sorted(n for n in groups if n not in scanned)
        lengths = sorted({len(m) for m in groups.values()})
        notes = [f"{len(groups)} block parameter families stored stacked ({'/'.join(map(str, lengths))} layers each); "
                 f"the layer scan reads {len(groups) - len(unscanned)} of them in place"]
        if unscanned:
            notes.append(f"stored stacked but outside any layer scan (each layer sliced out every step): {unscanned[:6]}"
                         f"{' ...' if len(unscanned) > 6 else ''}")
        return notes
