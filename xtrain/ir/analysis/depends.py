"""Which outputs of a jaxpr depend on which of its inputs (forward data dependence).

The zero-bubble pipeline keeps, per microbatch, only the residuals of a stage's forward that
depend on the microbatch (its activations); the ones computed from the weights alone (a cast,
a transpose) are the same for every microbatch and are recomputed where they are needed.
Loops are followed through their bodies (a scan's carry to a fixpoint), calls and branches
through theirs (a branch's outputs depend on its index too); any other equation with a
sub-jaxpr makes all its outputs depend on all its inputs.
"""
from __future__ import annotations

from jax.extend import core as jcore

_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat2", "checkpoint", "custom_jvp_call",
                    "custom_vjp_call", "custom_vjp_call_jaxpr"})


def _inner(eqn):
    """The sub-jaxpr of a call-like equation (its invars line up with the equation's)."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None


def _scan(eqn, flags: list[bool]) -> list[bool]:
    body = eqn.params["jaxpr"].jaxpr
    consts, carry = eqn.params["num_consts"], eqn.params["num_carry"]
    flags = list(flags)
    while True:
        out = outputs(body, flags)
        widened = [f or o for f, o in zip(flags[consts:consts + carry], out[:carry])]
        if widened == flags[consts:consts + carry]:
            return out
        flags[consts:consts + carry] = widened


def _cond(eqn, flags: list[bool]) -> list[bool]:
    """A branch's outputs depend on what the branches' do; all of them on the index."""
    if flags[0]:
        return [True] * len(eqn.outvars)
    per_branch = [outputs(b.jaxpr, flags[1:]) for b in eqn.params["branches"]]
    return [any(column) for column in zip(*per_branch)]


def _eqn(eqn, flags: list[bool]) -> list[bool]:
    name = eqn.primitive.name
    if name == "scan":
        return _scan(eqn, flags)
    if name == "cond":
        return _cond(eqn, flags)
    inner = _inner(eqn) if name in _CALLS else None
    if inner is not None and len(inner.invars) == len(flags):
        return outputs(inner, flags)
    return [any(flags)] * len(eqn.outvars)  # any other op (loops and branches too: conservatively)


def outputs(jaxpr, flags: list[bool]) -> list[bool]:
    """Per outvar of `jaxpr` (a Jaxpr or ClosedJaxpr), whether it depends on an invar whose
    flag is set (constvars never do)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    marked = {v for v, f in zip(jaxpr.invars, flags) if f}
    for eqn in jaxpr.eqns:
        ins = [isinstance(v, jcore.Var) and v in marked for v in eqn.invars]
        if not any(ins):
            continue
        marked.update(v for v, f in zip(eqn.outvars, _eqn(eqn, ins)) if f)
    return [isinstance(v, jcore.Var) and v in marked for v in jaxpr.outvars]
