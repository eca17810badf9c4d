"""Lowerings xtrain adds to, or fixes in, torchax's op table.

GELU, SiLU, softmax, layer norm and RMS norm get derivative rules of their own
(`jax.custom_jvp`), as torch's autograd has: the backward keeps one full-size residual per op
(GELU's and SiLU's slope, softmax's output, the norms' normalized input) and computes the
gradient in one pass. HF writes its RMSNorm modules as separate torch ops, so modules whose
forward is exactly HF Llama's RMSNorm (the same bytecode: Llama, Mistral, Qwen2/3, Phi-3, ...)
are traced through F.rms_norm instead (`module_rules`), which gets the rule. Under JAX's own
autodiff of the forward formula, every intermediate of erf / the normalisation becomes a saved
residual; inside the layer scan each residual is a stacked (L, ...) buffer written in the
forward loop and read in the backward loop, which on XLA:CPU cost more than the matmuls around
them.
Scaled dot-product attention is xtrain.frontend.sdpa's (blockwise, or cuDNN's on CUDA).

torchax 0.0.14's batch norm computes new running statistics but never writes them back,
and uses the biased variance where torch keeps the unbiased one. The override below runs
as torch code under torchax (so it is traced to JAX like any other op) and updates the
running buffers in place, as eager torch does.
"""
from __future__ import annotations

import contextlib
import functools
import math
import sys

import jax
import jax.numpy as jnp
from jax import lax
import torch
import torchax
from torchax.decompositions import DECOMPOSITIONS
from torchax.ops import jaten, mappings, ops_registry
from torchax.view import View

from xtrain.errors import UnsupportedOpError
from xtrain.frontend import eager_attention, sdpa
from xtrain.ir import index_ops, markers

aten = torch.ops.aten
_NLL_DECOMPOSITION = DECOMPOSITIONS[aten.nll_loss_forward.default]
_TORCHAX_COPY = ops_registry.all_aten_ops[aten.copy_].func


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


def _copy_(x, y, memory_format=None, env=None):
    """aten.copy_ whose source may be a view (torchax's reads `y._elem`, which a View lacks: HF's
    Mamba/Jamba cache writes a slice of the hidden states into its conv state)."""
    return _TORCHAX_COPY(x, y.torch() if isinstance(y, View) else y, memory_format, env=env)


def _legit_no_training(input, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(input, weight, bias, running_mean, running_var, False, momentum, eps)


def _legit_no_stats(input, weight, bias, training, momentum, eps):
    return _batch_norm(input, weight, bias, None, None, training, momentum, eps)


@contextlib.contextmanager
def _indexing(name: str, index):
    """Traces an index op under its torch rule's marker (xtrain.ir.index_ops); yields the index,
    cast to int32 if it came as floats (refused by the lowering, naming the batch argument)."""
    is_float = jnp.issubdtype(index.dtype, jnp.inexact)
    with jax.named_scope(markers.name(index_ops.IndexOp(name, negatives=False, float_index=is_float))):
        yield index.astype(jnp.int32) if is_float else index


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
    with _indexing("torch.gather", index) as index:
        return jnp.take_along_axis(input, index, axis=dim, mode="clip")


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """aten.embedding (torchax's lowering) under its torch rule: no negative indices."""
    with _indexing("embedding", indices) as indices:
        return jaten._aten_embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)


def _nll_loss_forward(*args):
    """nll_loss (cross_entropy's) as torchax decomposes it, under its torch rule: targets in
    [0, classes) or the ignore index."""
    with jax.named_scope(markers.name(index_ops.IndexOp("cross_entropy/nll_loss target"))):
        return _NLL_DECOMPOSITION(*args)


def _matmul(x, y):
    """torch.matmul as one batched dot_general. torch decomposes a 4-D matmul (attention's
    q @ k^T over batch and heads) into reshapes to 3-D and bmm; merging the batch and head
    dims would force a gather of heads split for tensor parallelism. HF's eager attention
    (softmax(q @ k^T ...) @ v) is computed by the blockwise kernel (xtrain.frontend.eager_attention)."""
    return eager_attention.matmul(x, y)


def _view_as_real(x):
    """aten.view_as_real: (re, im) in a trailing dimension, as one concatenate of the two parts
    (torchax's jnp.stack emits `stack`, which the explicit lowering gathers). Complex RoPE ends in it."""
    return jnp.concatenate([jnp.real(x)[..., None], jnp.imag(x)[..., None]], axis=-1)


_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_K = math.sqrt(2.0 / math.pi)  # GELU's tanh approximation: tanh(k (x + c x^3))
_TANH_C = 0.044715


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _gelu_core(x, tanh: bool):
    if tanh:
        return 0.5 * x * (1.0 + jnp.tanh(_TANH_K * (x + _TANH_C * x * x * x)))
    return 0.5 * x * (1.0 + lax.erf(x * _SQRT_HALF))  # torch's formula (exact GELU)


