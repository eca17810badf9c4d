"""Mixed precision: the compute policy of a Plan, and fp16's dynamic loss scale.

    fp32   everything in float32.
    bf16   matrix multiplications and convolutions run in bfloat16, forward and backward
           (operands and product; the backend accumulates in float32), as under torch.autocast;
           elementwise ops, norms, softmax and the loss see float32 (the products are cast
           back); gradients cross the wire in bfloat16 (explicit lowering).
           Parameters and optimizer state (the master copy) stay float32.
    fp16   as bf16 with float16, plus a dynamic loss scale: the loss is multiplied by the
           scale before differentiation and the gradients divided by it; a step whose
           gradients are not finite is skipped (parameters, optimizer state and buffers kept),
           the scale is halved; after `growth_interval` good steps in a row it doubles. The
           scale and the good-step count live in TrainState.loss_scale (checkpointed with it).

Per-module overrides: `fp32_modules` are fnmatch patterns over torch module paths
("*.ln*", "lm_head"); matmuls inside a matching module keep float32 operands.

The policy is applied to the traced graph (not the torch code): each matmul equation gets its
float operands cast to the compute dtype; every other equation sees the dtypes it was traced
with. So it works for any model xtrain can trace, and module paths come from the graph's name
stacks, as the lowering sees them.
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np


class Compute(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


_DTYPES = {Compute.FP32: jnp.float32, Compute.BF16: jnp.bfloat16, Compute.FP16: jnp.float16}
_WIRE = {Compute.FP32: None, Compute.BF16: "bfloat16", Compute.FP16: "float16"}
# primitives whose operands the policy narrows (the FLOPs); the rest keep their traced dtypes
_MATMULS = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScale:
    """fp16's dynamic loss scale (torch.amp.GradScaler's rule).

    Attributes:
        initial: the scale of the first step.
        growth_interval: consecutive finite steps after which the scale is multiplied by `factor`.
        factor: growth on `growth_interval` good steps; the scale is divided by it on overflow.
    """

    initial: float = 2.0 ** 15
    growth_interval: int = 2000
    factor: float = 2.0

    def __post_init__(self):
        if not self.initial > 0:
            raise ValueError(f"LossScale.initial={self.initial!r} must be positive")
        if self.growth_interval < 1:
            raise ValueError(f"LossScale.growth_interval={self.growth_interval!r} must be >= 1")
        if not self.factor > 1:
            raise ValueError(f"LossScale.factor={self.factor!r} must be > 1 (2.0 halves on overflow)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """The precision policy of a Plan (`Plan(precision="bf16")` is shorthand).

    Attributes:
        compute: "fp32", "bf16" or "fp16" (see the module docstring).
        fp32_modules: fnmatch patterns over module paths whose matmuls stay float32.
        loss_scale: fp16's dynamic loss scale (default LossScale()); must be None otherwise.
    """

    compute: Compute | str = Compute.FP32
    fp32_modules: tuple[str, ...] = ()
    loss_scale: LossScale | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "compute", Compute(self.compute))
        except ValueError:
            raise ValueError(f"Precision.compute={self.compute!r} must be one of "
                             f"{[c.value for c in Compute]}") from None
        if isinstance(self.fp32_modules, str):
            object.__setattr__(self, "fp32_modules", (self.fp32_modules,))
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
        if self.compute is Compute.FP16 and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScale())
        if self.compute is not Compute.FP16 and self.loss_scale is not None:
            raise ValueError(f"Precision.loss_scale={self.loss_scale!r} is only used with compute='fp16', "
                             f"not {self.compute.value!r}")

    @classmethod
    def of(cls, value: "Precision | str") -> "Precision":
        return value if isinstance(value, Precision) else cls(compute=value)

    @property
    def dtype(self):
        return _DTYPES[self.compute]

    @property
    def wire_dtype(self) -> str | None:
        """Gradient-sync dtype this policy implies (GradSync.comm_dtype)."""
        return _WIRE[self.compute]

    def keeps_fp32(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, p) for p in self.fp32_modules)


# -- the policy on the traced graph ----------------------------------------------------------
def _cast(x, dtype):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
        return x.astype(dtype)
    return x


def _eval(jaxpr, consts, args, policy: Precision, paths: frozenset, outer: str) -> list:
    """Evaluates `jaxpr`, narrowing matmul operands; nested jit calls are inlined so their
    matmuls are seen too. Name stacks are kept (module paths survive for the lowering)."""
    from jax._src import source_info_util

    from xtrain.frontend.graph import module_path  # lazily: the front ends import torch

    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]
    for eqn in jaxpr.eqns:
        path = module_path(eqn, paths, outer)
        ins = [read(v) for v in eqn.invars]
        stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
        with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack):
            outs = _bind(eqn, ins, policy, paths, path)
        env.update((v, o) for v, o in zip(eqn.outvars, outs) if not isinstance(v, jax.extend.core.DropVar))
    return [_cast(read(v), v.aval.dtype) for v in jaxpr.outvars]


def _bind(eqn, ins, policy: Precision, paths: frozenset, path: str) -> list:
    name = eqn.primitive.name
    if name in ("pjit", "jit", "closed_call"):
        closed = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
        ins = [_cast(x, v.aval.dtype) for x, v in zip(ins, closed.jaxpr.invars)]
        return _eval(closed.jaxpr, closed.consts, ins, policy, paths, path)
    params = eqn.primitive.get_bind_params(eqn.params)
    if name in _MATMULS and not policy.keeps_fp32(path):
        # the product in the compute dtype too (its consumers cast it back): then the
        # backward matmuls, fed its cotangent, also run in the compute dtype
        ins = [_cast(x, policy.dtype) for x in ins]
        params = {**params, "preferred_element_type": policy.dtype}
    else:
        ins = [_cast(x, v.aval.dtype) for x, v in zip(ins, eqn.invars)]
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **params)
    return out if eqn.primitive.multiple_results else [out]


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


# -- the dynamic loss scale -----------------------------------------------------------------
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
