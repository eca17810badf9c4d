"""Data-parallel gradient synchronisation, emitted by xtrain (not left to autodiff).

Gradients are grouped into buckets of about `bucket_bytes`; each bucket is one all-reduce
over a flat buffer (optionally cast to a narrower dtype for the wire, then cast back).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradSync:
    """How gradients are all-reduced over the data axes.

    Attributes:
        bucket_bytes: target payload of one all-reduce; None = one all-reduce per tensor.
        comm_dtype: dtype on the wire (e.g. "bfloat16" for fp32 gradients); None = as computed.
    """

    bucket_bytes: int | None = 25 * 2**20
    comm_dtype: str | None = None

    def __post_init__(self):
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise ValueError(f"GradSync.bucket_bytes={self.bucket_bytes} must be positive or None")
        if self.comm_dtype not in (None, "bfloat16", "float16", "float32"):
            raise ValueError(f"GradSync.comm_dtype={self.comm_dtype!r} must be None, 'bfloat16', 'float16' or 'float32'")


def buckets(sizes: Mapping[str, int], bucket_bytes: int | None) -> list[list[str]]:
    """Groups names (in the given order) into buckets of about `bucket_bytes` each."""
    if bucket_bytes is None:
        return [[n] for n in sizes]
    out, current, filled = [], [], 0
    for name, size in sizes.items():
        if current and filled + size > bucket_bytes:
            out.append(current)
            current, filled = [], 0
        current.append(name)
        filled += size
    return out + ([current] if current else [])


def _all_reduce(grads: list, axes: tuple[str, ...], comm_dtype) -> list:
    dtype = grads[0].dtype if comm_dtype is None else comm_dtype
    flat = jnp.concatenate([g.astype(dtype).ravel() for g in grads])
    flat = lax.psum(flat, axes)
    out, offset = [], 0
    for g in grads:
        out.append(flat[offset:offset + g.size].reshape(g.shape).astype(g.dtype))
        offset += g.size
    return out


def sync(grads: Mapping[str, jnp.ndarray], axes: Mapping[str, tuple[str, ...]], config: GradSync) -> dict:
    """All-reduces each gradient over its axes (name -> axes), bucketing tensors that share axes.

    Reverse order: the last layers' gradients exist first in the backward pass."""
    from xtrain.lowering.explicit.collectives import vma

    out = dict(grads)
    by_axes: dict[tuple, dict[str, int]] = {}
    for name in reversed(list(grads)):
        if axes[name]:
            g = grads[name]
            # one bucket mixes only gradients that vary over the same mesh axes (a tensor-
            # parallel shard must not make a replicated gradient look split)
            key = (axes[name], tuple(sorted(vma(g))))
            by_axes.setdefault(key, {})[name] = int(np.prod(g.shape)) * g.dtype.itemsize
    for (group_axes, _), sizes in by_axes.items():
        for index, bucket in enumerate(buckets(sizes, config.bucket_bytes)):
            with jax.named_scope(f"xtrain.grad_sync.bucket{index}[{bucket[0]}..{bucket[-1]}]"):
                reduced = _all_reduce([grads[n] for n in bucket], group_axes, config.comm_dtype)
            out.update(zip(bucket, reduced))
    return out
