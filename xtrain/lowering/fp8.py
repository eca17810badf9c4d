"""FP8 matrix multiplications of `Precision(compute="fp8")`: each matmul's operands quantized to
float8_e4m3fn and its output's gradient to float8_e5m2, with per-tensor current scaling.

A matmul `x @ w` of the traced graph becomes

    y = dot(q(x), q(w)) * s(x) * s(w)    (FP8 operands, float32 accumulation, y in bf16)

where s(t) = amax(|t|) / (the format's largest finite value), computed from the whole tensor in
this step (current scaling), and q(t) = convert(clip(t / s(t)), float8_e4m3fn). The backward's
two matmuls are FP8 too: the cotangent quantized to float8_e5m2 with its own scale, times the
saved e4m3 operands (which is all the backward keeps: a quarter of float32's bytes, saved as
their bytes, uint8, which jax.checkpoint passes unchanged). Gradients
pass the quantization unchanged (straight through).

The dots take the FP8 tensors themselves, not "convert back to bf16, then dot": with XLA's
default excess precision its GPU compiler drops such a round trip (f32 -> f8 -> bf16) as
redundant, and the matmul would silently run in bf16 (found compiling for H100 here). An FP8
dot is what XLA's GPU compiler turns into an FP8 GEMM on Hopper; XLA:CPU computes it by
upcasting, so every number is checkable on CPU.

A tensor split over mesh axes gets one scale: its amax is a reduction over the whole tensor,
which the lowering max-reduces over the axes it is split on, as it does any reduction.

Sources: NVIDIA Transformer Engine's FP8 primer (E4M3 forward, E5M2 gradients, per-tensor
scaling); JAX's and XLA's FP8 GEMM pattern (openxla/xla gemm_rewriter, "FP8 GEMM" patterns).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn  # activations and weights: 3 mantissa bits, largest 448
E5M2 = jnp.float8_e5m2    # gradients: the range of fp16, largest 57344


def largest(dtype) -> float:
    """The largest finite value of an FP8 format."""
    return float(jnp.finfo(dtype).max)


def scale_of(x, dtype):
    """Current per-tensor scaling: amax(|x|) over the largest finite value of `dtype`, so that
    x / scale spans the format; 1 for an all-zero tensor. float32 scalar."""
    return scale_from_amax(jnp.max(jnp.abs(x.astype(jnp.float32))), dtype)


def scale_from_amax(amax, dtype):
    """The scale(s) of tensors whose amax is `amax` (float32, any shape): see `scale_of`."""
    return jnp.where(amax > 0, amax / np.float32(largest(dtype)), np.float32(1.0))


def quantize(x, dtype, scale):
    """x / scale rounded to the FP8 `dtype` (clipped to its largest value: e4m3fn has no inf)."""
    bound = np.float32(largest(dtype))
    return jnp.clip(x.astype(jnp.float32) / scale, -bound, bound).astype(dtype)


def dequantize(q, scale, dtype):
    """An FP8 tensor back in `dtype`: convert, then multiply by the scale (XLA's FP8 GEMM pattern)."""
    return q.astype(dtype) * scale.astype(dtype)


def quantize_dequantize(x, fp8, dtype):
    """`x` through `fp8` with its current scale, returned in `dtype`."""
    scale = jax.lax.stop_gradient(scale_of(x, fp8))
    return dequantize(quantize(x, fp8, scale), scale, dtype)


def _cotangent(g, other, ndim: int, dimension_numbers, swap: bool):
    """The cotangent of the operand (of rank `ndim`) multiplied by `other` in a dot_general of
    `dimension_numbers` (the operand's dims first), from the output's cotangent `g`: one
    dot_general of g and `other`, accumulated in float32, transposed into the operand's dims
    (the transpose rule autodiff applies to dot_general, on FP8 tensors here). `swap`: the
    operand was the right-hand one (g's free dims list the left-hand operand's first)."""
    (contract, other_contract), (batch, other_batch) = dimension_numbers
    kept = [d for d in range(ndim) if d not in contract and d not in batch]
    other_kept = [d for d in range(other.ndim) if d not in other_contract and d not in other_batch]
    n = len(batch)
    start = n if swap else n + len(kept)
    g_other = list(range(start, start + len(other_kept)))
    out = jax.lax.dot_general(g, other, ((g_other, other_kept), (list(range(n)), list(other_batch))),
                              preferred_element_type=jnp.float32)
    unsorted = list(batch) + kept + list(np.take(contract, np.argsort(other_contract)).astype(int))
    return jnp.transpose(out, tuple(int(i) for i in np.argsort(unsorted)))


def _forward(x, w, dimension_numbers, dtype):
    sx, sw = scale_of(x, E4M3), scale_of(w, E4M3)
    qx, qw = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    y = jax.lax.dot_general(qx, qw, dimension_numbers, preferred_element_type=jnp.float32) * (sx * sw)
    # the saved operands travel as their bytes: under jax.checkpoint (remat, ZeRO-3's re-gather)
    # JAX passes a saved FP8 value through reduce_precision(4, 3), an IEEE format whose largest
    # value is 240, and e4m3fn's 256..448 would come back NaN (e4m3fn has no inf)
    saved = tuple(jax.lax.bitcast_convert_type(q, jnp.uint8) for q in (qx, qw))
    return y.astype(dtype), (*saved, sx, sw, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul(x, w, dimension_numbers, dtype):
    """dot_general(x, w) with e4m3 operands, each scaled by its amax, the product in `dtype`;
    its backward takes the e5m2 cotangent (x's and w's gradients in their own dtypes)."""
    return _forward(x, w, dimension_numbers, dtype)[0]


def _matmul_fwd(x, w, dimension_numbers, dtype):
    return _forward(x, w, dimension_numbers, dtype)


def _matmul_bwd(dimension_numbers, dtype, saved, g):
    bx, bw, sx, sw, x_type, w_type = saved
    qx, qw = (jax.lax.bitcast_convert_type(b, E4M3) for b in (bx, bw))
    sg = scale_of(g, E5M2)
    qg = quantize(g, E5M2, sg)
    (xc, wc), (xb, wb) = dimension_numbers
    dx = _cotangent(qg, qw, qx.ndim, dimension_numbers, swap=False) * (sg * sw)
    dw = _cotangent(qg, qx, qw.ndim, ((wc, xc), (wb, xb)), swap=True) * (sg * sx)
    return dx.astype(x_type.dtype), dw.astype(w_type.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


SCOPE = "xtrain_fp8_matmul"  # the name scope of each FP8 matmul's call (ZeRO-3 finds its weights by it)


def dot(bind, eqn, ins, dtype) -> list:
    """The dot_general `eqn` on `ins` (float operands) in FP8, its product in `dtype` (bf16)."""
    x, w = ins
    with jax.named_scope(SCOPE):
        return [matmul(x, w, eqn.params["dimension_numbers"], jnp.dtype(dtype))]


def is_matmul(eqn) -> bool:
    """Whether `eqn` (of a traced step) is one FP8 matmul's call (`dot`)."""
    return eqn.primitive.name == "custom_vjp_call" and str(eqn.source_info.name_stack).endswith(SCOPE)
