"""Branches on a per-device value inside shard_map (CPU and GPU; Trainium runs no conditionals):
what the zero-bubble executor and its stages branch with."""
from __future__ import annotations

import jax
from jax import lax
from jax._src.interpreters import partial_eval as pe

from xtrain.ir.vma import of_aval as varying, widen  # noqa: F401 (varying: the executors' import)


def switch(index, branches: list, *operands):
    """lax.switch whose branches may return values varying over different mesh axes: each
    branch is traced once and its outputs widened to the union of the branches' axes."""
    traced = [jax.make_jaxpr(b, return_shape=True)(*operands) for b in branches]
    tree = jax.tree.structure(traced[0][1])
    target = [frozenset().union(*(varying(c.out_avals[k]) for c, _ in traced))
              for k in range(len(traced[0][0].out_avals))]

    def widened(closed):
        run = evaluator(closed, [True] * len(closed.out_avals))  # dead code out (the unused half of a pullback)

        def branch(*ops):
            return jax.tree.unflatten(tree, [widen(o, t) for o, t in zip(run(*jax.tree.leaves(ops)), target)])
        return branch

    return lax.switch(index, [widened(c) for c, _ in traced], *operands)


def evaluator(closed, used: list[bool]):
    """f(*invars) -> the outvars of `closed` marked `used`, with the rest of the jaxpr removed."""
    jaxpr, used_in = pe.dce_jaxpr(closed.jaxpr, used, instantiate=True)
    return lambda *ins: jax.core.eval_jaxpr(jaxpr, closed.consts, *[x for x, u in zip(ins, used_in) if u])
