"""Re-tracing interpreter: evaluates a global-shape jaxpr on local shards.

Each equation's rule (registry.rule_for) sees its operands' layouts, inserts the collectives it
needs and binds the primitive on local arrays with shape parameters rewritten. Nested calls
are interpreted, not inlined as opaque ops, so their equations get rules too (the call rules
call back into `interpret`). The walk itself is xtrain.ir.walk's.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import numpy as np
from jax import lax
from jax._src import source_info_util  # name stacks: no public name in jax 0.10
from jax.ad_checkpoint import checkpoint_name

from xtrain.ir import walk
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit import segmented, shift
from xtrain.lowering.explicit.registry import call_rule_for, rule_for
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded
from xtrain.lowering.remat import KEPT


def literal(var) -> Sharded:
    value = np.asarray(var.val, dtype=var.aval.dtype)
    shape = value.shape
    return Sharded(value, Layout.replicated(len(shape)), shape, var.aval.dtype)


def _is_dot(eqn) -> bool:
    return eqn.primitive is lax.dot_general_p


def _kept(x: Sharded) -> Sharded:
    """Tags a value remat keeps: its module matched remat='selective''s remat_keep, or it is a
    matmul output that remat='dots' offloads."""
    return dataclasses.replace(x, value=checkpoint_name(x.value, KEPT))


def _renamed(name_stack, old: str, new: str):
    """`name_stack` with module `old` (and the modules in it) named `new`: block 0's equations
    emitted for layer k of unrolled repeated blocks carry layer k's module paths."""
    def one(scope):
        name = getattr(scope, "name", None)
        if isinstance(scope, source_info_util.Scope) and (name == old or name.startswith(old + ".")):
            return source_info_util.Scope(new + name[len(old):])
        return scope

    return source_info_util.NameStack(tuple(one(scope) for scope in name_stack.stack))


def interpret(ctx: Context, jaxpr, consts, args: list[Sharded], *, regions: Mapping[int, walk.Region] | None = None,
              live: set[int] | None = None, inline: bool = False) -> list[Sharded]:
    """Evaluates `jaxpr` with `args` (Sharded) and returns its outputs as Sharded values.

    `regions` / `live`: equations emitted as a whole (the layer scan: layer_scan.regions) and
    the equations left to evaluate. `inline`: the jaxpr runs in the caller's trace (a jit or
    closed_call), so it shares the caller's conversions (sharded.memoized)."""
    if inline:  # a deferred pad may leave an inline call (torch's pad is a jit of its own)
        return _run(ctx, jaxpr, consts, args, regions, live)
    with ctx.cursor.fresh_memo():  # the jaxpr may run in another trace (a scan body)
        # (a value split per segment leaves in torch's order: the caller lays it out as it wants)
        return [segmented.unsegment(ctx, shift.materialize(ctx, o)) for o in _run(ctx, jaxpr, consts, args, regions,
                                                                                   live)]


def _run(ctx: Context, jaxpr, consts, args, regions, live) -> list[Sharded]:
    outer = ctx.path
    consts = [Sharded(c, Layout.replicated(np.ndim(c)), tuple(np.shape(c)), v.aval.dtype)
              for v, c in zip(jaxpr.constvars, consts)]

    def bind(eqn, values, path):
        with ctx.cursor.at(path):
            if not _reads_pending_pad(eqn):  # a deferred pad is read by its slice only (shift.py)
                values = [shift.materialize(ctx, v) for v in values]
            outs = segmented.apply(ctx, eqn, values, rule_for(eqn.primitive))
        if ctx.remat is not None and (ctx.remat.keeps(path) or ctx.remat.tags_dots and _is_dot(eqn)):
            outs = [_kept(o) for o in outs]
        return outs

    def name_stack(eqn):  # read per equation: the cursor is in a layer while an unrolled layer is emitted
        own = eqn.source_info.name_stack
        return own if ctx.layer is None else _renamed(own, *ctx.layer)

    return walk.evaluate(jaxpr, consts, args, bind, module_paths=ctx.module_paths, outer=outer, literal=literal,
                         name_stack=name_stack, regions=_padding_inputs(ctx, regions), live=live)


def _padding_inputs(ctx: Context, regions):
    """Regions (layer scans) read their inputs as values: a deferred pad is applied first."""
    return {i: dataclasses.replace(r, emit=lambda read, r=r: r.emit(lambda v: shift.materialize(ctx, read(v))))
            for i, r in (regions or {}).items()}


def _reads_pending_pad(eqn) -> bool:
    """A slice, or a plain call (interpreted inline, its own equations decide)."""
    if eqn.primitive is lax.slice_p:
        return True
    return str(eqn.primitive) in walk.CALLS and call_rule_for(str(eqn.params.get("name", ""))) is None
