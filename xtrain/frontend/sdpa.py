"""torch's F.scaled_dot_product_attention as xtrain computes it.

Heads stay a batch dim of every product (a tensor-parallel split of the heads stays local;
torch's reference flattens 4-D matmuls to 3-D bmm, merging batch and heads). Grouped-query
and multi-query attention group the query heads per key/value head instead of repeating keys
and values (unless a tensor-parallel split of the query heads would cut the groups: `_for_split`,
under the trace options of the model being traced, `traced_under`).
Each call site picks its implementation (`choose`): cuDNN's fused attention on
CUDA, Neuron's NKI flash-attention kernels (xtrain.ir.kernels.neuron_attention) on Neuron, where they
apply, else the blockwise kernel (xtrain.ir.kernels.blockwise), traced inside a
marker naming the choice (xtrain.ir.attention) for `step.report()`. A boolean mask the program
builds from positions (HF's sliding window) lets the kernel skip the key blocks its static
bound hides (xtrain.frontend.static_mask); calls of one shape whose masks differ share one
structure (xtrain.frontend.uniform_attention). A mask of packed documents (HF's from restarting
position_ids) reaches the kernel as its per-token comparisons (xtrain.frontend.token_mask):
no L x S mask, and the key blocks of other documents skipped at run time.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp

from xtrain.errors import UnsupportedOpError
from xtrain.frontend import static_mask, token_mask, uniform_attention
from xtrain.ir.kernels import blockwise as attention
from xtrain.ir.kernels import neuron_attention as nki
from xtrain.ir import markers
from xtrain.ir.attention import DEFAULT_BLOCK, Implementation, Site
from xtrain.ir.trace_options import TraceOptions

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_NKI_DTYPES = (jnp.bfloat16, jnp.float16)
_backend = jax.default_backend  # the platform the trace is for (tests stand in a GPU's)
# The trace options of the model being traced (xtrain.ir.trace_options: the head split, why NKI
# is ruled out), set only for the duration of one trace by `traced_under`; torch eager never
# reads it.
_OPTIONS: contextvars.ContextVar[TraceOptions] = contextvars.ContextVar("xtrain_trace_options",
                                                                         default=TraceOptions())


@contextlib.contextmanager
def traced_under(options: TraceOptions):
    """Attention traced inside follows `options` (the front end's trace of one model)."""
    token = _OPTIONS.set(options)
    try:
        with _grouped_kv():
            yield
    finally:
        _OPTIONS.reset(token)


# transformers' switch (read at each call) for passing grouped keys and values with enable_gqa
_HF_GQA = "TRANSFORMERS_SDPA_FORCE_GQA"


@contextlib.contextmanager
def _grouped_kv():
    """HF's sdpa integration passes grouped keys and values (enable_gqa) to a layer without a mask
    and repeats them per query head (repeat_kv) for a layer with one: Gemma-3's sliding layers
    (masked) and full layers (causal, no mask) would trace as different blocks, and no pipeline
    or layer scan could run them as one family. Traced by xtrain every layer takes the grouped
    call (this sdpa takes a mask with grouped heads; the result is the same); torch's own runs,
    outside the trace, are untouched."""
    before = os.environ.get(_HF_GQA)
    os.environ[_HF_GQA] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_HF_GQA, None)
        else:
            os.environ[_HF_GQA] = before


