"""The partition rule registry: primitive name -> rule, and what every rule shares.

A rule gets the equation and its operands as Sharded values (local array + Layout) and returns
the outputs as Sharded values. It may move operands (sharded.relayout, resolve, gather_dim,
split_dim) and must rewrite shape-carrying parameters to local shapes. The rules live in
xtrain.lowering.explicit.rules, one module per family, each registering its primitives here;
the interpreter looks them up with `rule_for`. A primitive without a rule reached by a split
operand raises UnsupportedOpError, unless the plan lets it run replicated there
(Plan(fallback="replicate") or fallback_modules: `fallback`); the report then names it and its
module, and its gathers run under a `fallback:` name scope the collectives table marks.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax._src import source_info_util  # an equation's user frame: no public name in jax 0.10

from xtrain.errors import UnsupportedOpError

from xtrain.lowering.collectives import vma
from xtrain.lowering import sharded as C
from xtrain.lowering.sharded import Layout
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded

Rule = Callable[[Context, object, list], list]
RULES: dict[str, Rule] = {}
# calls (jit) recognised by name and partitioned as a whole: (name predicate, rule)
CALL_RULES: list[tuple[Callable[[str], bool], Rule]] = []


def out_avals(eqn):
    return [v.aval for v in eqn.outvars]


def same_vma(ctx: Context, values):
    """Primitives need operands varying over the same mesh axes (the jnp layer would pcast)."""
    union = frozenset().union(*(vma(v) for v in values))
    return [C.pcast_varying(ctx, v, tuple(sorted(union - vma(v))))
            if hasattr(v, "shape") and union - vma(v) else v for v in values]


def bind(ctx: Context, eqn, values, **overrides):
    params = {**eqn.params, **overrides}
    out = eqn.primitive.bind(*same_vma(ctx, values), **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def wrap(eqn, values, layouts) -> list[Sharded]:
    return [Sharded(v, l, tuple(a.shape), a.dtype) for v, l, a in zip(values, layouts, out_avals(eqn))]


def local_shape(shape, layout: Layout, ctx: Context) -> tuple[int, ...]:
    return layout.local_shape(shape, ctx.sizes)


def whole_dims_where(ctx: Context, x: Sharded, needs_whole) -> Sharded:
    for d in range(x.ndim):
        if needs_whole(d):
            x = C.gather_dim(ctx, x, d)
    return x


FALLBACK_SCOPE = "fallback:"  # name scope of a fallback's gathers (lowering.accounting marks them)


def fallback(ctx: Context, eqn, args):
    """No rule: gather every operand, run the op replicated on each device, where the plan
    allows it (ctx.fallback); elsewhere a split operand makes this an UnsupportedOpError."""
    split = [a for a in args if not a.layout.is_replicated]
    if not split:
        return replicated(ctx, eqn, args)
    gathered = sum(C.aval_bytes(a) for a in split)
    if not ctx.fallback.allows(ctx.path):
        raise _unsupported(ctx, eqn, split, gathered)
    ctx.note_fallback(str(eqn.primitive), gathered)
    with jax.named_scope(FALLBACK_SCOPE + str(eqn.primitive)):
        return replicated(ctx, eqn, args)


def op_origin(eqn) -> str:
    """Where an equation came from: its name stack (the torch op's implementation, e.g.
    jit(_aten_...)) and the user's source line."""
    stack = str(eqn.source_info.name_stack)
    line = source_info_util.summarize(eqn.source_info)
    return " at ".join(p for p in (stack, line) if p)


def _unsupported(ctx: Context, eqn, split, gathered: int) -> UnsupportedOpError:
    prim, module = str(eqn.primitive), ctx.path or "<top level>"
    splits = tuple(tuple(a.layout.dims) for a in split)
    shown = "; ".join(f"{a.dtype}{list(a.shape)} split {a.layout}" for a in split)
    return UnsupportedOpError(
        f"no partition rule for {prim} (from {op_origin(eqn)}) in module {module!r}: its operand(s) {shown} are "
        f"split, and running it replicated would all-gather {gathered} bytes per call on every device. Let it run "
        f"replicated with Plan(fallback='replicate'), or only there with Plan(fallback_modules=({module!r},)); "
        f"or keep that tensor whole in the plan", primitive=prim, module=module, splits=splits, gathered_bytes=gathered)


def replicated(ctx: Context, eqn, args):
    """Ops that are always computed whole (RNG keys, iota): replicate inputs, bind as is."""
    args = [C.replicate(ctx, a) for a in args]
    outs = bind(ctx, eqn, [a.value for a in args])
    return wrap(eqn, outs, [Layout.replicated(len(a.shape)) for a in out_avals(eqn)])


def register(rule: Rule, *names: str) -> None:
    """Makes `rule` the partition rule of the primitives `names`."""
    for name in names:
        RULES[name] = rule


def register_call(matches: Callable[[str], bool], rule: Rule) -> None:
    """Makes `rule` the partition rule of the calls whose name `matches` (instead of
    interpreting the callee equation by equation)."""
    CALL_RULES.append((matches, rule))


def call_rule_for(name: str) -> Rule | None:
    """The rule of a call named `name`, else None (its body is interpreted)."""
    return next((rule for matches, rule in CALL_RULES if matches(name)), None)


def rule_for(primitive) -> Rule:
    """The rule of `primitive`, else `fallback`."""
    return RULES.get(str(primitive), fallback)
