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
    """The scale(s) of tensors whose amax is `amax` (float32, any shape): see `scale_of`. A product
    with the reciprocal, not a quotient: XLA:CPU's vectorised division can be an ulp off IEEE's,
    so a vector of scales (rowwise, several shards) would not equal each tensor's own."""
    return jnp.where(amax > 0, amax * np.float32(1.0 / largest(dtype)), np.float32(1.0))


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


def _dot(a, b, dimension_numbers):
    return jax.lax.dot_general(a, b, dimension_numbers, preferred_element_type=jnp.float32)


def _cotangent(g, other, ndim: int, dimension_numbers, swap: bool, dot=_dot, other_ndim: int | None = None):
    """The cotangent of the operand (of rank `ndim`) multiplied by `other` in a dot_general of
    `dimension_numbers` (the operand's dims first), from the output's cotangent `g`: one
    dot_general of g and `other`, accumulated in float32, transposed into the operand's dims
    (the transpose rule autodiff applies to dot_general, on FP8 tensors here). `swap`: the
    operand was the right-hand one (g's free dims list the left-hand operand's first). `dot`
    multiplies g and `other` (of rank `other_ndim`: default other.ndim)."""
    (contract, other_contract), (batch, other_batch) = dimension_numbers
    kept = _free(ndim, contract, batch)
    other_kept = _free(other.ndim if other_ndim is None else other_ndim, other_contract, other_batch)
    n = len(batch)
    start = n if swap else n + len(kept)
    g_other = list(range(start, start + len(other_kept)))
    out = dot(g, other, ((g_other, other_kept), (list(range(n)), list(other_batch))))
    unsorted = list(batch) + kept + list(np.take(contract, np.argsort(other_contract)).astype(int))
    return jnp.transpose(out, tuple(int(i) for i in np.argsort(unsorted)))


