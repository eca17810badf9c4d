"""Scaled-dot-product attention computed block by block, with its own derivative rule.

Pure JAX (no torch): the front end calls it for each attention site, and the lowering's ring
attention (xtrain.lowering.ring_attention) runs its forward and backward on sequence chunks.

The scores of one query block against one key block at a time, combined by an online
softmax (running max and sum per query row); the backward pass keeps the output and the
log-sum-exp of each row, not the L x S weights, and recomputes each block's scores. Memory is
linear in the sequence. A causal mask skips the key blocks a query block cannot see (about
half the pairs). Keys and values stay one per key/value head (grouped-query / multi-query
attention groups the query heads instead of repeating them); heads and batch stay batch dims
of every product, so a split of either over a mesh axis stays local.

Shapes: q (..., Hk, G, L, D), k (..., Hk, S, D), v (..., Hk, S, Dv), mask (or additive bias)
broadcastable to (..., Hk, G, L, S) with the same rank as q.

A mask built from per-token comparisons (documents packed into one row: `seg_q == seg_k`
and `pos_k <= pos_q`, from HF's position_ids) can come as its factors instead
(`Blocking.factors`, xtrain.frontend.token_mask): pairs of operands of q's rank, each with a
query or a key length of 1, so no L x S array exists; each block computes its own mask from its
rows and columns. With `Blocking.skip_at_run_time`, a key block whose factors cannot hold for
any of its pairs (disjoint documents: `documents.block_visibility`) is skipped by `lax.cond`
(conditionals run on CPU and GPU; Neuron computes every block, masked).

The explicit lowering keeps a loop carry at the layout it starts with, so every carry starts
as arithmetic on q (`_zeros_like_rows`), in q's layout; a constant would be replicated and
each step's carry gathered back to it.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.ir.kernels import attention_dropout as dropout_mask
from xtrain.ir.kernels import documents
from xtrain.ir import markers, vma
from xtrain.ir.attention import Implementation, Site


@markers.marker("blocking")
@dataclasses.dataclass(frozen=True)
class Blocking:
    """Static shape of one blockwise attention call.

    Attributes:
        scale: multiplies q.k.
        causal: torch's is_causal: query i sees keys j <= i.
        block_q, block_k: block sizes (the sequences are padded to whole blocks).
        length, source: query and key lengths before padding.
        dropout: probability of dropping an attention weight (0: none).
        visible: per query block, the [start, stop) key blocks a static bound of the mask
            leaves visible (a sliding window: xtrain.frontend.static_mask); () = all.
        factors: the mask as per-token comparisons (lax comparison names, "eq", "le", ...): the
            mask operand is then 2 arrays per factor, `a op b` (see the module docstring).
        skip_at_run_time: skip, with lax.cond, the key blocks the factors hide for every pair.
    """

    scale: float
    causal: bool
    block_q: int
    block_k: int
    length: int
    source: int
    dropout: float = 0.0
    visible: tuple[tuple[int, int], ...] = ()
    factors: tuple[str, ...] = ()
    skip_at_run_time: bool = False

    @property
    def n_q(self) -> int:
        return -(-self.length // self.block_q)

    @property
    def n_k(self) -> int:
        return -(-self.source // self.block_k)

    def key_blocks(self, i: int) -> range:
        """The key blocks query block i must see: all, up to its last row under causal, or
        those its mask's static bound leaves visible."""
        if self.visible:
            return range(*self.visible[i])
        if not self.causal:
            return range(self.n_k)
        last_row = min((i + 1) * self.block_q, self.length) - 1
        return range(min(self.n_k, last_row // self.block_k + 1))

    @property
    def keeps_weights(self) -> bool:
        """One block: the backward keeps the weights (a block's worth) instead of recomputing
        them, as full attention would; the program then has no recomputed matmul."""
        return self.n_q == 1 and self.n_k == 1

    def pairs(self) -> int:
        return sum(len(self.key_blocks(i)) for i in range(self.n_q))


def blocking_for(length: int, source: int, block: int, *, scale: float, causal: bool,
                 dropout: float = 0.0, visible=None) -> Blocking:
    """A blocking of `block` (shorter sequences are one block); `visible(block_q, block_k)`, when
    given, says which key blocks each query block sees (see Blocking.visible)."""
    bq, bk = min(block, length), min(block, source)
    return Blocking(scale, causal, bq, bk, length, source, dropout, visible(bq, bk) if visible else ())


def site(b: Blocking, why: str = "", fused_on: str = "") -> Site:
    by = "causal mask" if b.causal else "mask's static band"
    documents = "" if not b.factors else (
        "packed documents: each block's mask from its tokens, the blocks of other documents skipped at run time"
        if b.skip_at_run_time else "packed documents: each block's mask from its tokens, every block computed")
    return Site(Implementation.BLOCKWISE, max(b.block_q, b.block_k), b.pairs(), b.n_q * b.n_k, why, by, fused_on,
                documents)


def _pad(x, axis: int, size: int):
    extra = size - x.shape[axis]
    if extra <= 0 or x.shape[axis] == 1:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def _zeros_like_rows(q_block, width: int, dtype):
    """(..., bq, width) zeros in q's layout (see the module docstring)."""
    return q_block[..., :1].astype(dtype) * jnp.zeros((width,), dtype)


def _key_stack(x, start: int, count: int, bk: int):
    """Key blocks [start, start + count) of (..., S, d) as (count, ..., bk, d), the scanned axis first."""
    part = x[..., start * bk:(start + count) * bk, :]
    part = part.reshape(*x.shape[:-2], count, bk, x.shape[-1])
    return jnp.moveaxis(part, -3, 0)


def _mask_stack(mask, rows: slice, start: int, count: int, bk: int):
    """Mask blocks of one query block, (count, ..., bq or 1, bk)."""
    part = mask[..., rows, start * bk:(start + count) * bk] if mask.shape[-2] > 1 \
        else mask[..., start * bk:(start + count) * bk]
    part = part.reshape(*part.shape[:-1], count, bk)
    return jnp.moveaxis(part, -2, 0)


def _scan(step, init, xs, count: int):
    """lax.scan over `count` key blocks; one block is one call (no loop in the program)."""
    if count > 1:
        return lax.scan(step, init, xs)
    carry, y = step(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda x: x[None], y)


def _scores(b: Blocking, q_i, k_j, mask_j, q_start: int, k_start):
    """One block's masked scores (..., Hk, G, bq, bk), -inf where masked."""
    s = jnp.einsum("...hgqd,...hkd->...hgqk", q_i, k_j, preferred_element_type=jnp.float32) * b.scale
    if mask_j is not None and mask_j.dtype == jnp.bool_:
        s = jnp.where(mask_j, s, -jnp.inf)
    elif mask_j is not None:
        s = s + mask_j.astype(s.dtype)
    rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
    cols = k_start + lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
    if b.causal:
        s = jnp.where(cols <= rows, s, -jnp.inf)
    if b.n_k * b.block_k != b.source:  # padded keys
        s = jnp.where(cols < b.source, s, -jnp.inf)
    return s


def _dropped(b: Blocking, p, key, i: int, j):
    """p with torch's inverted dropout, its mask a hash of the global coordinates (the backward
    draws it again; xtrain.ir.kernels.attention_dropout). `key`: the dropout key, or a Drop that places
    a chunk of the call (ring attention)."""
    if not b.dropout:
        return p
    drop = key if isinstance(key, dropout_mask.Drop) else \
        dropout_mask.Drop(*key) if isinstance(key, tuple) else dropout_mask.Drop(key)
    keep = dropout_mask.kept(drop, b.dropout, p.shape, i * b.block_q, j * b.block_k)
    return jnp.where(keep, p / (1.0 - b.dropout), 0.0)


def _masks(b: Blocking, mask, rows: slice, start: int, count: int):
    """(per key block operands for the scan, operands fixed over the key blocks) of one query
    block's mask: a dense mask's blocks, or the factors' (see _factor_stack)."""
    if mask is None:
        return None, None
    if not b.factors:
        return _mask_stack(mask, rows, start, count, b.block_k), None
    return documents.factor_stack(documents.factor_rows(mask, rows), start, count, b.block_k)


def _block_mask(b: Blocking, mask_j, fixed):
    return documents.factor_mask(b, documents.factor_block(b, mask_j, fixed)) if b.factors and fixed is not None else mask_j


def _skipping(b: Blocking, compute, seen, skip):
    """The scan step: `compute`, or under `skip_at_run_time` a lax.cond that runs `skip` for a
    key block its factors hide (`seen`: the query block's row of block_visibility)."""
    if seen is None:
        return compute

    def step(carry, x):
        return lax.cond(seen[x[3]], compute, skip, carry, x)
    return step


def _seen(b: Blocking, mask):
    """block_visibility of a call that skips at run time, else None."""
    return documents.block_visibility(b, mask) if b.factors and b.skip_at_run_time and not b.keeps_weights else None


def _forward_block(b: Blocking, q, k, v, mask, key, i: int, seen=None):
    """Output (..., bq, Dv), log-sum-exp (..., bq) and, for one block, the weights of query block i."""
    rows = slice(i * b.block_q, (i + 1) * b.block_q)
    q_i, blocks = q[..., rows, :], b.key_blocks(i)
    start, count = blocks.start, len(blocks)
    mask_xs, fixed = _masks(b, mask, rows, start, count)
    xs = (_key_stack(k, start, count, b.block_k), _key_stack(v, start, count, b.block_k), mask_xs,
          jnp.arange(start, start + count, dtype=jnp.int32))
    zero = _zeros_like_rows(q_i, 1, jnp.float32)[..., 0]  # (..., bq)

    def compute(carry, x):
        m, l, acc = carry
        k_j, v_j, mask_j, j = x
        s = _scores(b, q_i, k_j, _block_mask(b, mask_j, fixed), i * b.block_q, j * b.block_k)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row masked so far: no NaN from -inf - -inf
        p = jnp.exp(s - m_safe[..., None])
        fade = jnp.exp(m - m_safe)
        l = l * fade + jnp.sum(p, axis=-1)
        pv = jnp.einsum("...hgqk,...hkd->...hgqd", _dropped(b, p, key, i, j).astype(v_j.dtype), v_j,
                        preferred_element_type=jnp.float32)
        return (m_new, l, acc * fade[..., None] + pv), (p if b.keeps_weights else None)

    step = _skipping(b, compute, None if seen is None else seen[i], lambda carry, x: (carry, None))
    init = (zero - jnp.inf, zero, _zeros_like_rows(q_i, v.shape[-1], jnp.float32))
    (m, l, acc), p = _scan(step, init, xs, count)
    seen = l > 0  # a fully masked row gives zeros (as torch's SDPA does), not 0/0
    inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    out = acc * inv[..., None]
    lse = jnp.where(seen, jnp.where(m == -jnp.inf, 0.0, m) + jnp.log(jnp.where(seen, l, 1.0)), jnp.inf)
    return out.astype(q.dtype), lse, (None if p is None else p * inv[..., None])  # p: (1, ..., bq, bk)


def _forward(b: Blocking, q, k, v, mask, key):
    """Padded inputs -> (out (..., Lp, Dv), lse (..., Lp), weights (1, ..., L, S) of one block or None)."""
    seen = _seen(b, mask)
    parts = [_forward_block(b, q, k, v, mask, key, i, seen) for i in range(b.n_q)]
    return (jnp.concatenate([o for o, _, _ in parts], axis=-2), jnp.concatenate([s for _, s, _ in parts], axis=-1),
            parts[0][2])


def _reduce_to(x, shape):
    """Sums x over the dims where `shape` broadcasts (size 1), keeping them."""
    axes = tuple(d for d, n in enumerate(shape) if n == 1 and x.shape[d] != 1)
    return jnp.sum(x, axis=axes, keepdims=True) if axes else x


def _backward_block(b: Blocking, res, d_out, i: int, want_dmask: bool, seen=None):
    """dq of query block i and, per key block it sees, (dk, dv, dmask) blocks."""
    q, k, v, mask, key, out, lse, weights = res
    rows = slice(i * b.block_q, (i + 1) * b.block_q)
    q_i, do_i, lse_i = q[..., rows, :], d_out[..., rows, :], lse[..., rows]
    delta = jnp.sum(do_i.astype(jnp.float32) * out[..., rows, :].astype(jnp.float32), axis=-1)  # (..., bq)
    blocks = b.key_blocks(i)
    start, count = blocks.start, len(blocks)
    mask_xs, fixed = _masks(b, mask, rows, start, count)
    xs = (_key_stack(k, start, count, b.block_k), _key_stack(v, start, count, b.block_k), mask_xs,
          jnp.arange(start, start + count, dtype=jnp.int32), weights)
    want_dmask = want_dmask and mask is not None and not b.factors and mask.dtype != jnp.bool_

    def compute(dq, x):
        k_j, v_j, mask_j, j, kept = x
        mask_j = _block_mask(b, mask_j, fixed)
        p = kept if kept is not None else \
            jnp.exp(_scores(b, q_i, k_j, mask_j, i * b.block_q, j * b.block_k) - lse_i[..., None])
        dp = jnp.einsum("...hgqd,...hkd->...hgqk", do_i, v_j, preferred_element_type=jnp.float32)
        dv = jnp.einsum("...hgqk,...hgqd->...hkd", _dropped(b, p, key, i, j).astype(do_i.dtype), do_i,
                        preferred_element_type=jnp.float32)
        ds = p * (_dropped(b, dp, key, i, j) - delta[..., None])  # (..., Hk, G, bq, bk)
        dq = dq + jnp.einsum("...hgqk,...hkd->...hgqd", ds, k_j, preferred_element_type=jnp.float32) * b.scale
        dk = jnp.einsum("...hgqk,...hgqd->...hkd", ds, q_i, preferred_element_type=jnp.float32) * b.scale
        dmask = _reduce_to(ds, mask_j.shape) if want_dmask else None
        return dq, (dk, dv, dmask)

    def skip(dq, x):
        k_j, v_j = x[0], x[1]
        # what compute's dk, dv vary over (inside shard_map)
        axes = frozenset().union(*map(vma.of, jax.tree.leaves((q_i, do_i, lse_i, delta, x, fixed))))
        zeros = lambda y: vma.widen(jnp.zeros(q_i.shape[:-4] + y.shape[-3:], jnp.float32), axes)  # (..., Hk, bk, d)
        return dq, (zeros(k_j), zeros(v_j), None)

    step = _skipping(b, compute, None if seen is None else seen[i], skip)
    dq, (dk, dv, dmask) = _scan(step, _zeros_like_rows(q_i, q.shape[-1], jnp.float32), xs, count)
    return dq, dk, dv, dmask


def _assemble_dmask(b: Blocking, mask, parts):
    """dmask blocks [query block][key block] (None = skipped) -> the mask's (padded) shape."""
    def row(i):
        zero = jnp.zeros(next(p for p in parts[i] if p is not None).shape, jnp.float32)
        return jnp.concatenate([zero if p is None else p for p in parts[i]], axis=-1)

    rows = [row(i) for i in range(b.n_q)]
    full = jnp.concatenate(rows, axis=-2) if mask.shape[-2] > 1 else functools.reduce(jnp.add, rows)
    return full.astype(mask.dtype)


def _backward(b: Blocking, res, d_out, want_dmask: bool = True):
    q, k, v, mask = res[:4]
    dq_parts, dk = [], [None] * b.n_k
    dv, dmask = [None] * b.n_k, [[None] * b.n_k for _ in range(b.n_q)]
    add = lambda acc, x: x if acc is None else acc + x
    seen = _seen(b, mask)
    for i in range(b.n_q):
        dq_i, dk_i, dv_i, dm_i = _backward_block(b, res, d_out, i, want_dmask, seen)
        dq_parts.append(dq_i)
        for t, j in enumerate(b.key_blocks(i)):
            dk[j], dv[j] = add(dk[j], dk_i[t]), add(dv[j], dv_i[t])
            if dm_i is not None:
                dmask[i][j] = dm_i[t]
    # key blocks no query block sees (causal, L < S) get zero gradients
    dk = [jnp.zeros(k.shape[:-2] + (b.block_k, k.shape[-1]), jnp.float32) if x is None else x for x in dk]
    dv = [jnp.zeros(v.shape[:-2] + (b.block_k, v.shape[-1]), jnp.float32) if x is None else x for x in dv]
    dq = jnp.concatenate(dq_parts, axis=-2).astype(q.dtype)
    dk = jnp.concatenate(dk, axis=-2).astype(k.dtype)
    dv = jnp.concatenate(dv, axis=-2).astype(v.dtype)
    d_mask = None if not want_dmask or mask is None or b.factors or mask.dtype == jnp.bool_ \
        else _assemble_dmask(b, mask, dmask)
    return dq, dk, dv, d_mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(b: Blocking, q, k, v, mask, key):
    return _forward(b, q, k, v, mask, key)[0]


def _attention_fwd(b: Blocking, q, k, v, mask, key):
    """With symbolic zeros: each input comes with whether it is differentiated; a mask that is not
    (HF's, built from positions and the batch) gets no L x S cotangent computed for it."""
    perturbed = mask is not None and not b.factors and mask.perturbed
    value = lambda x: None if x is None else x.value
    q, k, v = (value(x) for x in (q, k, v))
    key = tuple(value(x) for x in key) if isinstance(key, tuple) else value(key)  # (key, lead): placed
    mask = tuple(value(x) for x in mask) if b.factors else value(mask)
    out, lse, weights = _forward(b, q, k, v, mask, key)
    return out, ((q, k, v, mask, key, out, lse, weights), (jnp.zeros((0,)),) if perturbed else ())


def _attention_bwd(b: Blocking, saved, d_out):
    res, perturbed = saved
    q = res[0]
    if isinstance(d_out, jax.custom_derivatives.SymbolicZero):
        d_out = jnp.zeros(q.shape[:-1] + (res[2].shape[-1],), q.dtype)
    dq, dk, dv, d_mask = _backward(b, res, d_out, bool(perturbed))
    if b.factors:  # the factors (positions, documents) get no cotangent
        d_mask = tuple(None for _ in res[3])
    return dq, dk, dv, d_mask, (tuple(None for _ in res[4]) if isinstance(res[4], tuple) else None)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def attention_call(b: Blocking, q, k, v, mask, key):
    """The kernel's call on inputs padded to whole blocks (a lowering running it on shards):
    (..., Hk, G, Lp, Dv). `key`: the dropout key, or (key, flat index of q's leading positions)."""
    return _attention(b, q, k, v, mask, key)


def blockwise(q, k, v, mask, key, b: Blocking):
    """Attention of q (..., Hk, G, L, D) over k, v (..., Hk, S, D|Dv): (..., Hk, G, L, Dv).

    `mask`: None, boolean (True = attend) or additive, broadcastable to the scores with q's
    rank, or under `b.factors` the factor operands (a tuple); `key`: the dropout key (unused
    when b.dropout is 0)."""
    lp, sp = b.n_q * b.block_q, b.n_k * b.block_k
    q, k, v = _pad(q, -2, lp), _pad(k, -2, sp), _pad(v, -2, sp)
    if b.factors:
        mask = tuple(_pad(_pad(x, -1, sp), -2, lp) for x in mask)
    elif mask is not None:
        # the key dim is blocked, so it is made whole; a broadcast query dim stays 1
        mask = jnp.broadcast_to(mask, mask.shape[:-1] + (b.source,))
        mask = _pad(_pad(mask, -1, sp), -2, lp)
    # the marker: a lowering may compute the call another way (ring attention over a split sequence)
    with jax.named_scope(markers.name(b)):
        return _attention(b, q, k, v, mask, key)[..., :b.length, :]


def default_scale(dim: int) -> float:
    return 1.0 / math.sqrt(dim)
