"""Data-parallel gradient synchronisation, emitted by xtrain (not left to autodiff).

Gradients are grouped into buckets of about `bucket_bytes`; each bucket is one flat buffer
(optionally cast to a narrower dtype for the wire, then cast back), reduced either

    flat          one all-reduce over every gradient axis, or
    hierarchical  (2+ gradient axes, e.g. node x local) reduce-scatter over the inner axes,
                  all-reduce of the 1/inner shard over the outer axes, all-gather over the
                  inner axes: the slow outer links carry 1/inner of the bytes.

In the layer scan, each layer's gradients are reduced inside the backward pass by default
(`in_backward`, `in_layer`): one bucket per layer, issued where the backward scan produces it,
so the rest of the backward pass runs while it is on the wire (an async collective on GPU and
Neuron; XLA's collective pipeliner moves it out of the loop's critical path). The layers'
parameters enter the scan invariant and are cast to varying inside the body by an identity
whose derivative is that all-reduce. Under ZeRO-2 the tensors it splits are reduce-scattered
there instead, each device keeping its block (xtrain.lowering.zero.scatter_in_layer).

`comm_dtype="int8"` quantizes each bucket instead (xtrain.lowering.int8_sync: int8 all-to-all,
fp32 sums, int8 all-gather, flat or hierarchical) and keeps what quantization dropped on each
device as error feedback (`with_feedback` adds it to the next step's gradients).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.errors import OptionsError, UnsupportedError
from xtrain.lowering import collectives, int8_sync

INT8 = "int8"
# GradSync(in_backward=None): a layer whose gradients reach this many bytes is all-reduced inside
# the backward pass. At 1 MiB a ring all-reduce's transfer time is well above a collective's
# fixed cost on every backend (tens of microseconds: NCCL, Neuron's CC cores, gloo).
LAYER_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class GradSync:
    """How gradients are all-reduced over the data axes.

    Attributes:
        bucket_bytes: target payload of one all-reduce; None = one all-reduce per tensor.
        comm_dtype: dtype on the wire (e.g. "bfloat16" for fp32 gradients); None = as computed.
            "int8": quantized with a scale per chunk and error feedback (xtrain.lowering.int8_sync);
            under ZeRO-3 in the backward pass (xtrain.lowering.zero3_int8); not with the pipeline,
            fp16 loss scaling or lowering="xla" (`check_int8`).
        hierarchical: when gradients are reduced over 2+ mesh axes, reduce-scatter over the
            inner axes, all-reduce over the outer ones, all-gather over the inner ones;
            False = one flat all-reduce over all of them.
        inner_axes: the fast (intra-node) axes of a hierarchical reduction; None = the last of
            the gradient axes in the batch spec's order (`local` of batch=(("node", "local"),)).
        in_backward: the layer scan's parameters' gradients are all-reduced (ZeRO-2: those it
            splits reduce-scattered) per layer inside the backward pass (not with int8, which keeps residuals per step, nor with gradient
            accumulation, which would reduce every microbatch); False = all after the backward;
            None (default) = per layer where one layer's gradients reach LAYER_BYTES (smaller
            layers are cheaper in the post-backward buckets: a collective's fixed launch cost
            per layer outweighs the little compute it could hide behind).
    """

    bucket_bytes: int | None = 25 * 2**20
    comm_dtype: str | None = None
    hierarchical: bool = True
    inner_axes: tuple[str, ...] | None = None
    int8_chunk: int = 512  # comm_dtype="int8": elements that share one fp32 scale
    in_backward: bool | None = None

    def __post_init__(self):
        if self.bucket_bytes is not None and self.bucket_bytes <= 0:
            raise OptionsError(f"GradSync.bucket_bytes={self.bucket_bytes} must be positive or None")
        if self.comm_dtype not in (None, "bfloat16", "float16", "float32", INT8):
            raise OptionsError(f"GradSync.comm_dtype={self.comm_dtype!r} must be None, 'bfloat16', 'float16', "
                               "'float32' or 'int8'")
        if not isinstance(self.int8_chunk, int) or self.int8_chunk < 1:
            raise OptionsError(f"GradSync.int8_chunk={self.int8_chunk!r} must be a positive number of elements")
        if isinstance(self.inner_axes, str):
            object.__setattr__(self, "inner_axes", (self.inner_axes,))
        if self.inner_axes is not None and not self.inner_axes:
            raise OptionsError("GradSync.inner_axes=() names no axis; pass e.g. ('local',) or None for the last "
                               "gradient axis")

    @property
    def int8(self) -> bool:
        return self.comm_dtype == INT8

    def split(self, axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(inner, outer) axes of a hierarchical reduction over `axes`; inner=() means flat."""
        if not self.hierarchical or len(axes) < 2:
            return (), axes
        inner = axes[-1:] if self.inner_axes is None else tuple(a for a in axes if a in self.inner_axes)
        outer = tuple(a for a in axes if a not in inner)
        return (inner, outer) if inner and outer else ((), axes)


def check_axes(config: GradSync, mesh_axes: Mapping[str, int]) -> None:
    """Fails when `inner_axes` names an axis the mesh does not have."""
    for axis in config.inner_axes or ():
        if axis not in mesh_axes:
            raise OptionsError(f"GradSync.inner_axes={config.inner_axes!r}: the mesh "
                               f"({', '.join(f'{k}={v}' for k, v in mesh_axes.items())}) has no axis {axis!r}")


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


