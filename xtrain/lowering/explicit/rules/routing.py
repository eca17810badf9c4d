"""Partition rules of mixture-of-experts routing: the router's top-k and sorts (the sorted
dimension whole, every other dimension keeps its split), histograms of assignments
(scatter-add: local counts, summed where they are read), grouped matmuls (`ragged_dot`: rows and
group sizes whole, the experts' output features may stay split), and the routed-experts call
(xtrain.ir.kernels.moe), run on each device's own tokens: no token moves, no collective (parameters
split by ZeRO-3/FSDP are gathered as for any other use), unless its experts are split over the
`expert` axis: then tokens go to their experts and back by all-to-all (experts.py)."""
from __future__ import annotations

import dataclasses
import math

from xtrain.ir import markers
from xtrain.ir.kernels import moe
from xtrain.lowering import collectives
from xtrain.lowering import sharded as C
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit.rules import experts, indexing
from xtrain.lowering.explicit.registry import (bind, fallback, register, register_call, same_vma,
                                               whole_dims_where, wrap)
from xtrain.lowering.context import Context


def top_k(ctx: Context, eqn, args):
    """Top-k along one dim (the experts): that dim whole, rows keep their split."""
    x = C.resolve(ctx, args[0])
    axis = eqn.params.get("axis", eqn.params.get("reduction_dimension", x.ndim - 1)) % x.ndim
    x = whole_dims_where(ctx, x, lambda d: d == axis)
    return wrap(eqn, bind(ctx, eqn, [x.value]), [x.layout] * 2)


def sort(ctx: Context, eqn, args):
    """Sort (and argsort: the iota sorted along) of one dim: that dim whole in every operand,
    the others split as the first operand's."""
    dim = eqn.params["dimension"]
    first = whole_dims_where(ctx, C.resolve(ctx, args[0]), lambda d: d == dim)
    ops = [first] + [C.relayout(ctx, a, first.layout) for a in args[1:]]
    return wrap(eqn, bind(ctx, eqn, [a.value for a in ops]), [first.layout] * len(ops))


def ragged_dot(ctx: Context, eqn, args):
    """Grouped matmul (S, K) x (E, K, N) -> (S, N): rows, contraction and groups whole (a
    row's group is set by its position); the rhs's output features may stay split (a
    tensor-parallel expert FFN), and so does the output's last dim."""
    lhs, rhs, sizes = (C.resolve(ctx, a) for a in args[:3])
    dn = eqn.params["ragged_dot_dimension_numbers"]
    (_, r_contract), _ = dn.dot_dimension_numbers
    rhs_free = [d for d in range(rhs.ndim) if d not in r_contract and d not in dn.rhs_group_dimensions]
    lhs, sizes = C.replicate(ctx, lhs), C.replicate(ctx, sizes)
    if lhs.ndim != 2 or len(rhs_free) != 1:
        rhs = C.replicate(ctx, rhs)
    rhs = whole_dims_where(ctx, rhs, lambda d: d not in rhs_free)
    out_dims = ((),) * (lhs.ndim - 1) + (rhs.layout.dims[rhs_free[-1]],)
    return wrap(eqn, bind(ctx, eqn, [lhs.value, rhs.value, sizes.value] + [a.value for a in args[3:]]),
                [Layout(out_dims)])


def scatter_add(ctx: Context, eqn, args):
    """Scatter-add of many updates into a small whole operand (counts per expert, a histogram):
    each device adds its own updates, the result a pending sum over the axes that split them
    (the operand itself counted once, on the first device). Updates split elsewhere than
    along the index rows are gathered; so is an operand split at all."""
    dn = eqn.params["dimension_numbers"]
    if not dn.operand_batching_dims and len(args) == 3 and indexing.splits_scattered_rows(eqn, args):
        return indexing.scatter(ctx, eqn, args)  # an embedding gradient into a split table
    operand, indices, updates = (C.resolve(ctx, a) for a in args)
    if dn.operand_batching_dims:
        return fallback(ctx, eqn, args)
    rows = [d for d in range(updates.ndim) if d not in dn.update_window_dims]
    indices = whole_dims_where(ctx, indices, lambda d: d == indices.ndim - 1)
    row_split = Layout(tuple(indices.layout.dims[:-1]))  # index rows keep their split
    updates = C.relayout(ctx, updates, Layout(tuple(
        row_split.dims[rows.index(d)] if d in rows else () for d in range(updates.ndim))))
    axes = row_split.split_axes()
    operand = C.relayout(ctx, C.replicate(ctx, operand), Layout(((),) * operand.ndim, axes))
    return wrap(eqn, bind(ctx, eqn, [operand.value, indices.value, updates.value]),
                [Layout(((),) * operand.ndim, axes)])


def _expert_weights(ctx: Context, spec: moe.ExpertsSpec, up: C.Sharded, down: C.Sharded, token_axes):
    """The up / down weights as the call uses them: the experts dim split over `expert` where
    up's is, the FFN dim over the axes that split both weights' FFN dims and not the tokens
    (tensor parallel), every other dim whole; and those FFN axes."""
    u, d = moe.ffn_dims(spec)
    lead = (experts.EXPERT,) if experts.EXPERT in up.layout.dims[0] else ()
    ffn = tuple(up.layout.dims[u]) if up.layout.dims[u] == down.layout.dims[d] else ()
    ffn = () if set(ffn) & (set(token_axes) | {experts.EXPERT}) else ffn
    paired = bool(ffn) and spec.gated and spec.concatenated  # [gate; up] whole, this device's pairs sliced

    def placed(w, dim, axes):
        return C.relayout(ctx, w, Layout(tuple(lead if i == 0 else axes if i == dim else () for i in range(w.ndim))))

    up, down = placed(up, u, ffn), placed(down, d, ffn)
    if paired:  # gathered as varying: its backward is one reduce-scatter
        up = C.gather_dim(ctx, up, u, ffn, varying=True)
        index = collectives.axis_offset(ctx.sizes, ffn)
        up = dataclasses.replace(up, value=experts.paired_gate_up(up.value, u, index, math.prod(
            ctx.sizes[a] for a in ffn)))
    return up, down, ffn


