"""Expert parallelism: a routed-experts call (xtrain.ir.kernels.moe) whose experts are split over the
`expert` mesh axis. Each device sorts its own (token, expert) pairs by the device that holds
their expert, sends them there and gets the results back with one all-to-all each way
(dispatch, combine), in buffers of fixed capacity: every device reserves room for all of its
pairs for every peer (drop-free: capacity = tokens x top_k), since XLA:CPU has no ragged
all-to-all. The expert id travels as one extra column of the dispatch buffer, so a layer's
forward is exactly two all-to-alls (and its backward two more, their transposes)."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from xtrain.errors import PlanError
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


def _dispatch(rows, local_ids, dest, slot, peers: int, block: int, per_device: int):
    """(S, H) rows and their expert ids (within the destination) -> (P, C, H + 1) send buffer;
    the unused rows carry the id `per_device`, which no local expert's group contains."""
    payload = jnp.concatenate([rows, local_ids[:, None].astype(rows.dtype)], axis=1)  # (S, H + 1)
    empty = jnp.zeros((peers, block, rows.shape[1] + 1), rows.dtype).at[:, :, -1].set(per_device)
    return empty.at[dest, slot].set(payload, mode="drop")


def _local_experts(received, up, down, spec: moe.ExpertsSpec):
    """(P, C, H + 1) received rows -> (P, C, H), each through its expert on this device."""
    peers, cap, width = received.shape
    flat = received.reshape(peers * cap, width)
    rows, ids = flat[:, :-1], lax.stop_gradient(flat[:, -1]).astype(jnp.int32)  # (P C, H), (P C,)
    order = jnp.argsort(ids, stable=True)
    out = moe._ffn(rows[order], moe.group_sizes(ids, up.shape[0]), up, down, spec)  # padding rows: zero
    return out[jnp.argsort(order)].reshape(peers, cap, width - 1)


def routed_experts(x, expert_ids, weights, up, down, *, spec: moe.ExpertsSpec, peers: int,
                   per_expert: int | None = None):
    """moe.routed_experts on this device's tokens with the experts split over `expert` in
    `peers` blocks: x (N, H), expert_ids / weights (N, k), up / down (E / peers, ...) -> (N, H).
    `per_expert`: each expert's capacity (pairs past it dropped); None: drop-free."""
    n, k = expert_ids.shape
    per_device = up.shape[0]
    flat = expert_ids.reshape(-1).astype(jnp.int32)  # (S,)
    order = jnp.argsort(flat, stable=True)
    sorted_ids = flat[order]
    dest = sorted_ids // per_device  # (S,) the device holding each pair's expert
    slot, block = _slots(sorted_ids, dest, peers, per_device, per_expert)
    send = _dispatch(x[order // k], sorted_ids % per_device, dest, slot, peers, block, per_device)  # (P, C, H + 1)
    received = collectives.all_to_all(send, (EXPERT,), 0)  # block j: device j's pairs for my experts
    done = _local_experts(received, up, down, spec)  # (P, C, H)
    back = collectives.all_to_all(done, (EXPERT,), 0)  # block j: my pairs, computed on device j
    out = back.at[dest, slot].get(mode="fill", fill_value=0) * weights.reshape(-1)[order][:, None].astype(x.dtype)
    return out[jnp.argsort(order)].reshape(n, k, -1).sum(axis=1).astype(x.dtype)


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
