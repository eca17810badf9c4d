"""The one jaxpr walker: every pass that evaluates a traced program equation by equation (the
explicit lowering's interpreter, the mixed-precision policy, the NaN locator, the collective
ordering on CPU) runs through `evaluate`.

The walker owns what they share: the environment (constants, arguments, literals, dropped
outputs), the torch module path of each equation (from its name stack; nested call bodies carry
stacks relative to their call site, hence `outer`), and JAX's source context, so the equations a
pass emits keep the source line and name stack of the equation they came from. A pass supplies
only `bind`: what to do with one equation.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Mapping

import jax
from jax._src import source_info_util  # name stacks and source contexts: no public name in jax 0.10
from jax.extend import core as jcore

# Call-like equations whose body runs in the caller's trace: passes inline them.
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})

Bind = Callable[[Any, list, str], list]   # (equation, operand values, module path) -> output values


def over_dynamic(fn: Callable, leaves: list, tree, dynamic: list[int]) -> Callable:
    """`fn` of the pytree `tree` as a function of only its leaves at `dynamic` (the traced ones),
    the other leaves held as they are: what a probe trace of `fn` takes (jax.make_jaxpr)."""
    def probe(*values):
        full = list(leaves)
        for i, v in zip(dynamic, values):
            full[i] = v
        return fn(*jax.tree.unflatten(tree, full))

    return probe


def module_path(name_stack, module_paths: frozenset[str], outer: str = "") -> str:
    """The innermost module of `module_paths` named in `name_stack`, else `outer`."""
    path = outer
    for part in str(name_stack).split("/"):
        if part in module_paths:
            path = part
    return path


def eqn_path(eqn, module_paths: frozenset[str], outer: str = "") -> str:
    """The torch module path an equation came from ("" for the model's top level)."""
    return module_path(eqn.source_info.name_stack, module_paths, outer)


def call_body(eqn) -> tuple[Any, list]:
    """(jaxpr, consts) of a call equation (`CALLS`)."""
    body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    return (body.jaxpr, list(body.consts)) if isinstance(body, jcore.ClosedJaxpr) else (body, [])


@dataclasses.dataclass(frozen=True)
class Region:
    """Equations [start, stop) a pass emits as a whole (the explicit lowering's layer scan):
    `emit(read)` returns the values of the variables the rest of the jaxpr reads from it."""

    stop: int
    emit: Callable[[Callable], Mapping[Any, Any]]


def evaluate(jaxpr, consts: Iterable, args: Iterable, bind: Bind, *, module_paths: frozenset[str] = frozenset(),
             outer: str = "", literal: Callable = lambda var: var.val,
             name_stack: Callable | None = None, regions: Mapping[int, Region] | None = None,
             live: Iterable[int] | None = None) -> list:
    """Evaluates `jaxpr` on `args`, one `bind(eqn, values, path)` per equation; returns its outputs.

    Args:
        literal: the value of a literal operand (default: its Python/numpy value).
        name_stack: the name stack an equation is emitted under (default: its own).
        regions: equation index -> Region emitted in place of equations [index, stop).
        live: the equation indices to evaluate (default: all); the others are dead code.
    """
    env: dict = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda var: literal(var) if isinstance(var, jcore.Literal) else env[var]
    regions, live = regions or {}, None if live is None else set(live)
    index = 0
    while index < len(jaxpr.eqns):
        if index in regions:
            env.update(regions[index].emit(read))
            index = regions[index].stop
            continue
        eqn = jaxpr.eqns[index]
        index += 1
        if live is not None and index - 1 not in live:
            continue
        stack = eqn.source_info.name_stack if name_stack is None else name_stack(eqn)
        path = module_path(stack, module_paths, outer)
        with source_info_util.user_context(eqn.source_info.traceback,
                                           name_stack=source_info_util.current_name_stack() + stack):
            outs = bind(eqn, [read(v) for v in eqn.invars], path)
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, jcore.DropVar))
    return [read(v) for v in jaxpr.outvars]


def equations(jaxpr, module_paths: frozenset[str], outer: str = ""):
    """Every equation of `jaxpr`, nested ones included, with its module path (no evaluation)."""
    for eqn in jaxpr.eqns:
        path = eqn_path(eqn, module_paths, outer)
        yield eqn, path
        for sub in jcore.jaxprs_in_params(eqn.params):
            yield from equations(sub, module_paths, path)


def bind_eqn(eqn, values: list, params: Mapping | None = None) -> list:
    """The equation's primitive applied to `values` (its own parameters unless `params`)."""
    params = eqn.primitive.get_bind_params(eqn.params if params is None else params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


# Bodies that run inline, their inputs the caller's operands (custom_jvp, custom_vjp, remat).
_BODIES = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def inline_body(eqn):
    """The inline body of a call-like equation (pjit, custom_jvp/vjp, remat), else None."""
    if eqn.primitive.name in CALLS:
        return call_body(eqn)[0]
    for key in _BODIES:
        body = eqn.params.get(key)
        if body is not None:
            body = body.jaxpr if isinstance(body, jcore.ClosedJaxpr) else body
            if hasattr(body, "invars") and len(body.invars) == len(eqn.invars):
                return body
    return None