def _count_tokens(ctx: Context, ids: C.Sharded, experts: int) -> None:
    """Records this layer's (token, expert) pairs per expert for the step's outputs: this
    device's count, a pending sum over the axes that split the tokens."""
    counts = moe.group_sizes(ids.value.reshape(-1).astype("int32"), experts)  # (E,)
    layout = Layout(((),), ids.layout.split_axes())
    ctx.count("expert_tokens", C.Sharded(counts, layout, (experts,), counts.dtype))


def _capacity(ctx: Context, ids: C.Sharded, experts: int) -> int | None:
    """Each expert's capacity of this device's pairs under the plan's capacity factor (None:
    drop-free); the pairs past it are counted for the step's outputs and noted."""
    if ctx.capacity_factor is None:
        return None
    tokens, k = ids.value.shape
    per_expert = moe.expert_capacity(tokens, k, experts, ctx.capacity_factor)
    where = ctx.path or "<top level>"
    ctx.note(f"capacity_factor={ctx.capacity_factor}: each expert of {where} takes at most {per_expert} of a "
             f"device's {tokens} tokens x top_k {k} pairs (ceil(tokens x top_k / experts {experts} x factor)); "
             "the rest are dropped, counted in step(...)['expert_dropped']")
    dropped = moe.dropped(ids.value, experts, per_expert)
    ctx.count("expert_dropped", C.Sharded(dropped, Layout((), ids.layout.split_axes()), (), dropped.dtype))
    return per_expert


def routed_experts(ctx: Context, eqn, args):
    """A routed-experts call (xtrain.ir.kernels.moe) on each device's own tokens: tokens keep their
    split, every other dim is whole; the experts' weights are gathered if split, except over
    `expert` (expert parallel: experts.routed_experts) and a tensor axis splitting their FFN
    dim (each device computes its FFN features; the output a pending sum over that axis)."""
    spec = markers.outermost(moe.ExpertsSpec, eqn.params["name"])
    x, ids, weights, up, down = args
    x = whole_dims_where(ctx, C.resolve(ctx, x), lambda d: d != 0)
    tokens = Layout((x.layout.dims[0], ()))
    ids, weights = (C.relayout(ctx, a, tokens) for a in (ids, weights))
    up, down, ffn = _expert_weights(ctx, spec, C.resolve(ctx, up), C.resolve(ctx, down), tokens.split_axes())
    _count_tokens(ctx, ids, up.shape[0])
    per_expert = _capacity(ctx, ids, up.shape[0])
    values = same_vma(ctx, [x.value, ids.value, weights.value, up.value, down.value])
    if experts.EXPERT in up.layout.dims[0]:  # expert parallel: tokens travel to their experts
        peers = ctx.sizes[experts.EXPERT]
        experts.check(up.shape[0], ids.shape[1], peers, ctx.path)
        cap = experts.capacity(x.value.shape[0], ids.shape[1])
        ragged = ctx.platform == "cuda" and per_expert is None
        cap, how = (cap, "this device's tokens x top_k: drop-free") if per_expert is None else (
            per_expert * up.shape[0] // peers, f"{per_expert} per expert")
        if ragged:
            chunks = experts.chunks(x.value.shape[0])
            ctx.note(f"expert parallel: {ctx.path or 'an MoE layer'} dispatches and combines by ragged all-to-all "
                     f"over {experts.EXPERT!r}: each device sends its {cap} routed rows x {x.shape[1]} features "
                     f"(+1 for the expert id) each way, but those for its own experts, which run them meanwhile; "
                     f"received into a buffer of {cap * max(peers - 1, 1)} rows; "
                     f"in {chunks} chunk{'s' if chunks > 1 else ''}"
                     + (", one chunk's all-to-alls in flight while another's experts compute" if chunks > 1 else ""))
        else:
            ctx.note(f"expert parallel: {ctx.path or 'an MoE layer'} dispatches and combines by all-to-all over "
                     f"{experts.EXPERT!r} with a capacity of {cap} rows per peer ({how}), {cap * peers} x "
                     f"{x.shape[1]} features each way per device")
        # Neuron compiles no loop whose count is known at run time only; a CPU step stays one it would run
        skip = ctx.platform == "cuda"
        ctx.note(f"expert parallel: {ctx.path or 'an MoE layer'}'s experts run " + (
            "only the rows its receive buffers hold, tile by tile (a loop count known at run time; costed for an "
            "even load)" if skip else "every row of its receive buffers, padding included (on CUDA only the rows "
            "they hold)"))
        out = experts.routed_experts(*values, spec=spec, peers=peers, per_expert=per_expert, ragged=ragged,
                                     skip_padding=skip)
        return wrap(eqn, [out], [Layout(tokens.dims, ffn)])
    return wrap(eqn, [moe.routed_experts(*values, spec=spec, capacity=per_expert)], [Layout(tokens.dims, ffn)])


register(top_k, "top_k", "approx_top_k")
register(sort, "sort")
register(ragged_dot, "ragged_dot_general")
register(scatter_add, "scatter-add", "scatter_add")
register_call(lambda name: markers.outermost(moe.ExpertsSpec, name) is not None, routed_experts)
