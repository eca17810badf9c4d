"""Expert parallelism: a routed-experts call (xtrain.ir.kernels.moe) whose experts are split over the
`expert` mesh axis. Each device sorts its own (token, expert) pairs by the device that holds
their expert, sends them there and gets the results back with one all-to-all each way
(dispatch, combine). The expert id travels as one extra column of the rows, so a layer's forward
is exactly two all-to-alls (and its backward two more, their transposes).

On CPU and Neuron (XLA:CPU has no ragged all-to-all) the buffers have a fixed capacity: every
device reserves room for all of its pairs for every peer (drop-free: capacity = tokens x top_k),
so each all-to-all moves `expert` times the routed rows. For CUDA (a step built for GPUs, or
compiled for one by xtrain.aot) a drop-free layer sends only its routed rows with
`lax.ragged_all_to_all` (`_ragged_routed`): the rows sorted by destination are already contiguous
per peer; one all-gather of the per-peer counts (peers x peers integers) gives every device where
its rows land at each peer and what it receives; the combine sends the results back the same
way; the transposes use the same offsets reversed (no exchange of offsets in the backward pass).
The receive buffer keeps the drop-free worst case (all pairs of every other peer), the wire only
the rows routed. The tokens go in CHUNKS chunks, so that one chunk's dispatch and another's combine
are in flight while another chunk's experts compute (XLA's latency-hiding scheduler places them).
A device never sends itself rows: the pairs routed to its own experts are a chunk of their own,
run without any all-to-all; the first chunk's while the layer's first dispatch is in flight (with
EP 8, an eighth of a chunk's rows), the last chunk's while its last combine is. Which collective
a GEMM hides is XLA's scheduler's choice: an expert mesh gets one more collective in flight
(xtrain.lowering.gpu_options), or its GEMMs went to ZeRO-3's gathers instead. (XLA's scheduling
groups, `_scheduling_group_id`, would pin a GEMM under an all-to-all; jaxlib 0.10.2's GPU compiler
crashes on one put on an all-to-all.)"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.errors import PlanError
from xtrain.ir import vma
from xtrain.ir.kernels import moe
from xtrain.lowering import collectives
from xtrain.sharding.mesh import EXPERT


def capacity(tokens: int, top_k: int) -> int:
    """Rows a device reserves per peer: all of its pairs (drop-free)."""
    return tokens * top_k


def _slots(sorted_ids, dest, peers: int, per_device: int, per_expert: int | None):
    """(each sorted pair's row in its destination's block (S,), rows per block): drop-free, all
    of a device's pairs; with a capacity, `per_expert` rows per expert, a dropped pair's row
    past the block (the scatter drops it, the gather back fills zeros)."""
    if per_expert is None:
        return moe.positions(dest, peers), dest.shape[0]
    place = moe.positions(sorted_ids, per_device * peers)  # within its expert
    block = per_device * per_expert
    return jnp.where(place < per_expert, sorted_ids % per_device * per_expert + place, block), block


def wire_dtype(x_dtype, spec: moe.ExpertsSpec, per_device: int):
    """The dtype rows cross the wire in: the experts' 16-bit compute dtype where x is wider, if it
    holds the expert ids (and the padding id `per_device`) exactly. The first GEMM casts the rows
    to it and the last one's products are in it, so the values are the same and the all-to-alls
    move half the bytes (a bf16 step's residual stream is float32, as under torch autocast)."""
    dtype = spec.compute_dtype(x_dtype)
    exact = dtype.itemsize == 2 and per_device <= 2 ** (jnp.finfo(dtype).nmant + 1)
    return dtype if exact and dtype.itemsize < jnp.dtype(x_dtype).itemsize else jnp.dtype(x_dtype)


def _dispatch(rows, local_ids, dest, slot, peers: int, block: int, per_device: int):
    """(S, H) rows and their expert ids (within the destination) -> (P, C, H + 1) send buffer;
    the unused rows carry the id `per_device`, which no local expert's group contains."""
    payload = jnp.concatenate([rows, local_ids[:, None].astype(rows.dtype)], axis=1)  # (S, H + 1)
    empty = jnp.zeros((peers, block, rows.shape[1] + 1), rows.dtype).at[:, :, -1].set(per_device)
    return empty.at[dest, slot].set(payload, mode="drop")


def _local_experts(received, up, down, spec: moe.ExpertsSpec, dtype, expected: int | None = None):
    """(P, C, H + 1) received rows -> (P, C, H), each through its expert on this device, computed
    as on rows of `dtype` (the layer's input: the wire dtype changes the bytes, not the values).
    `expected`: the rows the buffer holds on average, the rest padding the GEMMs skip at run time
    (None: every row computed, as Neuron needs)."""
    peers, cap, width = received.shape
    flat = received.reshape(peers * cap, width)
    rows, ids = flat[:, :-1].astype(dtype), lax.stop_gradient(flat[:, -1]).astype(jnp.int32)  # (P C, H), (P C,)
    order = jnp.argsort(ids, stable=True)
    out = moe._ffn(rows[order], moe.group_sizes(ids, up.shape[0]), up, down, spec, expected)  # padding rows: zero
    return out[jnp.argsort(order)].reshape(peers, cap, width - 1).astype(received.dtype)


CHUNKS = 2  # a GPU layer's tokens in chunks: one chunk's all-to-alls in flight while another's experts compute


def chunks(tokens: int) -> int:
    """The chunks a ragged layer of this device's `tokens` runs in: CHUNKS where they divide, else 1."""
    return CHUNKS if tokens % CHUNKS == 0 else 1


@jax.custom_vjp
def _ragged(x, buffer, there, back):
    """`buffer` with x's rows written where `there` (input offsets, send sizes, output offsets at
    each peer, receive sizes) sends them; the transpose sends the cotangent back by `back`, the
    reverse offsets, which the caller has already (JAX's own transpose would exchange offsets
    again, with two more all-to-alls per call)."""
    return collectives.ragged_all_to_all(x, buffer, *there, EXPERT)


def _ragged_fwd(x, buffer, there, back):
    return _ragged(x, buffer, there, back), (x[:, :0], back)  # x's rows, as a shape (and its mesh type)


def _ragged_bwd(res, t):
    rows, back = res
    return collectives.ragged_all_to_all(t, _buffer(rows.shape[0], t), *back, EXPERT), None, None, None


_ragged.defvjp(_ragged_fwd, _ragged_bwd)


def _buffer(rows: int, like, fill=None):
    """Zero rows (a last column of `fill`) typed as varying like `like`: a ragged all-to-all's
    receiving buffer (else autodiff sums its zero cotangent over the mesh)."""
    out = jnp.zeros((rows,) + like.shape[1:], like.dtype)
    return vma.widen(out if fill is None else out.at[:, -1].set(fill), vma.of(like))


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One chunk of a layer's tokens routed by ragged all-to-all.

    Attributes:
        order: its (token, expert) pairs sorted by expert (S,).
        mine: which sorted pairs go to this device's own experts (S,): never sent.
        payload: the sorted pairs' rows with their expert's id on its device (S, H + 1), in the wire dtype.
        scale: the sorted pairs' gate weights (S, 1), in the layer input's dtype.
        dispatch: the dispatch's (input offsets, send sizes, output offsets at each peer, receive sizes).
        combine: the same for the combine, its reverse.
    """

    order: Any
    mine: Any
    payload: Any
    scale: Any
    dispatch: tuple
    combine: tuple


def _chunk(x, expert_ids, weights, per_device: int, peers: int, wire) -> _Chunk:
    """A chunk's pairs sorted by expert (so by destination device, each peer's rows contiguous)
    and where they go: one all-gather of every device's rows per peer (peers x peers integers).
    A device's rows for itself are not sent (its own experts run them: `_own`)."""
    k = expert_ids.shape[1]
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    here = lax.axis_index(EXPERT)
    count = jnp.zeros((peers,), jnp.int32).at[sorted_ids // per_device].add(1)  # rows for each peer
    sizes = collectives.all_gather(count, (EXPERT,), 0, tiled=False)  # sizes[i, j]: device i's rows for device j
    starts = jnp.cumsum(sizes, axis=1) - sizes  # where device i's rows for device j start in its own buffer
    sent = jnp.where(jnp.eye(peers, dtype=bool), 0, sizes)  # the rows that travel: none to oneself
    before = jnp.cumsum(sent, axis=0) - sent  # where device i's rows land at device j
    recv = sent[:, here]
    payload = jnp.concatenate([x[order // k].astype(wire), (sorted_ids % per_device)[:, None].astype(wire)], axis=1)
    return _Chunk(order, sorted_ids // per_device == here, payload, weights.reshape(-1)[order][:, None].astype(x.dtype),
                  (starts[here], sent[here], before[here], recv), (before[:, here], recv, starts[:, here], sent[here]))


def _own(c: _Chunk, up, down, spec: moe.ExpertsSpec, peers: int, skip: bool):
    """The chunk's pairs routed to this device's experts through them, in the chunk's sorted
    order (S, H); the other pairs' rows are padding (theirs come back by the combine)."""
    per_device = up.shape[0]
    rows = c.payload.at[:, -1].set(jnp.where(c.mine, c.payload[:, -1], per_device))
    expected = -(-rows.shape[0] // peers) if skip else None  # an even load: 1 / peers of them
    return _local_experts(rows[None], up, down, spec, c.scale.dtype, expected)[0]


def _unsorted(rows, order, k: int):
    """Sorted pairs' (S, H) rows back in token order, each token's k summed: (S / k, H)."""
    return rows[jnp.argsort(order)].reshape(-1, k, rows.shape[1]).sum(axis=1)


def _ragged_routed(x, expert_ids, weights, up, down, spec: moe.ExpertsSpec, peers: int, count: int, skip: bool):
    """The drop-free layer sending only routed rows (module docstring), its tokens in `count` chunks:
    chunk i's experts run after chunk i-1's (an optimization barrier: XLA would otherwise merge
    their GEMMs or fuse their gathers into one kernel waiting on both dispatches), so chunk i's
    dispatch and chunk i-1's combine are in flight while experts compute; the first chunk's own
    pairs (never sent) run during the first dispatch, the others' once the last combine can start."""
    n, k = expert_ids.shape
    m, per_device = n // count, up.shape[0]
    wire = wire_dtype(x.dtype, spec, per_device)
    parts = [_chunk(x[i * m:(i + 1) * m], expert_ids[i * m:(i + 1) * m], weights[i * m:(i + 1) * m], per_device, peers,
                    wire) for i in range(count)]
    others = max(peers - 1, 1)  # the peers a device receives from: never itself
    received = [_ragged(c.payload, _buffer(others * c.payload.shape[0], c.payload, per_device), c.dispatch, c.combine)
                for c in parts]  # padding rows carry the id per_device, which no local expert has
    combine = lambda c, done: _ragged(done, _buffer(c.payload.shape[0], done), c.combine, c.dispatch)
    own = [_own(parts[0], up, down, spec, peers, skip)] + [None] * (count - 1)
    received[0], own[0] = lax.optimization_barrier((received[0], own[0]))  # own rows first, the dispatch in flight
    done, back = [None] * count, [None] * count
    for i, c in enumerate(parts):
        if i:  # chunk i's experts after chunk i-1's, whose combine then starts
            received[i], done[i - 1] = lax.optimization_barrier((received[i], done[i - 1]))
            back[i - 1] = combine(parts[i - 1], done[i - 1])
        held = received[i].reshape(others, c.payload.shape[0], -1)  # even: 1 / peers of each other peer's rows
        expected = -(-c.payload.shape[0] * others // peers) if skip else None
        done[i] = _local_experts(held, up, down, spec, x.dtype, expected).reshape(held.shape[0] * held.shape[1], -1)
        if i:  # chunk i-1's combine completes while chunk i's experts compute
            back[i - 1], done[i] = lax.optimization_barrier((back[i - 1], done[i]))
    if count > 1:  # the other chunks' own rows once the last combine can start
        done[-1], *later = lax.optimization_barrier((done[-1], *(c.payload for c in parts[1:])))
        parts[1:] = [dataclasses.replace(c, payload=p) for c, p in zip(parts[1:], later)]
    back[-1] = combine(parts[-1], done[-1])
    if count > 1:
        own[1:] = [_own(c, up, down, spec, peers, skip) for c in parts[1:]]
        back[-1], *own[1:] = lax.optimization_barrier((back[-1], *own[1:]))
    return jnp.concatenate([_unsorted(jnp.where(c.mine[:, None], o, b) * c.scale, c.order, k)
                            for c, b, o in zip(parts, back, own)]).astype(x.dtype)


def routed_experts(x, expert_ids, weights, up, down, *, spec: moe.ExpertsSpec, peers: int,
                   per_expert: int | None = None, ragged: bool = False, skip_padding: bool = False):
    """moe.routed_experts on this device's tokens with the experts split over `expert` in
    `peers` blocks: x (N, H), expert_ids / weights (N, k), up / down (E / peers, ...) -> (N, H).
    `per_expert`: each expert's capacity (pairs past it dropped); None: drop-free. `ragged`
    (drop-free only): send only the routed rows (lax.ragged_all_to_all; not on CPU), the tokens
    in CHUNKS chunks where they divide. `skip_padding`: the experts' FFN runs only the rows a
    receive buffer holds (a loop count known at run time: CUDA), the cost counted for an even load."""
    n, k = expert_ids.shape
    if ragged and per_expert is None:
        return _ragged_routed(x, expert_ids, weights, up, down, spec, peers, chunks(n), skip_padding)
    per_device = up.shape[0]
    flat = expert_ids.reshape(-1).astype(jnp.int32)  # (S,)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    dest = sorted_ids // per_device  # (S,) the device holding each pair's expert
    slot, block = _slots(sorted_ids, dest, peers, per_device, per_expert)
    rows = x[order // k].astype(wire_dtype(x.dtype, spec, per_device))  # the gather's gradient summed in x's dtype
    send = _dispatch(rows, sorted_ids % per_device, dest, slot, peers, block, per_device)  # (P, C, H + 1)
    received = collectives.all_to_all(send, (EXPERT,), 0)  # block j: device j's pairs for my experts
    expected = min(n * k, received.shape[0] * received.shape[1]) if skip_padding else None  # even: n k pairs
    done = _local_experts(received, up, down, spec, x.dtype, expected)  # (P, C, H)
    back = collectives.all_to_all(done, (EXPERT,), 0)  # block j: my pairs, computed on device j
    out = back.at[dest, slot].get(mode="fill", fill_value=0) * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return _unsorted(out, order, k).astype(x.dtype)


def paired_gate_up(whole, dim: int, index, parts: int):
    """This device's FFN features of a concatenated [gate; up] weight whose FFN dim `dim` (2 I)
    is whole: block `index` of `parts` of the gate rows, then the same of the up rows (the
    features the down weight's contiguous split gives this device)."""
    n = whole.shape[dim] // 2 // parts
    gate = lax.dynamic_slice_in_dim(whole, index * n, n, dim)
    up = lax.dynamic_slice_in_dim(whole, whole.shape[dim] // 2 + index * n, n, dim)
    return jnp.concatenate([gate, up], axis=dim)  # (..., 2 I / parts, ...)


def check(experts: int, top_k: int, peers: int, where: str) -> None:
    """The errors of an expert-parallel layer, naming the module."""
    if top_k > experts:
        raise PlanError(f"MoE layer {where!r} routes each token to top_k={top_k} of {experts} experts: "
                        f"top_k must be at most the number of experts")
    if experts % peers:
        raise PlanError(f"MoE layer {where!r} has {experts} experts, not divisible by the mesh axis "
                        f"{EXPERT!r} of size {peers}: use an {EXPERT!r} axis whose size divides {experts} "
                        f"(e.g. {math.gcd(experts, peers)})")