@_gelu_core.defjvp
def _gelu_jvp(tanh, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    if tanh:
        t = jnp.tanh(_TANH_K * (x + _TANH_C * x * x * x))
        y = 0.5 * x * (1.0 + t)
        slope = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _TANH_K * (1.0 + 3.0 * _TANH_C * x * x)
    else:  # d/dx x Phi(x) = Phi(x) + x phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2
        one_plus_erf = 1.0 + lax.erf(x * _SQRT_HALF)
        y = 0.5 * x * one_plus_erf  # as the primal computes it
        slope = 0.5 * one_plus_erf + x * _INV_SQRT_2PI * jnp.exp(-0.5 * x * x)
    return y, slope * x_dot


def _gelu(x, *, approximate="none"):
    """aten.gelu whose backward keeps one residual (the slope) and is one multiply."""
    if approximate not in ("none", "tanh"):
        raise UnsupportedOpError(f"aten.gelu: approximate={approximate!r} is not 'none' or 'tanh'")
    return _gelu_core(x, approximate == "tanh")


@jax.custom_jvp
def _silu(x):
    """aten.silu, x * sigmoid(x), whose backward keeps one residual (the slope)."""
    return x * jax.nn.sigmoid(x)


@_silu.defjvp
def _silu_jvp(primals, tangents):
    (x,), (x_dot,) = primals, tangents
    s = jax.nn.sigmoid(x)
    return x * s, s * (1.0 + x * (1.0 - s)) * x_dot


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax_core(x, axis: int):
    shifted = x - lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    unnormalized = jnp.exp(shifted)
    return unnormalized / jnp.sum(unnormalized, axis=axis, keepdims=True)


@_softmax_core.defjvp
def _softmax_jvp(axis, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    y = _softmax_core(x, axis)
    return y, y * (x_dot - jnp.sum(y * x_dot, axis=axis, keepdims=True))


def _softmax(x, dim, half_to_float=False):
    """aten._softmax, whose backward keeps only the output, as torch's does.
    (jax.nn.softmax, which torchax calls, differentiates the formula unless the global
    jax_softmax_custom_jvp flag is set: it keeps the exponentials beside the output, a second
    attention-sized residual per layer.)"""
    if x.ndim == 0:
        return jnp.ones_like(x)
    if half_to_float and x.dtype in (jnp.float16, jnp.bfloat16):
        x = x.astype(jnp.float32)
    return _softmax_core(x, dim % x.ndim)


def _softmax_int(x, dim, dtype=None):
    """aten.softmax.int: softmax in `dtype` when given (torch casts the input first)."""
    if dtype is not None:
        x = x.astype(mappings.t2j_dtype(dtype))
    return _softmax(x, dim)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _normalize(x, k: int, eps: float):
    """(x - mean) / std over the last k dims -> (normalized, mean, 1/std), stats keeping dims."""
    axes = tuple(range(x.ndim - k, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    rstd = lax.rsqrt(jnp.mean(centered * centered, axis=axes, keepdims=True) + eps)
    return centered * rstd, mean, rstd


@_normalize.defjvp
def _normalize_jvp(k, eps, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    xhat, mean, rstd = _normalize(x, k, eps)
    axes = tuple(range(x.ndim - k, x.ndim))
    mean_dot = jnp.mean(x_dot, axis=axes, keepdims=True)
    proj = jnp.mean(x_dot * xhat, axis=axes, keepdims=True)
    return (xhat, mean, rstd), (rstd * (x_dot - mean_dot - xhat * proj), mean_dot, -rstd * rstd * proj)


def _native_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """aten.native_layer_norm -> (out, mean, 1/std), the statistics kept with size-1 dims.
    The normalisation's derivative rule is written out, so the backward keeps the normalized
    x and 1/std (torch keeps x, mean and 1/std) and reads them in one pass."""
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    out, mean, rstd = _normalize(input, k, float(eps))
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


def _native_group_norm(input, weight, bias, N, C, HxW, group, eps=1e-5):
    """aten.native_group_norm -> (out, mean, 1/std) with statistics of shape (N, group). Each sample's
    groups are normalized as (N, group, C / group * HxW): the batch dimension stays a dimension
    of its own (torchax merges it with the groups into one, which a batch split cannot follow,
    so under data parallel the activations were gathered)."""
    grouped = input.reshape(input.shape[0], group, -1)  # (N, G, C/G * HxW)
    out, mean, rstd = _normalize(grouped, 1, float(eps))
    affine = [-1 if d == 1 else 1 for d in range(input.ndim)]
    out = out.reshape(input.shape)
    if weight is not None:
        out = out * weight.reshape(affine)
    if bias is not None:
        out = out + bias.reshape(affine)
    return out, mean.reshape(input.shape[0], group), rstd.reshape(input.shape[0], group)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _rms_normalize(x, k: int, eps: float):
    """x / sqrt(mean(x^2) + eps) over the last k dims."""
    axes = tuple(range(x.ndim - k, x.ndim))
    return x * lax.rsqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)


@_rms_normalize.defjvp
def _rms_normalize_jvp(k, eps, primals, tangents):
    (x,), (x_dot,) = primals, tangents
    axes = tuple(range(x.ndim - k, x.ndim))
    rstd = lax.rsqrt(jnp.mean(x * x, axis=axes, keepdims=True) + eps)
    xhat = x * rstd
    return xhat, rstd * (x_dot - xhat * jnp.mean(x_dot * xhat, axis=axes, keepdims=True))


def _rms_norm(input, normalized_shape, weight=None, eps=None):
    """F.rms_norm as torch computes it: in float32 for 16-bit inputs (eps defaulting to
    float32's), the weight applied before the cast back. The backward keeps the normalized
    input and 1/rms, not the input as well."""
    k = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    compute = jnp.float32 if input.dtype in (jnp.bfloat16, jnp.float16) else input.dtype
    eps = float(jnp.finfo(compute).eps) if eps is None else float(eps)
    out = _rms_normalize(input.astype(compute), k, eps)
    if weight is not None:
        out = out * weight.astype(compute)
    return out.astype(input.dtype)


def _code(fn) -> tuple | None:
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_code, code.co_consts, code.co_names, code.co_varnames)


def _hf_rms_norm_code() -> tuple | None:
    """The bytecode of HF Llama's RMSNorm.forward, if transformers is in use."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.models.llama import modeling_llama
    except ImportError:
        return None
    return _code(modeling_llama.LlamaRMSNorm.forward)


def _hf_rms_norm_forward(module, hidden_states):
    """HF's RMSNorm (normalize in float32, cast back, then scale) through F.rms_norm."""
    dtype = hidden_states.dtype
    normalized = torch.nn.functional.rms_norm(hidden_states.to(torch.float32), (hidden_states.shape[-1],),
                                              None, module.variance_epsilon)
    return module.weight * normalized.to(dtype)


@contextlib.contextmanager
def module_rules(root: torch.nn.Module):
    """While tracing, modules whose forward is HF Llama's RMSNorm, to the bytecode, run
    `_hf_rms_norm_forward` (same arithmetic, one op with a derivative rule). Modules with a
    forward of their own (an instance attribute: hooks, adapters) are left alone."""
    reference = _hf_rms_norm_code()
    with patched_forwards(root, lambda m: functools.partial(_hf_rms_norm_forward, m)
                          if reference is not None and _code(type(m).forward) == reference else None) as patched:
        yield patched


@contextlib.contextmanager
def patched_forwards(root: torch.nn.Module, replacement):
    """While inside, each module of `root` without a forward of its own (an instance attribute:
    hooks, adapters) for which `replacement(module)` gives a callable runs that callable; the
    patches are undone on exit. Yields the patched modules."""
    patched = []
    for module in root.modules():
        forward = replacement(module) if "forward" not in vars(module) else None
        if forward is not None:
            module.forward = forward
            patched.append(module)
    try:
        yield patched
    finally:
        for module in patched:
            del module.forward


_JAX_OVERRIDES = {
    aten.gelu.default: _gelu,
    aten.silu.default: _silu,
    aten._softmax.default: _softmax,
    aten.softmax.int: _softmax_int,
    aten.native_layer_norm.default: _native_layer_norm,
    aten.native_group_norm.default: _native_group_norm,
    aten.gather.default: _gather,
    aten.embedding.default: _embedding,
    aten.view_as_real.default: _view_as_real,
    # torch-function level (matmul is decomposed in C++ before dispatch reaches aten)
    torch.nn.functional.rms_norm: _rms_norm,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
}

_JAX_ENV_OVERRIDES = {  # jax functions that draw random keys from the environment
    torch.nn.functional.scaled_dot_product_attention: sdpa.sdpa,
    aten.scaled_dot_product_attention.default: sdpa.sdpa,
}

_OVERRIDES = {
    aten.nll_loss_forward.default: _nll_loss_forward,
    aten.native_batch_norm.default: _batch_norm,
    aten._native_batch_norm_legit.default: _batch_norm,
    aten._native_batch_norm_legit.no_stats: _legit_no_stats,
    aten._native_batch_norm_legit_no_training.default: _legit_no_training,
}


def install(env: torchax.tensor.Environment) -> None:
    """Registers xtrain's op overrides on a torchax environment (idempotent)."""
    for op, impl in _OVERRIDES.items():
        env.override_op_definition(op, impl)
    env._ops[aten.copy_] = ops_registry.Operator(aten.copy_, _copy_, is_jax_function=False, is_user_defined=True,
                                                 needs_env=True, is_view_op=True)  # in-place, on views too
    for table, needs_env in ((_JAX_OVERRIDES, False), (_JAX_ENV_OVERRIDES, True)):
        for op, impl in table.items():
            env._ops[op] = ops_registry.Operator(op, impl, is_jax_function=True, is_user_defined=True,
                                                 needs_env=needs_env, is_view_op=False)