def _product(x, w, sx, sw, dimension_numbers, dtype):
    """dot_general(x, w) of the e4m3 operands quantized with scales sx, sw, in `dtype`, and what
    the backward reads."""
    qx, qw = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    y = jax.lax.dot_general(qx, qw, dimension_numbers, preferred_element_type=jnp.float32) * (sx * sw)
    # the saved operands travel as their bytes: under jax.checkpoint (remat, ZeRO-3's re-gather)
    # JAX passes a saved FP8 value through reduce_precision(4, 3), an IEEE format whose largest
    # value is 240, and e4m3fn's 256..448 would come back NaN (e4m3fn has no inf)
    saved = tuple(jax.lax.bitcast_convert_type(q, jnp.uint8) for q in (qx, qw))
    return y.astype(dtype), (*saved, sx, sw, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _gradients(dimension_numbers, saved, g, sg):
    """The gradients of x and w (in their dtypes) from the output's cotangent `g`, quantized to
    e5m2 with scale `sg`, times the saved e4m3 operands."""
    bx, bw, sx, sw, x_type, w_type = saved
    qx, qw = (jax.lax.bitcast_convert_type(b, E4M3) for b in (bx, bw))
    qg = quantize(g, E5M2, sg)
    (xc, wc), (xb, wb) = dimension_numbers
    dx = _cotangent(qg, qw, qx.ndim, dimension_numbers, swap=False) * (sg * sw)
    dw = _cotangent(qg, qx, qw.ndim, ((wc, xc), (wb, xb)), swap=True) * (sg * sx)
    return dx.astype(x_type.dtype), dw.astype(w_type.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul(x, w, dimension_numbers, dtype):
    """dot_general(x, w) with e4m3 operands, each scaled by its amax, the product in `dtype`;
    its backward takes the e5m2 cotangent (x's and w's gradients in their own dtypes)."""
    return _matmul_fwd(x, w, dimension_numbers, dtype)[0]


def _matmul_fwd(x, w, dimension_numbers, dtype):
    return _product(x, w, scale_of(x, E4M3), scale_of(w, E4M3), dimension_numbers, dtype)


def _matmul_bwd(dimension_numbers, dtype, saved, g):
    return _gradients(dimension_numbers, saved, g, scale_of(g, E5M2))


matmul.defvjp(_matmul_fwd, _matmul_bwd)


# -- delayed scaling: the scales from an amax history kept as training state ----------------------
# A history is (3, H) float32: the amaxes of the left operand, the right operand and the product's
# cotangent over the last H steps, newest first. The step quantizes with the largest of each row
# (all zeros, a fresh run's, gives scale 1) and records this step's amaxes; the record leaves the
# backward pass as the history's cotangent (column 0: the amaxes, the rest zeros), which the step
# rolls into the stored history (`recorded`). So no reduction of this step's tensors precedes its
# matmuls; and the amaxes are each device's own over the batch axes (the explicit lowering's
# reduction rule leaves them local: `LOCAL_AMAX`), max-reduced over them once per step with every
# history at once. (NVIDIA Transformer Engine's DelayedScaling recipe, "max" over the history, margin 0;
# its amax reduction over the data-parallel group once per step.)
LOCAL_AMAX = "xtrain_fp8_local_amax"  # the name scope of delayed scaling's amaxes
def history_scales(history):
    """The scales of (left, right, cotangent): each row's largest amax over its format's largest
    value (e4m3, e4m3, e5m2)."""
    amax = jnp.max(history, axis=1)
    return scale_from_amax(amax[0], E4M3), scale_from_amax(amax[1], E4M3), scale_from_amax(amax[2], E5M2)


def recorded(history, amaxes):
    """`history` after a step whose amaxes were `amaxes` (3,): newest first, the oldest dropped."""
    return jnp.concatenate([amaxes[:, None].astype(history.dtype), history[:, :-1]], axis=1)


def _amax(x):
    """amax(|x|) in float32; this device's own over the batch axes under the explicit lowering."""
    with jax.named_scope(LOCAL_AMAX):
        return jnp.max(jnp.abs(x.astype(jnp.float32)))


def is_local_amax(eqn) -> bool:
    """Whether reduction `eqn` is a delayed-scaling amax (reduced over the batch axes per step)."""
    return LOCAL_AMAX in str(eqn.source_info.name_stack)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def delayed_matmul(x, w, history, dimension_numbers, dtype):
    """`matmul` with the scales of `history` (3, H); the history's cotangent is this step's
    amaxes (column 0), not a derivative."""
    return _delayed_fwd(x, w, history, dimension_numbers, dtype)[0]


def _delayed_fwd(x, w, history, dimension_numbers, dtype):
    sx, sw, sg = history_scales(history)
    y, saved = _product(x, w, sx, sw, dimension_numbers, dtype)
    return y, (saved, sg, jnp.stack([_amax(x), _amax(w)]), jnp.zeros(history.shape[1:], history.dtype))


def _delayed_bwd(dimension_numbers, dtype, residuals, g):
    saved, sg, amaxes, row = residuals
    amaxes = jnp.concatenate([amaxes, _amax(g)[None]])
    record = jnp.concatenate([amaxes[:, None].astype(row.dtype), jnp.zeros((3, row.shape[0] - 1), row.dtype)], axis=1)
    return (*_gradients(dimension_numbers, saved, g, sg), record)


delayed_matmul.defvjp(_delayed_fwd, _delayed_bwd)


# -- rowwise scaling: one scale per row of each operand ----------------------------------------
# Each operand of a dot is quantized with one scale per index of its dims the dot keeps (the amax
# over the dims it contracts: x's rows, w's output columns), so one outlier token or channel does
# not coarsen the others; the product's scale is the outer product of the two. A gradient's dot
# contracts other dims, so each operand is also quantized along them, in the forward, and saved
# as those e4m3 bytes and scales (half of bf16's); the backward quantizes the cotangent per row of
# the dot it enters. (torchao's float8 "rowwise" recipe.)
def _rows(t, contract, fmt):
    """`t` quantized to `fmt` with one scale per index of its dims outside `contract` (the amax
    over `contract`): (FP8 values, scales with `contract`'s dims kept as 1)."""
    scale = scale_from_amax(jnp.max(jnp.abs(t.astype(jnp.float32)), axis=tuple(contract), keepdims=True), fmt)
    return quantize(t, fmt, scale), scale


def _scaled_product(qa, sa, qb, sb, dimension_numbers):
    """dot_general of FP8 `qa`, `qb` in float32, times their per-row scales' outer product."""
    (ac, bc), (ab, bb) = dimension_numbers
    a_free = [d for d in range(qa.ndim) if d not in ac and d not in ab]
    b_free = [d for d in range(qb.ndim) if d not in bc and d not in bb]
    batch = [qa.shape[d] for d in ab]
    # the scales in the product's dims (batch, a's free, b's free): each broadcast along the other's
    sa = jnp.transpose(sa, (*ab, *a_free, *ac)).reshape(*batch, *(qa.shape[d] for d in a_free), *[1] * len(b_free))
    sb = jnp.transpose(sb, (*bb, *b_free, *bc)).reshape(*batch, *[1] * len(a_free), *(qb.shape[d] for d in b_free))
    return _dot(qa, qb, dimension_numbers) * (sa * sb)


def rowwise_dot(a, b, dimension_numbers, fa, fb):
    """dot_general(a, b) in float32 of `a` quantized to `fa` and `b` to `fb`, each with one scale
    per index of the dims the dot keeps (amax over those it contracts)."""
    (ac, bc), _ = dimension_numbers
    return _scaled_product(*_rows(a, ac, fa), *_rows(b, bc, fb), dimension_numbers)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rowwise_matmul(x, w, dimension_numbers, dtype):
    """dot_general(x, w) with e4m3 operands scaled per row (`rowwise_dot`), in `dtype`; its
    backward quantizes the cotangent to e5m2, times the operands quantized along the other dims."""
    return rowwise_dot(x, w, dimension_numbers, E4M3, E4M3).astype(dtype)


def _free(ndim: int, contract, batch) -> list[int]:
    return [d for d in range(ndim) if d not in contract and d not in batch]


def _rowwise_fwd(x, w, dimension_numbers, dtype):
    (xc, wc), (xb, wb) = dimension_numbers
    # each operand along the dims its gradient's dot contracts (its free ones), as bytes (`_product`)
    (qx, sx), (qw, sw) = _rows(x, _free(x.ndim, xc, xb), E4M3), _rows(w, _free(w.ndim, wc, wb), E4M3)
    saved = (jax.lax.bitcast_convert_type(qx, jnp.uint8), sx, jax.lax.bitcast_convert_type(qw, jnp.uint8), sw,
             jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))
    return rowwise_dot(x, w, dimension_numbers, E4M3, E4M3).astype(dtype), saved


def _rowwise_bwd(dimension_numbers, dtype, saved, g):
    bx, sx, bw, sw, x_type, w_type = saved
    qx, qw = (jax.lax.bitcast_convert_type(b, E4M3) for b in (bx, bw))
    (xc, wc), (xb, wb) = dimension_numbers
    dot = lambda a, other, dims: _scaled_product(*_rows(a, dims[0][0], E5M2), *other, dims)
    dx = _cotangent(g, (qw, sw), qx.ndim, dimension_numbers, swap=False, dot=dot, other_ndim=qw.ndim)
    dw = _cotangent(g, (qx, sx), qw.ndim, ((wc, xc), (wb, xb)), swap=True, dot=dot, other_ndim=qx.ndim)
    return dx.astype(x_type.dtype), dw.astype(w_type.dtype)


rowwise_matmul.defvjp(_rowwise_fwd, _rowwise_bwd)


SCOPE = "xtrain_fp8_matmul"  # the name scope of each FP8 matmul's call (ZeRO-3 finds its weights by it)


def dot(eqn, ins, dtype, history=None, rowwise: bool = False) -> list:
    """The dot_general `eqn` on `ins` (float operands) in FP8, its product in `dtype` (bf16):
    current per-tensor scaling, per row (`rowwise`), or delayed with `history` (3, H) when given."""
    x, w = ins
    dims, dtype = eqn.params["dimension_numbers"], jnp.dtype(dtype)
    with jax.named_scope(SCOPE):
        if rowwise:
            return [rowwise_matmul(x, w, dims, dtype)]
        if history is None:
            return [matmul(x, w, dims, dtype)]
        return [delayed_matmul(x, w, history, dims, dtype)]


def is_matmul(eqn) -> bool:
    """Whether `eqn` (of a traced step) is one FP8 matmul's call (`dot`)."""
    return eqn.primitive.name == "custom_vjp_call" and str(eqn.source_info.name_stack).endswith(SCOPE)
