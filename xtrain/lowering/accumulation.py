"""Gradient accumulation: one optimizer step over K micro-batches of the global batch.

The model's loss is a mean over its batch. The step's loss and gradient are the mean over the
K micro-batches of their loss and gradient, which equals the large batch's exactly when every
micro-batch holds the same number of loss terms (tokens, examples): true for fixed-shape
batches and losses without ignored positions. A loss that skips positions (ignore_index,
padding masks) weighs micro-batches with fewer kept positions too heavily; such models should
return (loss sum, number of terms) instead of the mean (the forward or loss_fn returns a pair
of scalars): the step then divides the summed sums and gradients by the summed counts, which is
the large batch's mean whatever each micro-batch holds.
Batch statistics (BatchNorm) are those of each micro-batch, and running statistics are updated
once per micro-batch, as in a torch accumulation loop (not as in one large-batch forward).

Each device splits its local batch into K contiguous chunks; micro-batch k is chunk k of every
device. The first micro-batch runs outside the loop so the loop's carry (the gradient sum)
starts with the gradients' own types; the other K-1 run in a `lax.scan`.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.errors import InputError


def _is_array(x) -> bool:
    return hasattr(x, "ndim") and x.ndim > 0


def split(batch: tuple, steps: int) -> tuple:
    """Each batch array (b, ...) -> (steps, b / steps, ...); others unchanged."""
    return tuple(x.reshape(steps, x.shape[0] // steps, *x.shape[1:]) if _is_array(x) else x for x in batch)


def micro_shapes(batch: tuple, steps: int) -> tuple:
    """Shapes (ShapeDtypeStructs) of one micro-batch of `batch` (global or local)."""
    return tuple(jax.ShapeDtypeStruct((x.shape[0] // steps, *x.shape[1:]), x.dtype) if _is_array(x) else x
                 for x in batch)


def _pick(micro: tuple, batch: tuple, index) -> tuple:
    return tuple(lax.dynamic_index_in_dim(m, index, keepdims=False) if _is_array(x) else x
                 for m, x in zip(micro, batch))


def objective(loss, scale=None):
    """The scalar to differentiate: the loss (a (sum, count) loss's sum), times fp16's loss
    scale when there is one."""
    total = loss[0] if isinstance(loss, tuple) else loss
    return total if scale is None else total * scale.astype(total.dtype)


def value_and_grad(loss_of: Callable, params, buffers, batch: tuple, steps: int, raw: frozenset = frozenset(),
                   maxed: frozenset = frozenset()):
    """Loss and gradient of `batch` from `steps` micro-batches.

    A scalar (mean) loss: the mean over micro-batches of their losses and gradients. A
    (sum, count) loss: the summed sums and gradients divided by the summed counts, exact for
    any split.

    Args:
        loss_of: (params, buffers, micro_batch, index) -> (differentiated scalar, (loss, buffers,
            counts)). The differentiated scalar is `objective(loss, scale)`; counts (a pytree of
            per-step counts, e.g. tokens per expert) are summed over the micro-batches.

        raw: names of `params` whose gradients are summed over the micro-batches, not normalised.
        maxed: names of `params` whose "gradients" are combined by elementwise max over the
            micro-batches, not normalised (delayed FP8 scaling's amaxes: xtrain.lowering.fp8).

    Returns:
        (loss, buffers after the last micro-batch, gradient, counts).
    """
    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    raw = raw | maxed
    combine = lambda a, b: {n: jnp.maximum(a[n], b[n]) if n in maxed else jax.tree.map(jnp.add, a[n], b[n])
                            for n in a}
    if steps == 1:
        (_, (loss, buffers, counts)), grads = grad_fn(params, buffers, batch, 0)
        loss, grads = _normalised(loss, grads, 1, raw)
        return loss, buffers, grads, counts
    micro = split(batch, steps)
    (_, (loss, buffers, counts)), grads = grad_fn(params, buffers, _pick(micro, batch, 0), 0)

    def body(carry, index):
        loss_sum, buffers, grad_sum, count_sum = carry
        (_, (loss, buffers, counts)), grads = grad_fn(params, buffers, _pick(micro, batch, index), index)
        return (jax.tree.map(jnp.add, loss_sum, loss), buffers, combine(grad_sum, grads),
                jax.tree.map(jnp.add, count_sum, counts)), None

    (loss, buffers, grads, counts), _ = lax.scan(body, (loss, buffers, grads, counts), jnp.arange(1, steps))
    loss, grads = _normalised(loss, grads, steps, raw)
    return loss, buffers, grads, counts


def _normalised(loss, grads, steps: int, raw: frozenset = frozenset()):
    """(mean loss, mean gradient) from summed micro-batch results (`raw` gradients as summed)."""
    if isinstance(loss, tuple):
        total, count = loss
        count = count.astype(jnp.float32)
        return total / count, _divided(grads, count, raw)
    if steps == 1:
        return loss, grads
    return loss / steps, _divided(grads, steps, raw)


def _divided(grads, by, raw: frozenset):
    divide = lambda g: (g / by).astype(g.dtype)
    if not raw:
        return jax.tree.map(divide, grads)
    return {n: g if n in raw else jax.tree.map(divide, g) for n, g in grads.items()}


def check_divisible(batch: tuple, steps: int, data_size: int) -> None:
    """Every batch array's leading dimension splits into `steps` micro-batches per device."""
    for index, x in enumerate(batch):
        if steps > 1 and _is_array(x) and x.shape[0] % (steps * data_size):
            raise InputError(
                f"batch argument {index} has shape {tuple(x.shape)}: global batch {x.shape[0]} does not split into "
                f"accumulate={steps} micro-batches on each of {data_size} data-parallel devices; use a global "
                f"batch that is a multiple of {steps * data_size}")
