"""Re-tracing interpreter: evaluates a global-shape jaxpr on local shards.

Each equation's rule (rules.RULES) sees its operands' layouts, inserts the collectives it
needs and binds the primitive on local arrays with shape parameters rewritten. Nested calls
are interpreted, not inlined as opaque ops, so their equations get rules too.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from jax._src import source_info_util
from jax.extend import core as jcore

from xtrain.lowering.explicit.collectives import Context, Sharded
from xtrain.lowering.explicit.layout import Layout


def literal(var) -> Sharded:
    value = np.asarray(var.val, dtype=var.aval.dtype)
    shape = value.shape
    return Sharded(value, Layout.replicated(len(shape)), shape, var.aval.dtype)


def _kept(x: Sharded) -> Sharded:
    """Tags a value remat='selective' keeps (its module matched remat_keep)."""
    from jax.ad_checkpoint import checkpoint_name

    from xtrain.remat import KEPT

    return dataclasses.replace(x, value=checkpoint_name(x.value, KEPT))


def module_path(ctx: Context, eqn, outer: str) -> str:
    return _module_path(ctx, eqn.source_info.name_stack, outer)


def _module_path(ctx: Context, name_stack, outer: str) -> str:
    path = outer
    for part in str(name_stack).split("/"):
        if part in ctx.module_paths:
            path = part
    return path


def _renamed(name_stack, old: str, new: str):
    """`name_stack` with module `old` (and the modules in it) named `new`: block 0's equations
    emitted for layer k of unrolled repeated blocks carry layer k's module paths."""
    def one(scope):
        name = getattr(scope, "name", None)
        if isinstance(scope, source_info_util.Scope) and (name == old or name.startswith(old + ".")):
            return source_info_util.Scope(new + name[len(old):])
        return scope

    return source_info_util.NameStack(tuple(one(scope) for scope in name_stack.stack))


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


def interpret(ctx: Context, jaxpr, consts, args: list[Sharded], repeated=(), inline: bool = False) -> list[Sharded]:
    """Evaluates `jaxpr` with `args` (Sharded) and returns its outputs as Sharded values.

    `repeated`: layer_scan.RepeatedBlocks of this jaxpr, each emitted as one scan. `inline`:
    the jaxpr runs in the caller's trace (a jit or closed_call), so it shares the caller's
    conversions (collectives.memoized)."""
    if inline:
        return _run(ctx, jaxpr, consts, args, repeated)
    # a nested jaxpr that may run in another trace (scan body) must neither leak its
    # conversions out nor see the outer ones
    outer_memo, ctx.memo = ctx.memo, {}
    try:
        return _run(ctx, jaxpr, consts, args, repeated)
    finally:
        ctx.memo = outer_memo


def _run(ctx: Context, jaxpr, consts, args, repeated) -> list[Sharded]:
    from xtrain.lowering.explicit.rules import rule_for
    from xtrain.lowering.explicit.scan import emit_repeated_blocks

    env: dict = {}

    def read(var) -> Sharded:
        return literal(var) if isinstance(var, jcore.Literal) else env[var]

    for var, const in zip(jaxpr.constvars, consts):
        shape = tuple(np.shape(const))
        env[var] = Sharded(const, Layout.replicated(len(shape)), shape, var.aval.dtype)
    for var, arg in zip(jaxpr.invars, args):
        env[var] = arg
    outer = ctx.path
    starts = {r.start: r for r in repeated}
    live = _live(jaxpr, repeated) if repeated else range(len(jaxpr.eqns))
    skip_until = 0
    for index, eqn in enumerate(jaxpr.eqns):
        if index < skip_until or index not in live:
            continue
        if index in starts:
            env.update(emit_repeated_blocks(ctx, starts[index], read))
            skip_until = starts[index].stop
            continue
        own = eqn.source_info.name_stack if ctx.layer is None else _renamed(eqn.source_info.name_stack, *ctx.layer)
        ctx.path = _module_path(ctx, own, outer)
        name_stack = source_info_util.current_name_stack() + own
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
            outs = rule_for(eqn.primitive)(ctx, eqn, [read(v) for v in eqn.invars])
        if ctx.remat is not None and ctx.remat.keeps(ctx.path):
            outs = [_kept(o) for o in outs]
        for var, out in zip(eqn.outvars, outs):
            if not isinstance(var, jcore.DropVar):
                env[var] = out
        ctx.path = outer
    return [read(v) for v in jaxpr.outvars]
