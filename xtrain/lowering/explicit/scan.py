"""Loops in the per-device program: the layer scan of repeated blocks (or, with
scan_layers=False, the same blocks emitted one after another), and the rules for `scan` /
`while` equations of the traced graph. Carries keep one layout across iterations."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.lowering.explicit import collectives as C
from xtrain.lowering.explicit.collectives import Context, Sharded
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.explicit.layer_scan import RepeatedBlocks
from xtrain.lowering.explicit.layout import Layout


def _vary(values, vmas):
    return [lax.pcast(v, tuple(sorted(m - C.vma(v))), to="varying") if m - C.vma(v) else v for v, m in zip(values, vmas)]


def scan_with_stable_carry(body, init: list, xs, **kwargs):
    """lax.scan whose carry may pick up varying mesh axes inside the body (e.g. a replicated
    value sliced per device): on a carry type mismatch, widen the initial carry and retry."""
    seen: list = []

    def recording(carry, x):
        new, y = body(carry, x)
        seen[:] = [C.vma(v) for v in new]
        return new, y

    try:
        return lax.scan(recording, init, xs, **kwargs)
    except TypeError:
        if not seen:
            raise
        return lax.scan(body, _vary(init, [a | b for a, b in zip(seen, map(C.vma, init))]), xs, **kwargs)


def _remat(body, remat, regather: "C.RegatherPolicy | None"):
    """One layer's body with activation checkpointing (`remat`: a LayerRemat): `full`
    saves only the layer's input (the carry), `dots` also its matmul outputs, `selective` the
    values the interpreter tagged in the kept modules. Without it, ZeRO-3's re-gather
    (`regather`; None = off) saves all but the gathered weights: the backward pass gathers
    each layer's weights again where it reaches that layer, so no layer's gathered weights
    outlive it (remat's policies never keep them either)."""
    if remat is not None:
        return jax.checkpoint(body, policy=remat.policy())
    return jax.checkpoint(body, policy=regather) if regather is not None else body


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
        layer = Sharded(None, Layout(whole.layout.dims[1:]), whole.shape[1:], whole.dtype, param=whole.param)
        return layer, [whole.value]
    layers = [read(layer[position]) for layer in blocks.per_layer]
    layers = [C.relayout(ctx, x, layers[0].layout) for x in layers]
    values = [x.value for x in layers]
    return layers[0], values if unrolled else [jnp.stack(values)]


def emit_repeated_blocks(ctx: Context, blocks: RepeatedBlocks, read) -> dict:
    """The first block's equations run once per layer: as one lax.scan, or, with `ctx.unroll`
    (compile(scan_layers=False)), emitted once per layer one after another. Both gather each
    layer's ZeRO-3 shards with one flat all-gather and checkpoint each layer alike. Returns
    the env entries of the last block's outputs."""
    unrolled = ctx.unroll
    init = [C.resolve(ctx, read(v)) for v in blocks.init]  # carries hold whole values
    shared = [read(v) for v in blocks.shared]
    positions = [_layer_position(ctx, blocks, k, read, unrolled) for k in range(len(blocks.per_layer[0]))]
    first = [layer for layer, _ in positions]
    carry_layouts = [x.layout for x in init]
    path = ctx.path

    def body(carry, xs, index=None):
        ctx.path = path
        ctx.layer = None if index is None else (f"{blocks.prefix}.0", f"{blocks.prefix}.{index}")
        with jax.named_scope(blocks.prefix), jax.named_scope("zero3_flat_gather"):
            # unrolled, XLA fuses slices of a gathered flat buffer into backward-pass consumers
            # (a norm weight read where its gradient is computed), keeping the whole buffer
            # alive to the end of the step; apart, only the small vectors' buffer stays
            params = C.gather_flat(ctx, [dataclasses.replace(p, value=v) for p, v in zip(first, xs)],
                                   vectors_apart=unrolled)
        ins = [dataclasses.replace(x, value=v) for x, v in zip(init, carry)] + shared + params
        outs = interpret(ctx, blocks.body, [], ins)
        outs = [C.relayout(ctx, o, layout) for o, layout in zip(outs, carry_layouts)]
        ctx.layer = None
        return [o.value for o in outs], None

    final = [x.value for x in init]
    if unrolled:
        for k in range(blocks.length):
            layer = _remat(functools.partial(body, index=k), ctx.remat, ctx.regather)
            final, _ = layer(final, [values[k] for _, values in positions])
    else:
        final, _ = scan_with_stable_carry(_remat(body, ctx.remat, ctx.regather), final,
                                          [values[0] for _, values in positions], length=blocks.length)
    return {v: dataclasses.replace(x, value=val) for v, x, val in zip(blocks.outputs, init, final)}


def scan_rule(ctx: Context, eqn, args):
    """A scan of the traced graph: the scanned axis whole, carries at their initial layout."""
    p = eqn.params
    n_consts, n_carry = p["num_consts"], p["num_carry"]
    consts, init, xs = args[:n_consts], args[n_consts:n_consts + n_carry], args[n_consts + n_carry:]
    init = C.resolve_all(ctx, init)  # carries hold whole values
    xs = [C.gather_dim(ctx, C.resolve(ctx, x), 0) for x in xs]
    body_jaxpr = p["jaxpr"]
    y_layouts: list = []
    path = ctx.path

    def body(carry, x_vals):
        ctx.path = path
        ins = (consts + [dataclasses.replace(c, value=v) for c, v in zip(init, carry)]
               + [Sharded(v, Layout(x.layout.dims[1:]), x.shape[1:], x.dtype) for x, v in zip(xs, x_vals)])
        outs = interpret(ctx, body_jaxpr.jaxpr, body_jaxpr.consts, ins)
        new = [C.relayout(ctx, o, c.layout) for o, c in zip(outs[:n_carry], init)]
        y_layouts[:] = [o.layout for o in outs[n_carry:]]
        return [o.value for o in new], [o.value for o in outs[n_carry:]]

    final, ys = scan_with_stable_carry(body, [c.value for c in init], [x.value for x in xs],
                                       length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    out_avals = [v.aval for v in eqn.outvars]
    carries = [dataclasses.replace(c, value=v) for c, v in zip(init, final)]
    stacked = [Sharded(v, Layout(((),) + l.dims, l.partial), tuple(a.shape), a.dtype)
               for v, l, a in zip(ys, y_layouts, out_avals[n_carry:])]
    return carries + stacked


def while_rule(ctx: Context, eqn, args):
    """A while loop: the predicate computed replicated, carries at their initial layout."""
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    c_consts, b_consts = args[:p["cond_nconsts"]], args[p["cond_nconsts"]:p["cond_nconsts"] + p["body_nconsts"]]
    init = C.resolve_all(ctx, args[p["cond_nconsts"] + p["body_nconsts"]:])  # carries hold whole values
    path = ctx.path

    def as_sharded(vals):
        return [dataclasses.replace(c, value=v) for c, v in zip(init, vals)]

    def cond_fn(vals):
        ctx.path = path
        (pred,) = interpret(ctx, cond.jaxpr, cond.consts, c_consts + as_sharded(vals))
        return C.replicate(ctx, pred).value

    def body_fn(vals):
        ctx.path = path
        outs = interpret(ctx, body.jaxpr, body.consts, b_consts + as_sharded(vals))
        return [C.relayout(ctx, o, c.layout).value for o, c in zip(outs, init)]

    final = lax.while_loop(cond_fn, body_fn, [c.value for c in init])
    return as_sharded(final)
