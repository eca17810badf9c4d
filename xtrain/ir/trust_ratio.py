"""Layer-wise trust ratios (LARS, LAMB) as an optax transformation whose norms the step supplies.

LARS (You, Gitman, Ginsburg 2017, arXiv:1708.03888) and LAMB (You et al. 2019,
arXiv:1904.00962) scale each layer's update u by

    ratio = trust_coefficient * ||w|| / (||u|| + eps)      (1 where ||w|| or ||u|| is 0)

with w the layer's whole parameter. On a mesh a device holds shards (tensor parallel, ZeRO,
FSDP), so the norms are summed across devices: the transformation computes each tensor's local
sum of squares and hands them to `sum_squares`, an extra argument of optax's update that the
training step passes (it sums them over the mesh axes each tensor is split over, with one
collective per set of axes). Without it every tensor is taken to be whole on this device
(one device, or XLA's global view).

A stacked block parameter (name `blocks.*.w`, shape (L, ...): row k is layer k) gets one
ratio per row, as torch has one parameter per layer; an all-zero padding row (a pipeline
stage holding fewer layers) has ratio 1 and an update of 0.

Torch-free so that the front end (which builds it for xtrain.optim.LAMB / LARS) and the lowering
(which supplies the norms) share it.
"""
from __future__ import annotations

from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import optax

from xtrain.errors import OptionsError
from xtrain.ir.stacked import is_stacked

SUM_SQUARES = "sum_squares"  # the keyword under which the step passes its reduction to update()
SumSquares = Callable[[Mapping[str, jax.Array]], Mapping[str, jax.Array]]


def local_sum_squares(name: str, x) -> jax.Array:
    """Sum of squares of this device's `x` in float32: one per row of a stacked parameter
    ((L,)), else a scalar."""
    x = jnp.square(x.astype(jnp.float32))
    return jnp.sum(x, axis=tuple(range(1, x.ndim))) if is_stacked(name) else jnp.sum(x)


def whole_on_this_device(partial: Mapping[str, jax.Array]) -> Mapping[str, jax.Array]:
    """The `sum_squares` of a program in which every tensor is whole."""
    return partial


def ratio(param_sq, update_sq, trust_coefficient: float, eps: float):
    """trust_coefficient * ||w|| / (||u|| + eps), 1 where either norm is 0 (0/0 included)."""
    w, u = jnp.sqrt(param_sq), jnp.sqrt(update_sq)
    safe = trust_coefficient * w / jnp.where(u + eps > 0, u + eps, 1.0)
    return jnp.where((w > 0) & (u > 0), safe, 1.0)


def _scaled(name: str, update, r):
    if is_stacked(name):
        r = r.reshape(r.shape + (1,) * (update.ndim - 1))  # (L, 1, ...): one ratio per layer
    return (update * r).astype(update.dtype)


def scale_by_trust_ratio(trust_coefficient: float = 1.0, eps: float = 0.0) -> optax.GradientTransformationExtraArgs:
    """Each parameter's update times its layer's trust ratio (module docstring).

    Args:
        trust_coefficient: eta of LARS (1 for LAMB).
        eps: added to the update norm.

    Returns:
        An optax transformation over a dict of named parameters; its update takes the extra
        argument `sum_squares` (SUM_SQUARES) from the step.
    """
    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None, **extra):
        if params is None:
            raise OptionsError(
                "the trust ratio of LARS / LAMB needs the parameters: call update(updates, state, params)")
        reduce: SumSquares = extra.get(SUM_SQUARES) or whole_on_this_device
        names = [n for n, u in updates.items() if hasattr(u, "shape")]  # others: another param group's (masked)
        partial = {n: jnp.stack([local_sum_squares(n, params[n]), local_sum_squares(n, updates[n])]) for n in names}
        whole = reduce(partial)  # name -> (2,) or (2, L): [sum w^2, sum u^2] over the whole tensor
        out = dict(updates)
        for n in names:
            out[n] = _scaled(n, updates[n], ratio(whole[n][0], whole[n][1], trust_coefficient, eps))
        return out, state

    return optax.GradientTransformationExtraArgs(init, update)
