"""Neuron's NKI flash-attention kernels (neuronxcc's `flash_fwd` / `flash_attn_bwd`) as xtrain primitives.

Two primitives, forward and backward, take arrays in xtrain's (batch, heads, length, dim) layout with
as many key/value heads as query heads (the front end repeats grouped keys and values outside, so
JAX sums their gradient). Their abstract evaluation is shapes only; their lowering, for the
platform "neuron" only, calls the kernels through jax_neuronx with the kernels' layouts (q and k
as (b, h, d, s); every backward operand so) and an SPMD grid of the shapes it is lowered with:
lowered inside a per-device program, the grid is the device's batch x heads shard. `flash` is
their custom_vjp: the forward keeps q, k, v, the output and the kernel's log-sum-exp (an opaque
(b, h, 128, s / 128) fp32 array), the backward calls the backward kernel.

`Kernels` is what a lowering launches; `launch_forward` / `launch_backward` hold the layout and
argument contract, so a stand-in with the kernels' documented contract (tests, on CPU) exercises
the same path. Without neuronxcc and jax_neuronx nothing is registered and `unavailable` says so.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

MIN_TILE, MAX_TILE, MAX_DIM = 512, 2048, 128  # FlashConfig.seq_tile_size bounds; the kernel's head dim cap
LSE_ROWS = 128  # the kernel's log-sum-exp: (b, h, 128, s / 128), query index = tile * 128 + partition

forward_p = Primitive("xtrain_nki_flash_fwd")
forward_p.multiple_results = True
backward_p = Primitive("xtrain_nki_flash_bwd")
backward_p.multiple_results = True
PER_HEAD = frozenset({forward_p.name, backward_p.name})  # operands (batch, heads, ...), computed per (batch, head)


class Kernels(NamedTuple):
    """What a lowering launches: `forward[grid](...)`, `backward[grid](...)`, `config(seq_tile_size=...)`
    (neuronxcc's FlashConfig) and `grid(batch, heads)` (the SPMD launch grid)."""

    forward: Any
    backward: Any
    config: Callable[..., Any]
    grid: Callable[[int, int], tuple]


def seq_tile(length: int) -> int:
    """The kernel's sequence tile for `length` tokens: the largest multiple of 512 up to 2048
    dividing it; 0 when none does (the kernel cannot take that length)."""
    return next((t for t in range(MAX_TILE, MIN_TILE - 1, -MIN_TILE) if length % t == 0), 0)


def matmul_flops(eqn) -> float:
    """The matmul FLOPs of one kernel call: (b, h, s, d) scores and weighted sums, 2 products forward
    (q.k, p.v) and 5 backward (q.k recomputed, dp, dv, dq, dk); a causal mask skips about half."""
    b, h, length, dim = eqn.invars[0].aval.shape
    products = 2 if eqn.primitive is forward_p else 5
    return products * 2.0 * b * h * length * length * dim * (0.5 if eqn.params["causal"] else 1.0)


def _forward_abstract(q, k, v, *, causal, scale, tile):
    del k, causal, scale, tile
    b, h, length, _ = q.shape
    # x.update keeps the operands' type beyond shape and dtype (varying manual axes inside shard_map)
    return [q.update(shape=q.shape[:3] + v.shape[3:]), q.update(shape=(b, h, LSE_ROWS, length // LSE_ROWS),
                                                               dtype=jnp.dtype(jnp.float32))]


def _backward_abstract(q, k, v, o, dy, lse, *, causal, scale, tile):
    del o, dy, lse, causal, scale, tile
    return [q, k, v]


forward_p.def_abstract_eval(_forward_abstract)
backward_p.def_abstract_eval(_backward_abstract)


def _t(x):
    return jnp.swapaxes(x, 2, 3)  # (b, h, s, d) <-> (b, h, d, s)


def launch_forward(kernels: Kernels, q, k, v, *, causal: bool, scale: float, tile: int):
    """flash_fwd on (b, h, s, d) arrays: q and k transposed to (b, h, d, s), v as it is; output
    (b, h, s, d) and the log-sum-exp as the kernel returns them."""
    b, h = q.shape[:2]
    seed = jnp.zeros((1,), jnp.int32)  # no dropout: the kernel's RNG is never drawn
    o, lse = kernels.forward[kernels.grid(b, h)](
        _t(q), _t(k), v, seed, softmax_scale=scale, use_causal_mask=causal, mixed_precision=True,
        dropout_p=0.0, config=kernels.config(seq_tile_size=tile))
    return [o, lse]


def launch_backward(kernels: Kernels, q, k, v, o, dy, lse, *, causal: bool, scale: float, tile: int):
    """flash_attn_bwd: every array operand and result in (b, h, d, s), returned as (b, h, s, d)."""
    del tile  # the backward kernel tiles by itself
    b, h = q.shape[:2]
    seed = jnp.zeros((1,), jnp.int32)
    grads = kernels.backward[kernels.grid(b, h)](
        _t(q), _t(k), _t(v), _t(o), _t(dy), lse, seed, use_causal_mask=causal, mixed_precision=True,
        dropout_p=0.0, softmax_scale=scale)
    return [_t(g) for g in grads]


def register_lowerings(kernels: Kernels, platform: str) -> None:
    """Lowers both primitives on `platform` by launching `kernels` (mlir.lower_fun: the launch is
    traced with the shapes the primitive is lowered with, so a per-device program gets a
    per-device grid)."""
    for prim, launch in ((forward_p, launch_forward), (backward_p, launch_backward)):
        mlir.register_lowering(prim, mlir.lower_fun(functools.partial(launch, kernels), multiple_results=True),
                               platform=platform)


def _neuron_grid(batch: int, heads: int) -> tuple:
    """(batch, heads); on trn2 (device kind NC_v3d, two physical cores per logical core) the heads
    are spread over both cores as nl.nc(2) * (heads // 2)."""
    import neuronxcc.nki.language as nl

    kind = jax.devices("neuron")[0].device_kind
    if kind == "NC_v3d" and heads % 2 == 0:
        return batch, nl.nc(2) * (heads // 2)
    return batch, heads


@functools.cache
def unavailable() -> str:
    """Why the kernels cannot run here ("" when they can): neuronxcc's kernels and jax_neuronx
    import, and the primitives' lowering for "neuron" is registered."""
    try:
        import jax_neuronx  # noqa: F401  (registers the Neuron platform and NKI calls from JAX)
        from neuronxcc.nki.kernels.attention import FlashConfig, flash_attn_bwd, flash_fwd
    except ImportError:
        return "neuronxcc's NKI kernels are not installed"
    try:
        register_lowerings(Kernels(flash_fwd, flash_attn_bwd, FlashConfig, _neuron_grid), "neuron")
    except NotImplementedError as e:  # jax knows no "neuron" platform: the plugin is missing
        return f"the Neuron JAX plugin is not loaded ({e})"
    return ""


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def flash(q, k, v, causal: bool, scale: float, tile: int):
    """Attention of (b, h, s, d) arrays (as many key/value heads as query heads) by the NKI kernels."""
    return forward_p.bind(q, k, v, causal=causal, scale=scale, tile=tile)[0]


def _flash_fwd(q, k, v, causal, scale, tile):
    o, lse = forward_p.bind(q, k, v, causal=causal, scale=scale, tile=tile)
    return o, (q, k, v, o, lse)


def _flash_bwd(causal, scale, tile, residuals, dy):
    q, k, v, o, lse = residuals
    return tuple(backward_p.bind(q, k, v, o, dy, lse, causal=causal, scale=scale, tile=tile))


flash.defvjp(_flash_fwd, _flash_bwd)
