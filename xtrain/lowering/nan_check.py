"""Which tensor went non-finite first: a debugging pass run after a step with a NaN/inf.

The model's forward is evaluated again in the global view (XLA's partitioner places it on the
same mesh) equation by equation, nested jit calls inlined, recording whether each equation's
floating-point outputs are all finite; the first that is not is named by its module path.
It runs only after a step detect_nan skipped (xtrain.step.guards), on the state that step kept, so it
costs nothing otherwise.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from xtrain.ir import walk


@dataclasses.dataclass(frozen=True)
class BadTensor:
    module: str        # module path ("" = the model's top level)
    primitive: str
    shape: tuple[int, ...]


def _walk(jaxpr, consts, args, paths, outer, found: list) -> list:
    """Evaluates `jaxpr`; appends (all finite?, BadTensor) per float-valued equation."""
    def bind(eqn, ins, path):
        if eqn.primitive.name in walk.CALLS:
            body, body_consts = walk.call_body(eqn)
            return _walk(body, body_consts, ins, paths, path, found)
        outs = walk.bind_eqn(eqn, ins)
        for out in outs:
            if jnp.issubdtype(out.dtype, jnp.floating):
                found.append((jnp.all(jnp.isfinite(out)), BadTensor(path, eqn.primitive.name, tuple(out.shape))))
        return outs

    return walk.evaluate(jaxpr, consts, args, bind, module_paths=paths, outer=outer)


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
