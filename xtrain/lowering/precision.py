"""Mixed precision in the lowering: the plan's precision policy (xtrain.sharding.precision)
applied to the traced graph, and fp16's loss-scale state.

The policy is applied to the traced graph (not the torch code): each matmul equation gets its
float operands cast to the compute dtype; every other equation sees the dtypes it was traced
with. So it works for any model xtrain can trace, and module paths come from the graph's name
stacks, as the lowering sees them.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from xtrain.ir import markers, walk
from xtrain.ir.kernels import moe
from xtrain.lowering import fp8
from xtrain.sharding.precision import Compute, LossScale, Precision

# primitives whose operands the policy narrows (the FLOPs); the rest keep their traced dtypes
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


def _cast(x, dtype):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        return x.astype(dtype)
    return x


def _eval(jaxpr, consts, args, policy: Precision, paths: frozenset, outer: str) -> list:
    """Evaluates `jaxpr`, narrowing matmul operands; nested jit calls are inlined so their
    matmuls are seen too. Name stacks are kept (module paths survive for the lowering)."""
    bind = lambda eqn, ins, path: _bind(eqn, ins, policy, paths, path)
    outs = walk.evaluate(jaxpr, consts, args, bind, module_paths=paths, outer=outer)
    return [_cast(x, v.aval.dtype) for x, v in zip(outs, jaxpr.outvars)]


def _bind(eqn, ins, policy: Precision, paths: frozenset, path: str) -> list:
    spec = markers.outermost(moe.ExpertsSpec, eqn.params.get("name", "")) if eqn.primitive.name in walk.CALLS else None
    if spec is not None:  # kept one call (the lowering partitions it whole), its matmuls narrowed
        if not policy.keeps_fp32(path):
            spec = dataclasses.replace(spec, compute=jnp.dtype(policy.dtype).name)
        return [moe.traced_call(spec)(*[_cast(x, v.aval.dtype) for x, v in zip(ins, eqn.invars)])]
    if eqn.primitive.name in walk.CALLS:
        body, consts = walk.call_body(eqn)
        return _eval(body, consts, [_cast(x, v.aval.dtype) for x, v in zip(ins, body.invars)], policy, paths, path)
    if eqn.primitive.name == "dot_general" and policy.fp8_matmul(path) and all(
            jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
        return fp8.dot(walk.bind_eqn, eqn, ins, policy.dtype)
    if eqn.primitive.name in _MATMULS and not policy.keeps_fp32(path):
        # the product in the compute dtype too (its consumers cast it back): then the
        # backward matmuls, fed its cotangent, also run in the compute dtype
        params = {**eqn.params, "preferred_element_type": policy.dtype}
        return walk.bind_eqn(eqn, [_cast(x, policy.dtype) for x in ins], params)
    return walk.bind_eqn(eqn, [_cast(x, v.aval.dtype) for x, v in zip(ins, eqn.invars)])


class MixedPrecision:
    """A Model whose `apply` follows `policy` (wraps any front end's Model)."""

    def __init__(self, model, policy: Precision):
        self._model, self.policy = model, policy

    def __getattr__(self, name):  # everything but `apply` is the wrapped model's
        return getattr(self._model, name)

    def apply(self, params, buffers, key, batch, *, training: bool):
        fn = lambda *a: self._model.apply(*a, training=training)
        args = (params, buffers, key, batch)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), self.policy,
                     self._model.module_paths(), "")
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def apply_policy(model, policy: Precision):
    """`model` itself under fp32, else wrapped so its matmuls follow the policy."""
    return model if policy.compute is Compute.FP32 else MixedPrecision(model, policy)


# -- fp16's dynamic loss scale ---------------------------------------------------------------
def initial_state(policy: Precision) -> dict[str, np.ndarray] | None:
    """TrainState.loss_scale of a fresh run: {"scale", "good_steps"} under fp16, else None."""
    if policy.loss_scale is None:
        return None
    return {"scale": np.float32(policy.loss_scale.initial), "good_steps": np.int32(0)}


def next_state(state: Mapping[str, Any], finite, config: LossScale) -> dict:
    """Halve (÷ factor) on a non-finite step; grow (× factor) after `growth_interval` good ones."""
    good = state["good_steps"] + 1
    grow = good >= config.growth_interval
    scale = jnp.where(finite, jnp.where(grow, state["scale"] * config.factor, state["scale"]),
                      state["scale"] / config.factor)
    return {"scale": scale.astype(jnp.float32),
            "good_steps": jnp.where(finite & ~grow, good, 0).astype(jnp.int32)}


def keep_if(ok, new, old):
    """`new` where `ok` (a scalar bool), else `old`: leaf by leaf over matching pytrees."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