def _for_split(query, key, value):
    """Keys and values repeated to one per query head when the query heads split evenly over the
    tensor-parallel size and the key/value heads do not (GQA with 3 key/value heads on
    tensor=2): grouping the query heads by key/value head would mix the split; repeated, each
    device reads the key/value heads its query heads use and the split stays local."""
    n, hq, hk = _OPTIONS.get().head_split, query.shape[-3], key.shape[-3]
    if n == 1 or hk in (1, hq) or hk % n == 0 or hq % n:
        return key, value
    return jnp.repeat(key, hq // hk, axis=-3), jnp.repeat(value, hq // hk, axis=-3)  # (..., Hq, S, D)


def _heads(hq: int, hk: int, enable_gqa: bool) -> int:
    """Query heads per key/value head; torch broadcasts one key/value head (multi-query)."""
    if hq == hk or hk == 1 or (enable_gqa and hq % hk == 0):
        return hq // hk
    fix = (f"{hk} does not divide {hq}: use a key/value head count that divides it" if enable_gqa
           else f"pass enable_gqa=True (grouped-query attention), or 1 key/value head (torch broadcasts it)")
    raise UnsupportedOpError(f"scaled_dot_product_attention: {hq} query heads and {hk} key/value heads; {fix}")


def _grouped_mask(mask, hq: int, hk: int, rank: int):
    """A mask broadcastable to (..., Hq, L, S) as (..., Hk|1, G|1, L, S) of rank `rank`."""
    if mask.ndim >= 3 and mask.shape[-3] == hq and hq != 1:  # per-query-head: group it like q
        mask = mask.reshape(*mask.shape[:-3], hk, hq // hk, *mask.shape[-2:])
    elif mask.ndim >= 3:
        mask = jnp.expand_dims(mask, -3)  # (..., 1, L, S) -> (..., 1, 1, L, S)
    return mask.reshape((1,) * (rank - mask.ndim) + mask.shape)


def choose(backend: str, query, value, attn_mask, dropout_p: float) -> tuple[Implementation, str]:
    """The implementation of one call on `backend` (jax.default_backend()) and, when not the
    platform's fused kernel, why."""
    if backend == "neuron":
        return _choose_on_neuron(query, value, attn_mask, dropout_p)
    if backend not in ("gpu", "cuda"):
        return Implementation.BLOCKWISE, ""
    dim = query.shape[-1]
    reasons = [why for bad, why in (
        (query.ndim != 4, f"query of rank {query.ndim}, not (batch, heads, length, dim)"),
        (kernel_dtype(query, _CUDNN_DTYPES) is None, f"{jnp.dtype(query.dtype).name} (cuDNN takes bf16 / fp16)"),
        (dropout_p > 0, "dropout"),
        (dim % 8 or dim > 128 or value.shape[-1] != dim, f"head dim {dim} / {value.shape[-1]}"),
        (attn_mask is not None, "an attention mask (xtrain hands cuDNN causal or unmasked attention)"),
        (bool(_OPTIONS.get().no_cudnn), _OPTIONS.get().no_cudnn),
        (query.ndim == 4 and not _ulysses_splits(query.shape[-3], value.shape[-3], _OPTIONS.get()),
         f"{query.shape[-3]} query / {value.shape[-3]} key-value heads do not split over Ulysses' "
         f"{_OPTIONS.get().ulysses} devices (the blockwise kernel repeats key/value heads)"),
    ) if bad]
    if reasons:
        return Implementation.BLOCKWISE, "not cuDNN: " + ", ".join(reasons)
    return Implementation.CUDNN, ""


def kernel_dtype(query, dtypes) -> Any:
    """The dtype a fused kernel taking `dtypes` runs a call in: the query's own, or the plan's
    compute dtype for a float32 query under a bf16 / fp16 policy (TraceOptions.autocast); None
    when neither."""
    if query.dtype in dtypes:
        return query.dtype
    autocast = _OPTIONS.get().autocast
    if autocast and query.dtype == jnp.float32 and jnp.dtype(autocast) in dtypes:
        return jnp.dtype(autocast)
    return None


def _autocast(kernel, query, key, value, dtype):
    """`kernel` on q, k, v cast to `dtype`, its output cast back to the query's dtype."""
    if query.dtype == dtype:
        return kernel(query, key, value)
    return kernel(*(x.astype(dtype) for x in (query, key, value))).astype(query.dtype)


def _ulysses_splits(query_heads: int, kv_heads: int, options: TraceOptions) -> bool:
    """Whether a fused kernel's heads split over Ulysses' devices (after the tensor-parallel
    head split) as they are, with no key/value head repeated."""
    n = options.ulysses * options.head_split
    return options.ulysses == 1 or (query_heads % n == 0 and kv_heads % n == 0)


def _choose_on_neuron(query, value, attn_mask, dropout_p: float) -> tuple[Implementation, str]:
    """NKI flash attention where its kernels take the call, else the blockwise kernel and why."""
    dim, length, source = query.shape[-1], query.shape[-2], value.shape[-2]
    reasons = [why for bad, why in (
        (query.ndim != 4, f"query of rank {query.ndim}, not (batch, heads, length, dim)"),
        (kernel_dtype(query, _NKI_DTYPES) is None,
         f"{jnp.dtype(query.dtype).name} (the kernel multiplies in bf16: it takes bf16 / fp16, not silently less)"),
        (dropout_p > 0, "dropout (xtrain's dropout masks do not depend on the mesh; the kernel's RNG would)"),
        (attn_mask is not None, "an attention mask (the kernel takes causal or unmasked attention)"),
        (length != source, f"{length} queries and {source} keys (the kernel takes equal lengths)"),
        (not nki.seq_tile(length), f"sequence {length} (the kernel tiles it by a multiple of {nki.MIN_TILE})"),
        (dim > nki.MAX_DIM or value.shape[-1] != dim, f"head dim {dim} / {value.shape[-1]} (at most {nki.MAX_DIM})"),
        (bool(_OPTIONS.get().no_nki), _OPTIONS.get().no_nki),
        (query.ndim == 4 and not _ulysses_splits(query.shape[-3], query.shape[-3], _OPTIONS.get()),
         f"{query.shape[-3]} query heads do not split over Ulysses' {_OPTIONS.get().ulysses} devices"),
    ) if bad]
    if not reasons:
        reasons = [why for why in (nki.unavailable(),) if why]
    if reasons:
        return Implementation.BLOCKWISE, "not NKI flash attention: " + ", ".join(reasons)
    return Implementation.NKI_FLASH, ""


def _nki_flash(query, key, value, is_causal: bool, scale: float):
    """The NKI kernels, keys and values repeated to one per query head (the backward kernel takes
    equal head counts; JAX sums the repeat's gradient over each group)."""
    groups = query.shape[-3] // key.shape[-3]
    if groups > 1:
        key, value = jnp.repeat(key, groups, axis=-3), jnp.repeat(value, groups, axis=-3)
    return nki.flash(query, key, value, bool(is_causal), scale, nki.seq_tile(query.shape[-2]))


def _cudnn(query, key, value, is_causal: bool, scale: float):
    """jax.nn.dot_product_attention with cuDNN; it takes (batch, length, heads, dim)."""
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
    out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=is_causal, implementation="cudnn")
    return jnp.swapaxes(out, 1, 2)


def _blockwise(b: attention.Blocking, query, key, value, attn_mask, rng):
    *batch, hq, length, dim = query.shape
    hk = key.shape[-3]
    q = query.reshape(*batch, hk, hq // hk, length, dim)  # (..., Hk, G, L, D)
    if isinstance(attn_mask, token_mask.Factors):
        mask = tuple(_grouped_mask(x, hq, hk, q.ndim) for x in attn_mask.operands)
    else:
        mask = None if attn_mask is None else _grouped_mask(attn_mask, hq, hk, q.ndim)
    return attention.blockwise(q, key, value, mask, rng, b).reshape(*batch, hq, length, value.shape[-1])


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False, env=None):
    """F.scaled_dot_product_attention on (..., heads, length, dim) arrays."""
    _heads(query.shape[-3], key.shape[-3], enable_gqa)
    key, value = _for_split(query, key, value)
    if is_causal and attn_mask is not None:
        raise UnsupportedOpError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
    scale = attention.default_scale(query.shape[-1]) if scale is None else float(scale)
    rng = env.get_and_rotate_prng_key() if dropout_p > 0 else None
    kind, why = choose(_backend(), query, value, attn_mask, dropout_p)
    if kind is Implementation.CUDNN:
        with jax.named_scope(markers.name(Site(kind))):
            return _autocast(lambda q, k, v: _cudnn(q, k, v, is_causal, scale), query, key, value,
                             kernel_dtype(query, _CUDNN_DTYPES))
    if kind is Implementation.NKI_FLASH:
        with jax.named_scope(markers.name(Site(kind, block=nki.seq_tile(query.shape[-2])))):
            return _autocast(lambda q, k, v: _nki_flash(q, k, v, is_causal, scale), query, key, value,
                             kernel_dtype(query, _NKI_DTYPES))
    # traced away from a GPU (a plan for a GPU target costed on this host): would CUDA fuse it?
    fused_on = "cuda" if _backend() not in ("gpu", "cuda") and choose(
        "gpu", query, value, attn_mask, dropout_p)[0] is Implementation.CUDNN else ""
    return blockwise_call(query, key, value, attn_mask, scale, why, causal=is_causal, dropout=float(dropout_p),
                          rng=rng, fused_on=fused_on)


def blockwise_call(query, key, value, attn_mask, scale: float, why: str, *, causal=False, dropout=0.0, rng=None,
                   dropped_mask=None, fused_on: str = ""):
    """The blockwise kernel on (..., heads, length, dim) arrays, inside its report marker.
    `dropped_mask`: a mask the caller found the causal flag to replace (HF eager's constant causal
    mask), used only where calls of this shape share one structure with masks."""
    block = DEFAULT_BLOCK.get(_backend(), DEFAULT_BLOCK["cpu"])
    length, source = query.shape[-2], key.shape[-2]
    band = static_mask.bound(attn_mask)  # a sliding window built from positions: skip blocks outside it
    b = attention.blocking_for(length, source, block, scale=scale, causal=causal, dropout=dropout,
                               visible=lambda bq, bk: static_mask.visible_blocks(band, length, source, bq, bk))
    documents = token_mask.factors(attn_mask)
    if documents is not None:  # packed documents: each block's mask from its tokens, disjoint ones skipped
        b = dataclasses.replace(b, factors=documents.ops, skip_at_run_time=_backend() != "neuron" and b.pairs() > 1)
        with jax.named_scope(markers.name(attention.site(b, why, fused_on))):
            return _blockwise(b, query, key, value, documents, rng)
    # calls of one shape share one structure (layers differing only in their masks stay one family)
    b, attn_mask = uniform_attention.adjust(b, query, key, value, attn_mask, band, rng, dropped_mask)
    with jax.named_scope(markers.name(attention.site(b, why, fused_on))):
        return _blockwise(b, query, key, value, attn_mask, rng)
