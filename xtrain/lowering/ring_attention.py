"""Ring attention: blockwise attention over a sequence split along the mesh axis `context`.

Each of the c devices of the ring holds a chunk of the queries, keys and values. Key/value
chunks travel around the ring (one collective permute per step) while each device combines
its queries' attention over every chunk with an online softmax across steps (the per-chunk
output and log-sum-exp, merged). The derivative rule rings again: key/value chunks travel with
their dK/dV accumulators, which arrive back home after the last step; only the output and the
log-sum-exp are kept from the forward pass (an optimization barrier keeps XLA from reusing the
forward's passes instead, which would hold every chunk until the backward pass). The per-chunk work is the blockwise kernel
(xtrain.ir.kernels.blockwise), its own forward and backward.

Skipped steps: without balancing, a ring step whose key/value chunk the call's static band (a sliding
window: Blocking.visible) hides from every device is not computed, and the chunks hop past it.

Inside hybrid context parallelism (xtrain.sharding.context_parallel) the ring runs over the
groups of `inner` neighbouring devices that Ulysses formed: ring position i is devices
i x inner ... i x inner + inner - 1, and each device passes its chunk to the device of the same
place in the next group.

Load balance under a causal mask: the sequence is cut into 2c chunks and device i computes
with chunks i and 2c-1-i (`balance` moves them there from the contiguous split, `unbalance`
moves the output back), so every device does the same work at every step: at step 0 its own
two chunks under the causal mask, later either all its queries against the arriving first
chunk (it comes from a device of lower index) or its second query chunk against both arriving
chunks (from a higher index). Without a causal mask every device computes all pairs and no
balancing is needed.

Packed documents (a mask of per-token comparisons, Blocking.factors) ordered within each document
(HF's `key position <= query position`) are triangular per document: their ring runs on the same
balanced chunks (`Ring.balanced`; without the causal flag, the mask is exact alone), each step the
device's two query chunks over the source's two key chunks, the blocks the mask hides (other
documents, later tokens) skipped at run time. Contiguous chunks would leave the last device the most
blocks and the first the fewest.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.errors import InputError, UnsupportedError
from xtrain.ir.kernels import attention_dropout as dm
from xtrain.ir.kernels import blockwise as bw
from xtrain.ir.kernels import documents
from xtrain.lowering import collectives


@dataclasses.dataclass(frozen=True)
class Ring:
    """One attention call on a ring of `size` devices along mesh axis `axis`.

    Attributes:
        call: the call's blocking over the whole sequence (scale, causal, block sizes).
        axis: the context axis.
        size: the ring's positions (the axis size, or under hybrid context parallelism the
            number of Ulysses groups).
        inner: devices per ring position (the Ulysses group size; 1: a plain ring).
        balanced: a call without the causal flag (a mask of packed documents) on the balanced
            chunks i and 2c-1-i (`balance`); with the flag, the chunks are balanced anyway.
    """

    call: bw.Blocking
    axis: str
    size: int
    inner: int = 1
    balanced: bool = False

    def position(self):
        """This device's place on the ring."""
        return lax.axis_index(self.axis) // self.inner if self.inner > 1 else lax.axis_index(self.axis)

    def devices(self, pairs) -> list[tuple[int, int]]:
        """(from, to) ring positions as (from, to) devices of the axis, each place in a group to its own."""
        return [(a * self.inner + u, b * self.inner + u) for a, b in pairs for u in range(self.inner)]

    @property
    def halves(self) -> bool:
        """Whether each device holds two chunks, i and 2c-1-i (causal or balanced)."""
        return self.call.causal or self.balanced

    @property
    def chunk(self) -> int:
        """Tokens per balancing chunk (causal or balanced) or per device."""
        return self.call.length // (2 * self.size if self.halves else self.size)

    @property
    def balances(self) -> bool:
        """Whether the sequence cuts into 2c balancing chunks of whole attention blocks."""
        n = self.call.length // (2 * self.size)
        return self.call.length % (2 * self.size) == 0 and n > 0 and n % min(self.call.block_q, n) == 0

    @property
    def block(self) -> int:
        return min(self.call.block_q, self.chunk)

    def piece(self, length: int, source: int, causal: bool, masked: bool = False) -> bw.Blocking:
        """The blocking of one chunk's call; `masked`: it takes the call's mask (a mask of packed
        documents: its factors and their run-time skip)."""
        b = self.call
        bq, bk = min(self.block, length), min(self.block, source)
        factors = b.factors if masked else ()
        skip = bool(factors) and b.skip_at_run_time and (-(-length // bq)) * (-(-source // bk)) > 1
        return bw.Blocking(b.scale, causal, bq, bk, length, source, b.dropout, factors=factors, skip_at_run_time=skip)

    def pairs(self, hop: int) -> list[tuple[int, int]]:
        """Each device sends to the one `hop` places further round the ring."""
        return self.devices([(i, (i + hop) % self.size) for i in range(self.size)])

    @property
    def steps(self) -> tuple[int, ...]:
        """The ring steps t some device computes: all, but (no balancing) those whose key chunk
        (from device i - t) the call's static band (Blocking.visible, a sliding window) hides
        from every device's queries, which are skipped with their permutes."""
        b, c, n = self.call, self.size, self.chunk
        if not b.visible or self.halves:
            return tuple(range(c))

        def sees(d: int, s: int) -> bool:  # a query block over chunk d sees a key block over chunk s
            blocks = range(d * n // b.block_q, ((d + 1) * n - 1) // b.block_q + 1)
            spans = (b.visible[i] for i in blocks)
            return any(lo * b.block_k < (s + 1) * n and hi * b.block_k > s * n for lo, hi in spans)

        return tuple(t for t in range(c) if t == 0 or any(sees(d, (d - t) % c) for d in range(c)))


def check(ring: Ring, where: str) -> None:
    """A clear error for what the ring does not compute."""
    b, c = ring.call, ring.size
    fix = f"use a sequence that is a multiple of {2 * c * ring.block} (2 x context x block)"
    if b.length != b.source:
        raise UnsupportedError(f"attention in {where!r}: {b.length} queries over {b.source} keys; context parallelism "
                               f"(mesh axis {ring.axis!r}={c}) splits self-attention over one sequence only")
    if b.length % (2 * c) or ring.chunk % ring.block:
        raise InputError(f"attention in {where!r}: sequence {b.length} does not split into {2 * c} chunks of whole "
                         f"attention blocks (block {ring.block}) over mesh axis {ring.axis!r}={c}; {fix}")


# -- per-piece forward and backward (the blockwise kernel on chunks) ------------------------------

def _piece_forward(b: bw.Blocking, q, k, v, mask, drop=None):
    """(out f32, lse with -inf for rows that saw nothing) of q over k, v; `drop` places the
    piece's dropout mask (xtrain.ir.kernels.attention_dropout.Drop)."""
    out, lse, _ = bw._forward(b, q, k, v, mask, drop)
    return out.astype(jnp.float32), jnp.where(lse == jnp.inf, -jnp.inf, lse)


def _piece_backward(b: bw.Blocking, q, k, v, mask, out, lse, d_out, drop=None):
    dq, dk, dv, _ = bw._backward(b, (q, k, v, mask, drop, out, lse, None), d_out, want_dmask=False)
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


def _merge(acc, new):
    """Two (out, lse) partials over disjoint keys as one (the online softmax across steps)."""
    (out_a, lse_a), (out_b, lse_b) = acc, new
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    return out_a * jnp.exp(lse_a - safe)[..., None] + out_b * jnp.exp(lse_b - safe)[..., None], lse


def _rows(x, start: int, size: int):
    return lax.slice_in_dim(x, start, start + size, axis=x.ndim - 2) if x is not None else None


def _chunks(ring: Ring, x, holder, dim: int):
    """The sequence positions (dim `dim` of x, whole) ring position `holder` holds: its chunk, or
    (balanced) its chunks holder and 2c-1-holder."""
    n = ring.chunk
    first = lax.dynamic_slice_in_dim(x, holder * n, n, axis=dim)
    if not ring.halves:
        return first
    return jnp.concatenate([first, lax.dynamic_slice_in_dim(x, (2 * ring.size - 1 - holder) * n, n, axis=dim)], dim)


def _mask_cols(ring: Ring, mask, source):
    """The mask's columns of the key chunks held by ring position `source` (non-causal ring);
    a mask of packed documents: each factor operand's (one with a single column as it is)."""
    if mask is None:
        return None
    cut = lambda x: _chunks(ring, x, source, x.ndim - 1) if x.shape[-1] > 1 else x
    return tuple(cut(x) for x in mask) if isinstance(mask, tuple) else cut(mask)


def mask_rows(ring: Ring, x):
    """The rows (dim -2) of a whole mask operand that this ring position's queries take (one row as it is)."""
    return _chunks(ring, x, ring.position(), x.ndim - 2) if x.shape[-2] > 1 else x


def executed_blocks(ring: Ring, q_rows: int, mask):
    """The block pairs this device's pieces compute over the ring's steps (int32), for a mask
    of packed documents (the blocks a piece skips at run time left out)."""
    here = ring.position()
    piece = ring.piece(q_rows, q_rows, False, masked=True)
    return sum(documents.executed_blocks(piece, _mask_cols(ring, mask, (here - t) % ring.size)) for t in ring.steps)


def _pad_rows(x, before: int, after: int):
    widths = [(0, 0)] * x.ndim
    widths[-2] = (before, after)
    return jnp.pad(x, widths)


def _positions(ring: Ring, holder, n: int):
    """Global sequence positions of the n rows ring position `holder` holds: its chunk, or
    (causal or balanced) its chunks holder and 2c-1-holder."""
    if not ring.halves:
        return holder * n + lax.iota(jnp.int32, n)
    h, ramp = ring.chunk, lax.iota(jnp.int32, ring.chunk)
    return jnp.concatenate([holder * h + ramp, (2 * ring.size - 1 - holder) * h + ramp])


def _placed(drop, here, source, n: int, ring: Ring):
    """The step's dropout placement: this device's query rows over the key chunk from `source`."""
    if drop is None:
        return None
    key, lead = drop
    return dm.Drop(key, lead, _positions(ring, here, n), _positions(ring, source, n))


def _part(d, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
    """A Drop for the (start, size) rows and columns of its chunk (None: all)."""
    if d is None:
        return None
    cut = lambda x, r: x if r is None else lax.slice_in_dim(x, r[0], r[0] + r[1])
    return dataclasses.replace(d, rows=cut(d.rows, rows), cols=cut(d.cols, cols))


def _late_forward(ring: Ring, lower, q, k, v, d):
    """Causal step > 0: all queries over the first arriving chunk (from a lower device), or the
    second query chunk over both arriving chunks (from a higher one)."""
    h = ring.chunk

    def from_lower():
        return _piece_forward(ring.piece(2 * h, h, False), q, _rows(k, 0, h), _rows(v, 0, h), None,
                              _part(d, cols=(0, h)))

    def from_higher():
        out, lse = _piece_forward(ring.piece(h, 2 * h, False), _rows(q, h, h), k, v, None, _part(d, rows=(h, h)))
        lse = jnp.concatenate([jnp.full(lse.shape[:-1] + (h,), -jnp.inf, lse.dtype), lse], axis=-1)
        return _pad_rows(out, h, 0), lse

    return lax.cond(lower, from_lower, from_higher)


def _late_backward(ring: Ring, lower, q, k, v, out, lse, d_out, d):
    h = ring.chunk

    def from_lower():
        dq, dk, dv = _piece_backward(ring.piece(2 * h, h, False), q, _rows(k, 0, h), _rows(v, 0, h), None,
                                     out, lse, d_out, _part(d, cols=(0, h)))
        return dq, _pad_rows(dk, 0, h), _pad_rows(dv, 0, h)

    def from_higher():
        second = lambda x: _rows(x, h, h)
        dq, dk, dv = _piece_backward(ring.piece(h, 2 * h, False), second(q), k, v, None, second(out),
                                     lse[..., h:], second(d_out), _part(d, rows=(h, h)))
        return _pad_rows(dq, h, 0), dk, dv

    return lax.cond(lower, from_lower, from_higher)


def _step_forward(ring: Ring, t: int, here, source, q, k, v, mask, drop):
    n, d = q.shape[-2], _placed(drop, here, source, q.shape[-2], ring)
    if not ring.call.causal:
        return _piece_forward(ring.piece(n, n, False, mask is not None), q, k, v, _mask_cols(ring, mask, source), d)
    if t == 0:
        return _piece_forward(ring.piece(n, n, True), q, k, v, None, d)
    return _late_forward(ring, source < here, q, k, v, d)


def _step_backward(ring: Ring, t: int, here, source, q, k, v, mask, drop, out, lse, d_out):
    n, d = q.shape[-2], _placed(drop, here, source, q.shape[-2], ring)
    if not ring.call.causal:
        return _piece_backward(ring.piece(n, n, False, mask is not None), q, k, v, _mask_cols(ring, mask, source),
                               out, lse, d_out, d)
    if t == 0:
        return _piece_backward(ring.piece(n, n, True), q, k, v, None, out, lse, d_out, d)
    return _late_backward(ring, source < here, q, k, v, out, lse, d_out, d)


# -- the ring -------------------------------------------------------------------------------------

def _pass(ring: Ring, hop: int, *xs):
    return [collectives.permute(x, ring.axis, ring.pairs(hop)) for x in xs]


def _ring_forward(ring: Ring, q, k, v, mask, drop):
    here, acc, held = ring.position(), None, 0
    for t in ring.steps:  # the key/value chunk of step t comes from t - held places back (skipped steps: one hop)
        k, v = (k, v) if t == held else _pass(ring, t - held, k, v)
        part = _step_forward(ring, t, here, (here - t) % ring.size, q, k, v, mask, drop)
        acc, held = (part if acc is None else _merge(acc, part)), t
    out, lse = acc
    return out.astype(q.dtype), jnp.where(lse == -jnp.inf, jnp.inf, lse)  # +inf: the kernel's "saw nothing"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def ring_attention(ring: Ring, q, k, v, mask, drop=None):
    """Local q (..., Hk, G, n, D), k, v (..., Hk, n, D|Dv), mask None or (..., n|1, L) with the
    whole key sequence: this device's attention output (..., Hk, G, n, Dv). `drop`: None, or
    (dropout key, flat global index of q's leading positions: xtrain.ir.kernels.attention_dropout)."""
    return _ring_forward(ring, q, k, v, mask, drop)[0]


def _ring_fwd(ring: Ring, q, k, v, mask, drop=None):
    out, lse = _ring_forward(ring, q, k, v, mask, drop)
    return out, (q, k, v, mask, drop, out, lse)


def _ring_bwd(ring: Ring, res, d_out):
    q, k, v, mask, drop, out, lse = res
    # k and v ring again from the cotangent's arrival: without the barrier XLA's CSE takes the
    # forward's passes for these and keeps every chunk alive from the forward to the backward
    k, v, d_out = lax.optimization_barrier((k, v, d_out))
    here = ring.position()
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    held = 0
    for t in ring.steps:  # the accumulators travel with their chunk
        k, v, dk, dv = (k, v, dk, dv) if t == held else _pass(ring, t - held, k, v, dk, dv)
        dq_t, dk_t, dv_t = _step_backward(ring, t, here, (here - t) % ring.size, q, k, v, mask, drop, out, lse, d_out)
        dq, dk, dv, held = dq + dq_t, dk + dk_t, dv + dv_t, t
    dk, dv = _pass(ring, ring.size - held, dk, dv) if held else (dk, dv)  # home
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)


# -- load balancing: contiguous halves <-> chunks i and 2c-1-i ------------------------------------

def _moves(c: int) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(source half, target half) -> (source device, target device) of each chunk j of 2c:
    contiguously, device j // 2 holds it as half j % 2; balanced, device j (j < c) as half 0,
    device 2c-1-j as half 1."""
    moves: dict = {}
    for j in range(2 * c):
        target = (j, 0) if j < c else (2 * c - 1 - j, 1)
        moves.setdefault((j % 2, target[1]), []).append((j // 2, target[0]))
    return moves


def _exchange(x, ring: Ring, moves, dim: int):
    halves = jnp.split(x, 2, axis=dim)
    here, out = ring.position(), [None, None]
    for (src, dst), pairs in moves.items():
        stay = [a for a, b in pairs if a == b]
        away = [(a, b) for a, b in pairs if a != b]
        parts = [collectives.permute(halves[src], ring.axis, ring.devices(away))] if away else []
        if stay:
            parts.append(jnp.where(jnp.isin(here, jnp.array(stay)), halves[src], jnp.zeros_like(halves[src])))
        for p in parts:
            out[dst] = p if out[dst] is None else out[dst] + p
    return jnp.concatenate(out, axis=dim)


def balance(x, ring: Ring, dim: int):
    """This ring position's contiguous slice of the sequence (dim `dim`) -> its chunks i and 2c-1-i."""
    return _exchange(x, ring, _moves(ring.size), dim)


def unbalance(x, ring: Ring, dim: int):
    """The inverse of `balance`."""
    inverse = {(dst, src): [(b, a) for a, b in pairs] for (src, dst), pairs in _moves(ring.size).items()}
    return _exchange(x, ring, inverse, dim)
