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
from jax.extend import core as jcore

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


# ops through which a parameter stays itself for delayed scaling (its history keyed by its name)
_SAME_VALUE = frozenset({"transpose", "convert_element_type", "reshape", "copy", "copy_p", "squeeze",
                         "expand_dims", "reduce_precision"})
SUFFIX = ".amax_history"  # delayed scaling's buffer of weight W: "W.amax_history" (xtrain.lowering.fp8)


class _Histories:
    """Delayed scaling's amax histories during one evaluation: by weight name, each given to the
    first FP8 matmul that reads its weight (a weight read by several: the later ones current-scaled)."""

    def __init__(self, values: Mapping[str, Any]):
        self.values, self.used = dict(values), set()

    def take(self, names: list):
        for name in names:
            if name in self.values and name not in self.used:
                self.used.add(name)
                return self.values[name]
        return None


def _origins(jaxpr, names: list) -> dict:
    """jaxpr var -> the parameter it is (through `_SAME_VALUE` ops), from the invars' `names`."""
    out = {v: n for v, n in zip(jaxpr.invars, names) if n is not None}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _SAME_VALUE and eqn.invars and out.get(eqn.invars[0]) is not None:
            out[eqn.outvars[0]] = out[eqn.invars[0]]
    return out


def _eval(jaxpr, consts, args, policy: Precision, paths: frozenset, outer: str,
          histories: _Histories | None = None, names: list | None = None) -> list:
    """Evaluates `jaxpr`, narrowing matmul operands; nested jit calls are inlined so their
    matmuls are seen too. Name stacks are kept (module paths survive for the lowering).
    `names`: per invar, the parameter it is (delayed scaling finds the weights' histories)."""
    origins = _origins(jaxpr, names) if histories is not None and names else {}
    bind = lambda eqn, ins, path: _bind(eqn, ins, policy, paths, path, histories, origins)
    outs = walk.evaluate(jaxpr, consts, args, bind, module_paths=paths, outer=outer)
    return [_cast(x, v.aval.dtype) for x, v in zip(outs, jaxpr.outvars)]


def _bind(eqn, ins, policy: Precision, paths: frozenset, path: str, histories=None, origins=None) -> list:
    spec = markers.outermost(moe.ExpertsSpec, eqn.params.get("name", "")) if eqn.primitive.name in walk.CALLS else None
    if spec is not None:  # kept one call (the lowering partitions it whole), its matmuls narrowed
        if not policy.keeps_fp32(path):
            spec = dataclasses.replace(spec, compute=jnp.dtype(policy.dtype).name)
        return [moe.traced_call(spec)(*[_cast(x, v.aval.dtype) for x, v in zip(ins, eqn.invars)])]
    if eqn.primitive.name in walk.CALLS:
        body, consts = walk.call_body(eqn)
        names = [origins.get(v) if not isinstance(v, jcore.Literal) else None for v in eqn.invars] if origins else None
        return _eval(body, consts, [_cast(x, v.aval.dtype) for x, v in zip(ins, body.invars)], policy, paths, path,
                     histories, names)
    if eqn.primitive.name == "dot_general" and policy.fp8_matmul(path) and all(
            jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
        history = histories.take([origins.get(v) for v in eqn.invars[::-1] if not isinstance(v, jcore.Literal)]) \
            if histories is not None else None
        return fp8.dot(eqn, ins, policy.dtype, history, rowwise=policy.scaling == "rowwise")
    if eqn.primitive.name in _MATMULS and not policy.keeps_fp32(path):
        # the product in the compute dtype too (its consumers cast it back): then the
        # backward matmuls, fed its cotangent, also run in the compute dtype
        params = {**eqn.params, "preferred_element_type": policy.dtype}
        return walk.bind_eqn(eqn, [_cast(x, policy.dtype) for x in ins], params)
    return walk.bind_eqn(eqn, [_cast(x, v.aval.dtype) for x, v in zip(ins, eqn.invars)])


class MixedPrecision:
    """A Model whose `apply` follows `policy` (wraps any front end's Model). Under delayed FP8
    scaling it also holds one amax history per matrix parameter of an FP8 module (buffers named
    `<parameter>.amax_history`, (3, amax_history) float32, zeros at the start)."""

    def __init__(self, model, policy: Precision):
        self._model, self.policy = model, policy
        self.amax_histories: dict[str, str] = {}  # buffer name -> its weight's name
        if policy.delayed:
            self.amax_histories = {n + SUFFIX: n for n, s in model.param_shapes().items()
                                   if len(s.shape) >= 2 and jnp.issubdtype(s.dtype, jnp.floating)
                                   and policy.fp8_matmul(n.rpartition(".")[0])}

    def __getattr__(self, name):  # everything else is the wrapped model's
        return getattr(self._model, name)

    def _history_shape(self):
        return jax.ShapeDtypeStruct((3, self.policy.amax_history), np.float32)

    def initial_buffers(self, stored=None) -> dict:
        stored = None if stored is None else dict(stored)
        kept = {n: stored.pop(n) for n in self.amax_histories if stored and n in stored}
        fresh = {n: np.zeros((3, self.policy.amax_history), np.float32) for n in self.amax_histories}
        return {**self._model.initial_buffers(stored), **fresh, **kept}

    def buffer_names(self) -> list[str]:
        return self._model.buffer_names() + list(self.amax_histories)

    def buffer_shapes(self) -> dict:
        return {**self._model.buffer_shapes(), **{n: self._history_shape() for n in self.amax_histories}}

    def export_state(self, params, buffers) -> dict:
        return self._model.export_state(params, {n: b for n, b in buffers.items() if n not in self.amax_histories})

    def apply(self, params, buffers, key, batch, *, training: bool):
        """The wrapped model's apply under the policy; delayed scaling's histories may come in
        `params` (differentiated: their cotangents are the step's amaxes) or in `buffers`."""
        found = {n: v for n, v in {**buffers, **params}.items() if n in self.amax_histories}
        params = {n: v for n, v in params.items() if n not in self.amax_histories}
        buffers = {n: v for n, v in buffers.items() if n not in self.amax_histories}
        fn = lambda *a: self._model.apply(*a, training=training)
        args = (params, buffers, key, batch)
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        histories = _Histories({self.amax_histories[n]: v for n, v in found.items()}) if found else None
        names = sorted(params) + [None] * (len(closed.jaxpr.invars) - len(params))
        outs = _eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), self.policy,
                     self._model.module_paths(), "", histories, names)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def apply_policy(model, policy: Precision):
    """`model` itself under fp32, else wrapped so its matmuls follow the policy."""
    return model if policy.compute is Compute.FP32 else MixedPrecision(model, policy)


def histories_of(model) -> dict[str, str]:
    """Delayed FP8 scaling's amax history buffers of `model` (a step's stored model): buffer name
    -> its weight's name; empty otherwise."""
    return dict(getattr(model, "amax_histories", None) or {})


def split_histories(buffers: Mapping[str, Any], histories) -> tuple[dict, dict]:
    """(the amax histories among `buffers`, the other buffers): the strategies pass the histories
    with the parameters (differentiated: their cotangents are the step's amaxes)."""
    return ({n: b for n, b in buffers.items() if n in histories},
            {n: b for n, b in buffers.items() if n not in histories})


def recorded(old: Mapping[str, Any], amaxes: Mapping[str, Any]) -> dict:
    """The histories after a step: this step's amaxes (3,) of each (its cotangent's column 0,
    combined over micro-batches and devices by max) rolled into its history in `old`, newest first."""
    return {n: fp8.recorded(old[n], a) for n, a in amaxes.items()}


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
