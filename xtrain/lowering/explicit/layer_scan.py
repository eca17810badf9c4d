"""The layer scan: a model's repeated blocks (explicit/blocks.py) emitted as one lax.scan over
the first block's equations, or, with scan_layers=False, the same equations emitted once per
layer one after another. Either way each layer's ZeRO-3 shards are gathered with one flat
all-gather and each layer is checkpointed (remat) alike. Carries keep one layout across
iterations. Values each layer computes that are read after the blocks (a load-balancing loss
over every layer's router logits) leave the scan as its per-layer outputs: stacked along a
leading layer dim, each reader taking layer k's row with the layout the body gave it.

`regions` hands the interpreter the repeated blocks to emit this way (xtrain.ir.walk.Region)
and the equations left live around them.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from xtrain.ir import walk
from xtrain.lowering import gradient_sync
from xtrain.lowering import remat as remat_policy
from xtrain.lowering import regather as regather_mod
from xtrain.lowering import zero, zero3_int8
from xtrain.lowering.collectives import vma
from xtrain.lowering import sharded as C
from xtrain.lowering.explicit.blocks import RepeatedBlocks
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.explicit.variants import Picker
from xtrain.lowering.sharded import Layout
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded


def _vary(values, vmas):
    return [lax.pcast(v, tuple(sorted(m - vma(v))), to="varying") if m - vma(v) else v for v, m in zip(values, vmas)]


def scan_with_stable_carry(body, init: list, xs, **kwargs):
    """lax.scan whose carry may pick up varying mesh axes inside the body (e.g. a replicated
    value sliced per device): on a carry type mismatch, widen the initial carry and retry."""
    seen: list = []

    def recording(carry, x):
        new, y = body(carry, x)
        seen[:] = [vma(v) for v in new]
        return new, y

    try:
        return lax.scan(recording, init, xs, **kwargs)
    except TypeError:
        if not seen:
            raise
        return lax.scan(body, _vary(init, [a | b for a, b in zip(seen, map(vma, init))]), xs, **kwargs)


def _remat(body, remat, regather: zero.RegatherPolicy | None):
    """One layer's body with activation checkpointing (`remat`: a LayerRemat): `full`
    saves only the layer's input (the carry), `dots` also its matmul outputs, `selective` the
    values the interpreter tagged in the kept modules; offloaded, these go to host memory
    (xtrain.lowering.remat). Without it, ZeRO-3's re-gather
    (`regather`; None = off) saves all but the gathered weights: the backward pass gathers
    each layer's weights again, one layer ahead (xtrain.lowering.regather: the body then carries
    a token after its carry), so no layer's gathered weights outlive the next layer's backward
    (remat's policies never keep them either)."""
    if remat is not None:
        return _flat_carry(body, remat_policy.policy(remat))
    return regather_mod.regathered(body, regather) if regather is not None else body


def _flat_carry(body, policy):
    """jax.checkpoint(body, policy) whose saved carry is flat: each carry enters the checkpoint
    as a vector and takes its shape inside. XLA's GPU layout assignment otherwise gives the stack
    of saved layer inputs the layout the backward pass prefers for them (hidden-major under
    ZeRO-3) and transposes the whole stack at once, after the forward pass: a second copy of
    every layer's input alive beside the first (Llama-3-70B, 80 layers x 8192 tokens, fp32: 20
    GiB per device in the deviceless H100 compile, 60.7 -> 46.5 GiB in all). A vector has one
    layout, so each layer's backward step copies its own input instead."""
    def layer(carry, xs):
        shapes = [c.shape for c in carry]

        def shaped(flat, xs):
            return body([f.reshape(s) for f, s in zip(flat, shapes)], xs)
        return jax.checkpoint(shaped, policy=policy)([c.reshape(-1) for c in carry], xs)
    return layer


def _layer_position(ctx: Context, blocks: RepeatedBlocks, position: int, read, unrolled: bool) -> tuple[Sharded, list]:
    """One block parameter position: (layer 0's Sharded, the local values the layers run
    over). For the scan that is one (L, ...) value: the stored stacked parameter itself (no
    copy), or else the layers' values stacked here at block 0's layout. Unrolled (parameters
    are then stored per layer), it is one value per layer."""
    source = blocks.stacked_input(position)
    if source is not None:
        whole = read(source)
        if unrolled or whole.layout.dims[0] or whole.layout.partial:  # stacked storage goes with the scan
            raise AssertionError(f"stacked parameter {whole.shape} {whole.layout} in unrolled blocks or with its "
                                 "layer dimension split")
        segments = tuple((d - 1, sizes) for d, sizes in whole.layout.segments)
        layer = Sharded(None, Layout(whole.layout.dims[1:], segments=segments), whole.shape[1:], whole.dtype,
                        zero=whole.zero)
        return layer, [whole.value]
    layers = [read(layer[position]) for layer in blocks.per_layer]
    layers = [C.relayout(ctx, x, layers[0].layout) for x in layers]
    values = [x.value for x in layers]
    return layers[0], values if unrolled else [jnp.stack(values)]


def emit_repeated_blocks(ctx: Context, blocks: RepeatedBlocks, read) -> dict:
    """The first block's equations run once per layer: as one lax.scan, or, with `ctx.unroll`
    (compile(scan_layers=False)), emitted once per layer one after another. Both gather each
    layer's ZeRO-3 shards with one flat all-gather and checkpoint each layer alike. What
    differs per layer besides the parameters (explicit/variants.py) comes from the layer
    number, scanned alongside. Returns the env entries of the last block's outputs and of
    each layer's collected outputs (blocks.collected: the scan's per-layer outputs, stacked
    along a leading layer dim; layer k's row keeps the layout the body gave it)."""
    unrolled = ctx.unroll
    init = [C.resolve(ctx, read(v)) for v in blocks.init]  # carries hold whole values
    shared = [read(v) for v in blocks.shared]
    picker = Picker(ctx, blocks.variants, read, stacked=not unrolled)
    positions = [_layer_position(ctx, blocks, k, read, unrolled) for k in range(len(blocks.per_layer[0]))]
    first = [layer for layer, _ in positions]
    carry_layouts = [x.layout for x in init]
    synced = synced_positions(ctx.synced, blocks)
    scattered = scattered_positions(ctx.scattered, blocks)
    xs_of = [values for _, values in positions]
    for position, (shard, _, _) in scattered.items():  # differentiated: the block; read: the whole
        xs_of[position] = [(shard, xs_of[position][0])]
    fed = _feedback(blocks, read, unrolled)  # ZeRO-3 with int8 gradients: each layer's residual beside it
    for position, residuals in fed.items():
        xs_of[position] = list(zip(residuals, xs_of[position]))
    path, collected = ctx.path, []  # collected: the body's collected outputs (Sharded) as last traced
    pending: dict = {}  # each count's mesh axes still to sum it over (as the body left it)
    offset = len(init) + len(shared)
    narrow = [zero.narrowed(blocks.body, offset + k) for k in range(len(first))]
    _note_gather_formats(ctx, blocks, first, narrow)

    def body(carry, xs, index=None):
        layer = None if index is None else (blocks.path(0), blocks.path(index))
        with ctx.cursor.at(path), ctx.cursor.in_layer(layer):
            return _layer(carry, xs, index)

    def _layer(carry, xs, index):
        xs, number = xs[:len(first)], (index if index is not None else (xs[len(first):] or [None])[0])
        blocks_of = {position: xs[position][0] for position in scattered}
        residuals = {position: xs[position][0] for position in fed}
        xs = [x[1] if position in scattered or position in fed else x for position, x in enumerate(xs)]
        with jax.named_scope(blocks.prefix), jax.named_scope("zero3_flat_gather"):
            params = [dataclasses.replace(p, value=v, feedback=residuals.get(k)) for k, (p, v) in enumerate(zip(first, xs))]
            if fed:  # one int8-reducing gather (zero3_int8) of the layer's shards
                params = zero3_int8.gather(ctx, params, narrow, ctx.sync.int8_chunk)
            # unrolled, XLA fuses slices of a gathered flat buffer into backward-pass consumers
            # (a norm weight read where its gradient is computed), keeping the whole buffer
            # alive to the end of the step; apart, only the small vectors' buffer stays
            params = zero.gather_flat(ctx, params, vectors_apart=unrolled, narrow=narrow)
        params = _synced(ctx, synced, params, blocks.prefix)  # gradients all-reduced in this layer's backward
        params = _scattered(ctx, scattered, blocks_of, params, blocks.prefix)  # ZeRO-2's: reduce-scattered
        carry = remat_policy.layer_inputs(ctx.remat, list(carry))  # offloaded activations: tagged
        ins = [dataclasses.replace(x, value=v) for x, v in zip(init, carry)] + shared + params + picker.at(number)
        before = set(ctx.record.counts)
        outs = interpret(ctx, blocks.body, [], ins)
        collected[:] = outs[len(init):]
        outs = [C.relayout(ctx, o, layout) for o, layout in zip(outs, carry_layouts)]
        counts = _layer_counts(ctx, before, pending)
        return [o.value for o in outs], (counts, [o.value for o in collected])  # per-layer outputs of the scan

    final, rows = _run_layers(ctx, blocks, body, [x.value for x in init], xs_of)
    env = {}
    for k, (counts, values) in enumerate(rows):
        _record_counts(ctx, blocks.prefix, k, counts, pending, blocks.first)
        env.update({out.per_layer[k]: dataclasses.replace(x, value=v)
                    for out, x, v in zip(blocks.collected, collected, values)})
    env.update({v: dataclasses.replace(x, value=val) for v, x, val in zip(blocks.outputs, init, final)})
    return env


def _note_gather_formats(ctx: Context, blocks: RepeatedBlocks, first: list[Sharded], narrow: list) -> None:
    """Tells the report in what format ZeRO-3 gathers each layer's weights (zero.narrowed)."""
    formats = collections.Counter("e4m3 (their FP8 matmuls quantize the shards)" if how == zero.AT_USE else
                                  f"{jnp.dtype(how).name} (their only use casts them so)" for x, how in zip(first, narrow)
                                  if x.zero and how is not None)
    if formats:
        ctx.note(f"ZeRO-3 in {blocks.span()}: each layer gathers " + ", ".join(f"{n} weights as {f}" for f, n in
                                                                             formats.items()) + "; the rest as stored")


def _feedback(blocks: RepeatedBlocks, read, unrolled: bool) -> dict[int, list]:
    """Per parameter position whose values carry an int8 residual (Sharded.feedback): the
    residuals the layers run over, aligned with `_layer_position`'s values."""
    out = {}
    for position in range(len(blocks.per_layer[0])):
        source = blocks.stacked_input(position)
        if source is not None:
            residual = read(source).feedback
            if residual is not None:
                out[position] = [residual]
            continue
        residuals = [read(layer[position]).feedback for layer in blocks.per_layer]
        if all(r is not None for r in residuals):
            out[position] = residuals if unrolled else [jnp.stack(residuals)]
    return out


def synced_positions(synced: Mapping, blocks: RepeatedBlocks) -> dict[int, tuple[str, ...]]:
    """Parameter positions whose gradients the scan all-reduces per layer (position -> axes):
    those whose every source (the stacked input, or each layer's parameter) is in `synced`
    (jaxpr var -> mesh axes), all with the same axes."""
    out = {}
    for position in range(len(blocks.per_layer[0])):
        axes = {synced.get(v) if isinstance(v, jcore.Var) else None for v in position_sources(blocks, position)}
        if len(axes) == 1 and None not in axes:
            out[position] = axes.pop()
    return out


def position_sources(blocks: RepeatedBlocks, position: int) -> list:
    """The vars a parameter position reads: the stacked input, or else each layer's parameter."""
    source = blocks.stacked_input(position)
    return [source] if source is not None else [layer[position] for layer in blocks.per_layer]


def _per_bucket(params: list[Sharded], axes_of: Mapping[int, tuple], apply) -> list[Sharded]:
    """`params` with those at `axes_of`'s positions (position -> mesh axes) replaced by
    `apply(positions, axes)`, called once per group of (axes, dtype, varying axes): one bucket,
    one collective per group in this layer's backward pass."""
    groups: dict[tuple, list[int]] = {}
    for position, axes in axes_of.items():
        p = params[position]
        groups.setdefault((axes, str(p.value.dtype), tuple(sorted(vma(p.value)))), []).append(position)
    out = list(params)
    for (axes, _, _), positions in groups.items():
        for k, v in zip(positions, apply(positions, axes)):
            out[k] = dataclasses.replace(params[k], value=v)
    return out


def _synced(ctx: Context, synced: dict, params: list[Sharded], prefix: str) -> list[Sharded]:
    """`params` with those at `synced` positions cast to varying by gradient_sync.in_layer: one
    all-reduce per bucket in this layer's backward pass."""
    return _per_bucket(params, synced, lambda positions, axes: gradient_sync.in_layer(
        [params[k].value for k in positions], axes, ctx.sync, f"{prefix}.*"))


def scattered_positions(scattered: Mapping, blocks: RepeatedBlocks) -> dict[int, tuple]:
    """Parameter positions whose gradients the scan reduce-scatters per layer (ZeRO-2): those
    read from a stacked input in `scattered` (jaxpr var -> (this device's block, ZeRO dim of
    the stacked parameter, mesh axes))."""
    return {position: scattered[source] for position in range(len(blocks.per_layer[0]))
            if (source := blocks.stacked_input(position)) is not None and source in scattered}


def _scattered(ctx: Context, scattered: dict, blocks_of: dict, params: list[Sharded], prefix: str) -> list[Sharded]:
    """`params` with those at `scattered` positions cast to varying by zero.scatter_in_layer, the
    derivative going to this device's block of each (`blocks_of`, position -> this layer's
    block): one reduce-scatter per bucket in this layer's backward pass."""
    return _per_bucket(params, {k: axes for k, (_, _, axes) in scattered.items()}, lambda positions, axes: (
        zero.scatter_in_layer([blocks_of[k] for k in positions], [params[k].value for k in positions],
                              [scattered[k][1] - 1 for k in positions], axes, ctx.sync, f"{prefix}.*")))


def _run_layers(ctx: Context, blocks: RepeatedBlocks, body, init: list, positions: list) -> tuple[list, list]:
    """(final carry, per layer (counts, collected values)) of `body` run over the layers: one
    call per layer unrolled, else one lax.scan whose stacked outputs are cut into layers.
    ZeRO-3's re-gather carries a token beside the carry (xtrain.lowering.regather)."""
    tokened = ctx.regather is not None and ctx.remat is None
    final = init + [regather_mod.token()] if tokened else init
    rows = []
    if ctx.unroll:
        for k in range(blocks.length):
            layer = _remat(functools.partial(body, index=k), ctx.remat, ctx.regather)
            final, row = layer(final, [values[k] for values in positions])
            rows.append(row)
        return final[:len(init)], rows
    numbers = [jnp.arange(blocks.length, dtype=jnp.int32)] if blocks.variants else []
    final, (counts, stacked) = scan_with_stable_carry(_remat(body, ctx.remat, ctx.regather), final,
                                                      [values[0] for values in positions] + numbers,
                                                      length=blocks.length)
    for k in range(blocks.length):
        rows.append(({key: c[k] for key, c in counts.items()}, [s[k] for s in stacked]))
    return final[:len(init)], rows


def _layer_counts(ctx: Context, before: set, pending: dict) -> dict:
    """The counts a layer recorded (those not in `before`), gathered on every dim; their sums
    over the devices are left to the step's end (one all-reduce for all: forward._counts), the
    axes of each put in `pending`."""
    out = {}
    for key, x in ctx.record.take_counts(before).items():
        for dim in range(x.ndim):
            x = C.gather_dim(ctx, x, dim)
        pending[key] = x.layout.partial
        out[key] = x.value
    return out


def _record_counts(ctx: Context, prefix: str, k: int, counts: dict, pending: dict, first: int = 0) -> None:
    """Layer k's counts (recorded under block 0's module path inside the body), whole dims,
    pending sums over the `pending` axes of each."""
    for (name, path), count in counts.items():
        at = layer_path(prefix, k, path, first)
        layout = Layout(((),) * count.ndim, pending[name, path])
        ctx.record.count(name, at, Sharded(count, layout, tuple(count.shape), count.dtype))


def layer_path(prefix: str, k: int, path: str, first: int = 0) -> str:
    """The module path in layer k of what the layer body records under the family's first block's
    `path` (blocks numbered from `first`)."""
    base = f"{prefix}.{first}"
    return f"{prefix}.{first + k}" + path[len(base):] if path.startswith(base) else f"{path}[{k}]"


def _live(jaxpr, repeated) -> set[int]:
    """Indices of the equations whose results are used. Where the layer scan reads a stacked
    parameter directly, the per-layer slices the traced model took of it are dead: not emitting
    them keeps the program the same size whatever the depth."""
    needed = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    ends = {r.stop - 1: r for r in repeated}
    live: set[int] = set()
    index = len(jaxpr.eqns) - 1
    while index >= 0:
        if index in ends:
            blocks = ends[index]
            live.update(range(blocks.start, blocks.stop))
            needed.update(v for v in blocks.inputs() if isinstance(v, jcore.Var))
            index = blocks.start - 1
            continue
        eqn = jaxpr.eqns[index]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live.add(index)
            needed.update(v for v in eqn.invars if isinstance(v, jcore.Var))
        index -= 1
    return live


def read_once(jaxpr, repeated: list[RepeatedBlocks]) -> set:
    """The stacked inputs of the layer scans that nothing else reads (not another position, scan
    or equation, nor the outputs): all of their gradient comes from that one scan position."""
    inside = {i for r in repeated for i in range(r.start, r.stop)}
    reads = collections.Counter(v for i in _live(jaxpr, repeated) - inside for v in jaxpr.eqns[i].invars
                                if isinstance(v, jcore.Var))
    reads.update(v for v in jaxpr.outvars if isinstance(v, jcore.Var))
    for r in repeated:
        reads.update(v for v in r.inputs() if isinstance(v, jcore.Var))
    return {v for r in repeated for v in r.stacked if v is not None and reads[v] == 1}


def regions(ctx: Context, jaxpr, repeated: list[RepeatedBlocks]) -> tuple[dict[int, walk.Region], set[int] | None]:
    """(regions, live equations) for interpreting `jaxpr` with its `repeated` blocks as layer scans."""
    if not repeated:
        return {}, None
    emit = {r.start: walk.Region(r.stop, functools.partial(emit_repeated_blocks, ctx, r)) for r in repeated}
    return emit, _live(jaxpr, repeated)