def _hierarchical(flat, inner: tuple[str, ...], outer: tuple[str, ...]):
    """psum of `flat` over inner + outer, the outer axes carrying 1/inner of the bytes."""
    n = math.prod(lax.axis_size(a) for a in inner)
    size = flat.shape[0]
    flat = jnp.pad(flat, (0, -size % n))  # reduce-scatter needs a multiple of the inner size
    shard = collectives.reduce_scatter(flat, inner, 0)  # (padded / n,)
    shard = collectives.all_reduce(shard, outer)
    return collectives.all_gather(shard, inner, 0, invariant=True)[:size]


def _unflatten(flat, like: list) -> list:
    out, offset = [], 0
    for g in like:
        out.append(flat[offset:offset + g.size].reshape(g.shape).astype(g.dtype))
        offset += g.size
    return out


def _all_reduce(grads: list, axes: tuple[str, ...], config: GradSync) -> tuple[list, list | None]:
    """(the bucket's gradients summed, their int8 residuals or None)."""
    inner, outer = config.split(axes)
    if config.int8:
        flat = jnp.concatenate([g.astype(jnp.float32).ravel() for g in grads])
        flat, residual = int8_sync.all_reduce(flat, [inner, outer] if inner else [axes], config.int8_chunk)
        return _unflatten(flat, grads), _unflatten(residual, grads)
    dtype = grads[0].dtype if config.comm_dtype is None else config.comm_dtype
    flat = jnp.concatenate([g.astype(dtype).ravel() for g in grads])
    flat = _hierarchical(flat, inner, outer) if inner else collectives.all_reduce(flat, axes)
    return _unflatten(flat, grads), None


def reduces_in_backward(config: GradSync, accumulate: int) -> bool:
    """Whether the layer scan may all-reduce its parameters' gradients inside the backward pass
    (`per_layer` then says for each layer scan)."""
    return config.in_backward is not False and not config.int8 and accumulate == 1


def per_layer(config: GradSync, layer_bytes: int) -> bool:
    """Whether a layer scan whose layers have `layer_bytes` of gradients to all-reduce does so
    per layer inside the backward pass."""
    return bool(config.in_backward) or (config.in_backward is None and layer_bytes >= LAYER_BYTES)


def in_layer(values: list, axes: tuple[str, ...], config: GradSync, label: str) -> list:
    """`values` (one layer's parameters, invariant over `axes`) cast to varying over `axes` by an
    identity whose derivative all-reduces their gradients over `axes` as one bucket, inside the
    backward pass where it reaches this layer (named `xtrain.grad_sync.in_backward[label]`)."""

    @jax.custom_vjp
    def identity(values):
        return [lax.pcast(v, axes, to="varying") for v in values]

    def forward(values):
        return identity(values), None

    def backward(_, grads):
        with jax.named_scope(f"xtrain.grad_sync.in_backward[{label}]"):
            reduced, _ = _all_reduce(list(grads), axes, config)
        return (reduced,)

    identity.defvjp(forward, backward)
    return identity(list(values))


def with_feedback(grads: Mapping[str, jnp.ndarray], residual: Mapping[str, jnp.ndarray] | None) -> dict:
    """Error feedback: each gradient plus what quantization dropped of it on this device last
    step (`residual` as stored: a device dimension of 1 beside the gradient's shape)."""
    return {n: g + residual[n].reshape(g.shape) if residual and n in residual else g for n, g in grads.items()}


def sync(grads: Mapping[str, jnp.ndarray], axes: Mapping[str, tuple[str, ...]], config: GradSync
         ) -> tuple[dict, dict]:
    """All-reduces each gradient over its axes (name -> axes), bucketing tensors that share axes.
    Returns (gradients, int8 residual per reduced gradient: empty unless comm_dtype="int8").

    Reverse order: the last layers' gradients exist first in the backward pass."""
    out, residual = dict(grads), {}
    by_axes: dict[tuple, dict[str, int]] = {}
    for name in reversed(list(grads)):
        if axes.get(name):
            g = grads[name]
            # one bucket mixes only gradients that vary over the same mesh axes (a tensor-
            # parallel shard must not make a replicated gradient look split)
            key = (axes[name], tuple(sorted(collectives.vma(g))))
            by_axes.setdefault(key, {})[name] = int(np.prod(g.shape)) * g.dtype.itemsize
    groups = [(group_axes, bucket) for (group_axes, _), sizes in by_axes.items()
              for bucket in buckets(sizes, config.bucket_bytes)]
    for index, (group_axes, bucket) in enumerate(groups):  # one number per bucket of the step: names in a report
        with jax.named_scope(f"xtrain.grad_sync.bucket{index}[{bucket[0]}..{bucket[-1]}]"):
            reduced, dropped = _all_reduce([grads[n] for n in bucket], group_axes, config)
        out.update(zip(bucket, reduced))
        residual.update(zip(bucket, dropped or ()))
    return out, residual


def check_int8(config: GradSync, *, pipeline: bool, loss_scale: bool, lowering: str) -> None:
    """Fails for the combinations GradSync(comm_dtype="int8") does not support, naming why."""
    if not config.int8:
        return
    refusals = [
        (pipeline, "a pipeline", "the pipeline step reduces each stage's gradients itself; use "
                                 "comm_dtype='bfloat16', or a plan without a pipeline"),
        (loss_scale, "fp16 loss scaling", "skipped steps and a moving scale would leave the error-feedback "
                                          "residual in the wrong scale; use precision='bf16' or 'fp32'"),
        (lowering != "explicit", f"lowering={lowering!r}", "XLA's partitioner chooses its own gradient "
                                                           "collectives; use lowering='explicit'"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise UnsupportedError(f"GradSync(comm_dtype='int8') is not supported with {what}: {fix}")
