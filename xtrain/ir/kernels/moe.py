"""Routed experts of a mixture-of-experts layer as one pure JAX function, torch-free.

`routed_experts(x, expert_ids, weights, up, down, spec=...)` is what an MoE layer computes once
its router has picked each token's top-k experts: every (token, expert) pair is sorted by expert
into a buffer of fixed size tokens x top_k (drop-free: no token is ever dropped, so the result
equals torch's), each expert's rows go through its FFN as one grouped matmul
(`grouped_matmul`: off TPU `lax.ragged_dot` runs every row through every expert's matrix), and
the rows are weighted and summed back per token.

Every token's output depends on that token alone, so the function is token-local: on a shard of
the tokens it computes exactly that shard of the output. The front end traces an MoE layer's
experts as a call of this function named by its `ExpertsSpec` marker (xtrain.ir.markers), and
the explicit lowering recognises the call by that name (`markers.outermost`) and runs it on each
device's own tokens (no gather of tokens, no collective), where a rule per primitive could not:
the sort by expert runs over all tokens of the batch.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.errors import UnsupportedError
from xtrain.ir import markers
from xtrain.ir.kernels import grouped_matmul

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "relu": jax.nn.relu,
}


@markers.marker("routed_experts")
@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertsSpec:
    """What each expert's FFN computes (HF's experts flags).

    Attributes:
        activation: a key of ACTIVATIONS.
        gated: act(gate) * up from one projection of 2 x intermediate features (SwiGLU), else act(up).
        concatenated: the gated projection's features are [gate; up], else interleaved g0, u0, g1, ...
        transposed: weights stored (experts, in, out), else (experts, out, in) like nn.Linear.
        compute: the grouped matmuls' operand and product dtype ("bfloat16", "float16"), as a
            precision policy sets it for every matmul; None: the operands' own.
    """

    activation: str
    gated: bool = True
    concatenated: bool = True
    transposed: bool = False
    compute: str | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise UnsupportedError(f"ExpertsSpec.activation={self.activation!r}: valid are {sorted(ACTIVATIONS)}")

    def compute_dtype(self, operands):
        """The GEMMs' dtype: `compute`, else the operands' own."""
        return jnp.dtype(self.compute) if self.compute else jnp.dtype(operands)


def ffn_dims(spec: ExpertsSpec) -> tuple[int, int]:
    """The expert FFN dimension of the up and of the down weight (what tensor parallel splits)."""
    return (2, 1) if spec.transposed else (1, 2)


def _as_in_out(w, spec: ExpertsSpec):
    """(experts, in, out) whatever the stored layout."""
    return w if spec.transposed else jnp.swapaxes(w, 1, 2)


def _grouped(rows, w, sizes, spec: ExpertsSpec):
    """rows (S, K) x w (E, K, N) by group, in the spec's compute dtype; the result in rows' dtype.
    One expert: one dot (its rows past `sizes` zero); more: the grouped matmul's tiles."""
    dtype = spec.compute_dtype(rows.dtype)
    if w.shape[0] == 1:
        out = lax.ragged_dot(rows.astype(dtype), w.astype(dtype), sizes, preferred_element_type=dtype)
    else:
        out = grouped_matmul.grouped_matmul(rows.astype(dtype), w.astype(dtype), sizes)
    return out.astype(rows.dtype)


def _ffn(rows, sizes, up, down, spec: ExpertsSpec, expected: int | None = None):
    """Each expert's FFN over its contiguous rows: (S, H) -> (S, H). `expected`: the rows a mostly
    padded buffer holds on average: tile by tile over the rows held (grouped_matmul.grouped_ffn)."""
    if expected is not None:
        ffn = functools.partial(_tile_ffn, spec=spec)
        return grouped_matmul.grouped_ffn(rows, up, down, sizes, ffn, expected)
    h = _grouped(rows, _as_in_out(up, spec), sizes, spec)  # (S, I) or (S, 2I)
    return _grouped(_activated(h, spec), _as_in_out(down, spec), sizes, spec)  # (S, H)


