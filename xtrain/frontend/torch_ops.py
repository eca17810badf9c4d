"""Lowerings xtrain adds to, or fixes in, torchax's op table.

torchax 0.0.14's batch norm computes new running statistics but never writes them back,
and uses the biased variance where torch keeps the unbiased one. The override below runs
as torch code under torchax (so it is traced to JAX like any other op) and updates the
running buffers in place, as eager torch does.
"""
from __future__ import annotations

import jax.numpy as jnp
import torch
import torchax
from torchax.ops import ops_registry

aten = torch.ops.aten


def _batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps):
    dims = [0] + list(range(2, input.ndim))
    shape = [1, -1] + [1] * (input.ndim - 2)
    if training or running_mean is None:
        mean = input.mean(dims)
        centered = input - mean.reshape(shape)
        var = (centered * centered).mean(dims)
        if training and running_mean is not None:
            count = input.numel() // input.shape[1]
            running_mean.mul_(1 - momentum).add_(mean * momentum)
            running_var.mul_(1 - momentum).add_(var * (momentum * count / max(count - 1, 1)))
    else:
        mean, var = running_mean, running_var
    invstd = torch.rsqrt(var + eps)
    out = (input - mean.reshape(shape)) * invstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean, invstd


def _legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)


def _legit_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm(input, weight, bias, None, None, training, momentum, eps)


def _gather(input, dim, index):
    """torch.gather as jnp.take_along_axis: a gather whose batch correspondence is explicit
    in its dimension numbers (operand_batching_dims), where torchax's lowering builds global
    row indices from an iota. The explicit lowering can then gather on each device's shard
    (e.g. cross-entropy's pick of the target logit) instead of gathering the whole operand."""
    if input.ndim == 0:
        return jnp.broadcast_to(input, index.shape)
    dim = dim % input.ndim
    # torch allows index to be smaller than input in the other dims: cut input to match
    input = input[tuple(slice(0, n) if d != dim else slice(None) for d, n in enumerate(index.shape))]
    return jnp.take_along_axis(input, index, axis=dim, mode="clip")


def _matmul(x, y):
    """torch.matmul as one batched dot_general. torch decomposes a 4-D matmul (attention's
    q @ k^T over batch and heads) into reshapes to 3-D and bmm; merging the batch and head
    dims would force a gather of heads split for tensor parallelism."""
    return jnp.matmul(x, y)


_JAX_OVERRIDES = {
    aten.gather.default: _gather,
    # torch-function level (matmul is decomposed in C++ before dispatch reaches aten)
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
}

_OVERRIDES = {
    aten.native_batch_norm.default: _batch_norm,
    aten._native_batch_norm_legit.default: _batch_norm,
    aten._native_batch_norm_legit.no_stats: _legit_no_stats,
    aten._native_batch_norm_legit_no_training.default: _legit_no_training,
}


def install(env: torchax.tensor.Environment) -> None:
    """Registers xtrain's op overrides on a torchax environment (idempotent)."""
    for op, impl in _OVERRIDES.items():
        env.override_op_definition(op, impl)
    for op, impl in _JAX_OVERRIDES.items():
        env._ops[op] = ops_registry.Operator(op, impl, is_jax_function=True, is_user_defined=True,
                                             needs_env=False, is_view_op=False)
