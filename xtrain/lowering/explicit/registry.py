"""The partition rule registry: primitive name -> rule, and what every rule shares.

A rule gets the equation and its operands as Sharded values (local array + Layout) and returns
the outputs as Sharded values. It may move operands (sharded.relayout, resolve, gather_dim,
split_dim) and must rewrite shape-carrying parameters to local shapes. The rules live in
xtrain.lowering.explicit.rules, one module per family, each registering its primitives here;
the interpreter looks them up with `rule_for`. A primitive without a rule runs replicated
(`fallback`), and the report names it and its module.
"""
from __future__ import annotations

from typing import Callable

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


def fallback(ctx: Context, eqn, args):
    """No rule: gather every operand, run the op replicated on each device."""
    if any(not a.layout.is_replicated for a in args):
        ctx.note_fallback(str(eqn.primitive))
    return replicated(ctx, eqn, args)


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