def _activated(h, spec: ExpertsSpec):
    """The up projection's features (..., I) or (..., 2 I) through the activation (and its gate)."""
    act = ACTIVATIONS[spec.activation]
    if not spec.gated:
        return act(h)
    gate, lin = jnp.split(h, 2, axis=-1) if spec.concatenated else (h[..., ::2], h[..., 1::2])
    return act(gate) * lin


def _tile_ffn(x, up, down, spec: ExpertsSpec):
    """One expert's FFN over a tile of its rows: x (T, H), up / down that expert's weights as
    stored (contracted in place: no transposed copy per tile) -> (T, H), dtypes as _grouped's."""
    dtype = spec.compute_dtype(x.dtype)
    contract = 0 if spec.transposed else 1  # the weight's input dim: (in, out) or (out, in)

    def matmul(a, w):  # summed in float32, rounded once to the compute dtype (as a GPU's GEMM does)
        out = lax.dot_general(a.astype(dtype), w.astype(dtype), (((1,), (contract,)), ((), ())),
                              preferred_element_type=jnp.float32)
        return out.astype(dtype).astype(a.dtype)

    return matmul(_activated(matmul(x, up), spec), down)


def group_sizes(expert_ids, experts: int):
    """Rows per expert: (S,) ids -> (E,) int32 counts (a compare and a sum, no scatter)."""
    return jnp.sum(expert_ids[:, None] == jnp.arange(experts, dtype=expert_ids.dtype), axis=0, dtype=jnp.int32)


def positions(sorted_ids, groups: int):
    """Each pair's place within its group, for ids sorted by group: (S,) -> (S,) int32."""
    counts = group_sizes(sorted_ids, groups)  # (G,)
    starts = jnp.cumsum(counts) - counts
    return jnp.arange(sorted_ids.shape[0], dtype=jnp.int32) - starts[sorted_ids]


def expert_capacity(tokens: int, top_k: int, experts: int, factor: float) -> int:
    """Pairs one expert takes from one device's tokens under a capacity factor."""
    return math.ceil(tokens * top_k / experts * factor)


def dropped(expert_ids, experts: int, capacity: int):
    """(token, expert) pairs past their expert's capacity: () int32."""
    counts = group_sizes(expert_ids.reshape(-1).astype(jnp.int32), experts)
    return jnp.sum(jnp.maximum(counts - capacity, 0))


def routed_experts(x, expert_ids, weights, up, down, *, spec: ExpertsSpec, capacity: int | None = None):
    """x (N, H), expert_ids (N, k) ints, weights (N, k), up / down (E, ...) -> (N, H).
    `capacity`: each expert keeps its first `capacity` pairs (in token order), the rest add nothing."""
    n, k = expert_ids.shape
    flat = expert_ids.reshape(-1).astype(jnp.int32)  # (S,) S = N k
    order = jnp.argsort(flat, stable=True)  # (S,) pairs grouped by expert
    rows = x[order // k]  # (S, H)
    out = _ffn(rows, group_sizes(flat, up.shape[0]), up, down, spec)  # (S, H)
    w = weights.reshape(-1)[order]  # (S,)
    if capacity is not None:
        w = jnp.where(positions(flat[order], up.shape[0]) < capacity, w, jnp.zeros_like(w))
    out = out * w[:, None].astype(out.dtype)
    back = jnp.argsort(order)  # (S,) inverse permutation
    return out[back].reshape(n, k, -1).sum(axis=1).astype(x.dtype)  # (N, H)


@functools.cache
def traced_call(spec: ExpertsSpec):
    """`routed_experts` for `spec` as a jitted function whose traced call is named by `spec`'s marker."""
    def fn(x, expert_ids, weights, up, down):
        return routed_experts(x, expert_ids, weights, up, down, spec=spec)

    fn.__name__ = fn.__qualname__ = markers.name(spec)
    return jax.jit(fn)
