"""ZeRO-3 with `GradSync(comm_dtype="int8")`: the parameter gathers whose transpose reduces the
gradients in int8, with error feedback.

Under ZeRO-3 a gradient leaves the backward pass as the transpose of its parameter's gather, a
reduce-scatter. Here that gather is one `jax.custom_vjp` per layer (per group of shards sharing
mesh axes) whose

    forward   gathers the shards as stored, cast to bf16 where every use casts them so
              (zero.narrowed), or, for FP8 matmuls' weights, as e4m3 with the whole tensor's
              scale (the shards' amax max-reduced: fp8.py's per-tensor current scaling), and
              returns the whole weights in their own dtype;
    backward  adds each weight's error-feedback residual to its gradient and reduce-scatters the
              layer's gradients as one int8 buffer (int8_sync.reduce_scatter: an all-to-all of
              int8 chunks with their scales, summed in fp32 on the receiving device), returning
              this device's block of each gradient, and, as the cotangent of the residual input,
              what quantization dropped of this device's rows: the next step's residual.

The residual is training state (TrainState.grad_residual, one whole-sized gradient per device and
parameter, as for ZeRO-2's int8 reduce-scatter): it costs each device four bytes per parameter of
the layers it holds, which the report's state memory counts. With gradient accumulation each
micro-batch adds its share (the caller passes residual / micro-batches). The gradients are reduced
before the loss's normalisation (a (sum, count) loss divides after), so the residual carries the
un-normalised scale: exact where every step has the same count.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.lowering import collectives, fp8, int8_sync, zero
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Sharded

E4M3 = "e4m3"  # `encodings` entry: an FP8 matmul's weight, gathered quantized


def gather(ctx: Context, params: list[Sharded], narrow: list, chunk: int) -> list[Sharded]:
    """`params` with every ZeRO-3 shard that carries a residual (`Sharded.feedback`) gathered by
    one custom_vjp per group of shards over the same mesh axes and varying over the same ones
    (a tensor-parallel block's split weights apart from its replicated norms: see the module docstring);
    `narrow`: per parameter, zero.narrowed's answer (a dtype, zero.AT_USE or None)."""
    out, groups = list(params), {}
    for index, x in enumerate(params):
        found = zero._zero3_dim(ctx, x) if x.feedback is not None else None
        if found is not None:  # one buffer mixes only shards that vary over the same axes
            groups.setdefault((found[1], collectives.vma(x.value)), []).append((index, found[0]))
    for (axes, _), members in groups.items():
        encodings = [E4M3 if narrow[i] == zero.AT_USE else narrow[i] for i, _ in members]
        wholes = _gather(ctx, [params[i].value for i, _ in members], [params[i].feedback for i, _ in members],
                         [d for _, d in members], axes, encodings, chunk)
        for (index, dim), value in zip(members, wholes):
            x = params[index]
            dims = list(x.layout.dims)
            dims[dim] = dims[dim][: len(dims[dim]) - len(axes)]
            out[index] = dataclasses.replace(x, value=value, layout=x.layout.with_dims(dims), zero=(), feedback=None)
    return out


def _scales(shards: list, encodings: list, axes):
    """Per-tensor e4m3 scales of the E4M3 members (None for the others): each shard's amax,
    max-reduced over `axes` (one all-gather of a vector, then the max)."""
    picked = [i for i, e in enumerate(encodings) if e == E4M3]
    if not picked:
        return [None] * len(shards)
    local = jnp.stack([jnp.max(jnp.abs(shards[i].astype(jnp.float32))) for i in picked])
    amax = jnp.max(collectives.all_gather(local, axes, 0, tiled=False), axis=0)
    scales = fp8.scale_from_amax(amax, fp8.E4M3)
    out = [None] * len(shards)
    for k, i in enumerate(picked):
        out[i] = scales[k]
    return out


def _encode(shard, encoding, scale):
    if encoding == E4M3:  # as its bytes: a saved e4m3 value would pass through reduce_precision (fp8.py)
        return lax.bitcast_convert_type(fp8.quantize(shard, fp8.E4M3, scale), jnp.uint8)
    return shard.astype(encoding) if encoding is not None else shard


def _decode(whole, encoding, scale, dtype):
    if encoding == E4M3:
        return fp8.dequantize(lax.bitcast_convert_type(whole, fp8.E4M3), scale, jnp.float32).astype(dtype)
    return whole.astype(dtype)


def _gather(ctx: Context, shards: list, feedbacks: list, dims: list[int], axes, encodings: list, chunk: int) -> list:
    n = math.prod(ctx.sizes[a] for a in axes)
    like = [(s.shape, s.dtype) for s in shards]

    def forward(shards):
        scales = _scales(shards, encodings, axes)
        encoded = [_encode(s, e, c) for s, e, c in zip(shards, encodings, scales)]
        by_dtype: dict[str, list[int]] = {}
        for i, e in enumerate(encoded):
            by_dtype.setdefault(str(e.dtype), []).append(i)
        wholes = [None] * len(shards)
        for members in by_dtype.values():
            gathered = zero._gather_flat(ctx, [encoded[i] for i in members], [dims[i] for i in members], axes)
            for i, g in zip(members, gathered):
                wholes[i] = _decode(g, encodings[i], scales[i], shards[i].dtype)
                ctx.unpacked(g, wholes[i])  # their casts are redone in the backward, not saved
        return wholes

    @jax.custom_vjp
    def gathered(shards, feedbacks):
        return forward(shards)

    def fwd(shards, feedbacks):
        return forward(shards), feedbacks

    def bwd(feedbacks, cts):
        with jax.named_scope("xtrain.grad_sync.zero3_int8"):
            rows = [zero._rows(ct.astype(jnp.float32) + fb.reshape(ct.shape).astype(jnp.float32), d, n)
                    for ct, fb, d in zip(cts, feedbacks, dims)]
            widths = [r.shape[1] for r in rows]
            mine, left = int8_sync.reduce_scatter(jnp.concatenate(rows, axis=1), axes, chunk)
        grads = [g.reshape(shape).astype(dtype) for (shape, dtype), g in zip(like, zero._split_columns(mine, widths))]
        dropped = [zero._unrows(r, d, shape).reshape(fb.shape).astype(fb.dtype)
                   for r, d, (shape, _), fb in zip(zero._split_columns(left, widths), dims, like, feedbacks)]
        return grads, dropped

    gathered.defvjp(fwd, bwd)
    return gathered(list(shards), list(feedbacks))
