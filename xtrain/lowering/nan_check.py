"""Which tensor went non-finite first: a debugging pass run after a step with a NaN/inf.

The model's forward is evaluated again in the global view (XLA's partitioner places it on the
same mesh) equation by equation, nested jit calls inlined, recording whether each equation's
floating-point outputs are all finite; the first that is not is named by its module path.
It runs only after a bad step (compile(..., detect_nan=True)), so it costs nothing otherwise.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from xtrain.frontend.graph import module_path


@dataclasses.dataclass(frozen=True)
class BadTensor:
    module: str        # module path ("" = the model's top level)
    primitive: str
    shape: tuple[int, ...]


def _walk(jaxpr, consts, args, paths, outer, found: list) -> list:
    """Evaluates `jaxpr`; appends (all finite?, BadTensor) per float-valued equation."""
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for eqn in jaxpr.eqns:
        path = module_path(eqn, paths, outer)
        ins = [read(v) for v in eqn.invars]
        if eqn.primitive.name in ("pjit", "jit", "closed_call"):
            closed = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
            outs = _walk(closed.jaxpr, closed.consts, ins, paths, path, found)
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
            for out in outs:
                if jnp.issubdtype(out.dtype, jnp.floating):
                    found.append((jnp.all(jnp.isfinite(out)), BadTensor(path, eqn.primitive.name, tuple(out.shape))))
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, jcore.DropVar))
    return [read(v) for v in jaxpr.outvars]


def first_nonfinite(model, params, buffers, key, batch) -> BadTensor | None:
    """The first equation of the training forward whose output holds a NaN or inf."""
    apply = lambda *a: model.apply(*a, training=True)
    args = (params, buffers, key, batch)
    closed = jax.make_jaxpr(apply)(*args)
    where: list[BadTensor] = []

    def flags(*leaves):
        found: list = []
        _walk(closed.jaxpr, closed.consts, list(leaves), model.module_paths(), "", found)
        where[:] = [w for _, w in found]
        return jnp.stack([ok for ok, _ in found]) if found else jnp.ones((0,), bool)

    ok = np.asarray(jax.jit(flags)(*jax.tree.leaves(args)))
    bad = np.flatnonzero(~ok)
    return where[bad[0]] if bad.size else None
