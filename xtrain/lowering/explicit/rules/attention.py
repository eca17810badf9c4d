"""Partition rules of attention: cuDNN's fused attention (jax.nn.dot_product_attention on CUDA, which the
front end picks there: xtrain.frontend.sdpa) and Neuron's NKI flash-attention kernels
(xtrain.ir.kernels.neuron_attention).

Its forward and backward primitives take (batch, length, heads, dim) arrays and per-row
statistics (batch, heads, length); batch and heads are independent, so a split of either
(data parallel, tensor-parallel heads) stays local and each device runs the kernel on its
shard. The query's splits lead: keys and values with fewer heads (grouped-query) take its head
split where it divides them (contiguous shards keep each query head with its key/value head),
one key/value head stays whole. Lengths and head dims are made whole. Empty placeholder
operands (no bias, no mask) are replicated. The NKI kernels' operands are (batch, heads, length, dim) and their log-sum-exp
(batch, heads, 128, length / 128): batch and heads local alike; a sequence split over `context`
is an error (the front end picks the blockwise kernel, run as a ring, when the mesh has `context`).

The blockwise kernel's call (a custom_vjp) on a sequence split over the mesh axis `context`
runs as ring attention (`context_attention`, called by the custom_vjp rule).
"""
from __future__ import annotations

import dataclasses
import math

from jax import lax

from xtrain.errors import UnsupportedError
from xtrain.ir import markers
from xtrain.ir.kernels import attention_dropout as dropout_mask
from xtrain.ir.kernels import blockwise, documents
from xtrain.ir.kernels import neuron_attention as nki
from xtrain.lowering import collectives
from xtrain.lowering import ring_attention as ra
from xtrain.lowering import ulysses_attention as us
from xtrain.lowering import sharded as C
from xtrain.lowering.explicit.registry import bind, register, wrap
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Layout, Sharded
from xtrain.sharding.mesh import CONTEXT


def _target(shape: tuple, batch, heads) -> Layout:
    """(B, T, N, H) -> batch and heads split (one key/value head stays whole: multi-query);
    (B, N, T) statistics alike; anything else whole."""
    if len(shape) == 4:
        return Layout((batch, (), heads if shape[2] > 1 else (), ()))
    if len(shape) == 3:
        return Layout((batch, heads, ()))
    return Layout.replicated(len(shape))


def _heads(ctx: Context, args: list[Sharded]) -> tuple:
    """The query's head split where every 4-D operand can take it: a head count it divides (the
    contiguous shards keep each query head with its key/value head under grouped-query
    attention; keys and values whole are sliced) or one head; else heads whole."""
    heads = tuple(args[0].layout.dims[2])
    n = math.prod(ctx.sizes[a] for a in heads)
    return heads if all(a.shape[2] == 1 or a.shape[2] % n == 0 for a in args if a.ndim == 4) else ()


def _to_heads(ctx: Context, x: Sharded) -> Sharded:
    """Ulysses (Plan(context="ulysses")): a (B, T, N, H) operand or (B, N, T) statistics whose
    sequence is split over `context` moved to a head split by one all-to-all."""
    seq, heads = (1, 2) if x.ndim == 4 else (2, 1)
    if x.ndim not in (3, 4) or CONTEXT not in x.layout.dims[seq]:
        return x
    if x.layout.dims[seq][-1] != CONTEXT or ctx.context.degrees(ctx.sizes[CONTEXT])[1] != 1:
        raise UnsupportedError(f"cuDNN attention in {ctx.path or '<top level>'!r}: its sequence is split over "
                               f"{x.layout.dims[seq]}; the fused kernel takes whole sequences (Plan(context='ulysses') "
                               f"over the whole {CONTEXT!r} axis)")
    return C.move_split(ctx, x, seq, heads, (CONTEXT,))


def fused_attention(ctx: Context, eqn, args):
    """cuDNN attention on each device's batch / head shard (the query's; other operands moved to it).
    Under Ulysses the sequence split over `context` becomes a head split around the kernel (one
    all-to-all per operand and per (B, T, N, H) result, which goes back to the sequence split)."""
    args = [_to_heads(ctx, a) for a in C.resolve_all(ctx, args)]
    ulysses = args[0].ndim == 4 and CONTEXT in args[0].layout.dims[2]
    batch, heads = tuple(args[0].layout.dims[0]), _heads(ctx, args)
    args = [C.relayout(ctx, a, _target(a.shape, batch, heads)) for a in args]
    outs = bind(ctx, eqn, [a.value for a in args])
    layouts = [_target(tuple(v.aval.shape), batch, heads) for v in eqn.outvars]
    if eqn.primitive.name == "dot_product_attention_bwd_wrapper":  # dk, dv of one key/value head (multi-query)
        layouts[1:3] = [l.with_partial(heads) if v.aval.shape[2] == 1 else l  # sum over the query heads' devices
                        for l, v in zip(layouts[1:3], eqn.outvars[1:3])]
    results = [C.Sharded(o, l, tuple(v.aval.shape), v.aval.dtype) for o, l, v in zip(outs, layouts, eqn.outvars)]
    if ulysses:
        results = [C.move_split(ctx, r, 2, 1, (CONTEXT,)) if r.ndim == 4 else r for r in results]
        ctx.note(f"attention in {ctx.path or '<top level>'!r}: Ulysses over {CONTEXT!r}={ctx.sizes[CONTEXT]} "
                 "(all-to-all to a head split) around cuDNN's fused kernel")
    return wrap(eqn, [r.value for r in results], [r.layout for r in results])


register(fused_attention, "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper")


def _nki_to_heads(ctx: Context, x: Sharded) -> Sharded:
    """Ulysses: a (B, H, L, D) operand whose sequence is split over the whole `context` axis moved
    to a head split (one all-to-all); the log-sum-exp (B, H, 128, L / 128) stays as the forward
    kernel left it (head split)."""
    whole = x.ndim == 4 and x.layout.dims[2][-1:] == (CONTEXT,) and ctx.context.degrees(ctx.sizes[CONTEXT])[1] == 1
    return C.move_split(ctx, x, 2, 1, (CONTEXT,)) if whole else x  # else refused below, naming the fix


def nki_attention(ctx: Context, eqn, args):
    """The NKI forward or backward kernel on each device's batch / head shard: every operand is
    4-D with batch and heads first; the grid is computed from the per-device shapes when lowered.
    Under Ulysses the sequence split over `context` becomes a head split around the kernel (one
    all-to-all per (B, H, L, D) operand and result: q, k, v and the output; the backward's
    dq, dk, dv), the log-sum-exp kept head-split between the two kernels."""
    args = [_nki_to_heads(ctx, a) for a in C.resolve_all(ctx, args)]
    ulysses = CONTEXT in args[0].layout.dims[1] and ctx.sizes.get(CONTEXT, 1) > 1
    # the query's batch / head splits (an operand split otherwise is moved to them; a whole one sliced)
    batch, heads = (tuple(args[0].layout.dims[d]) for d in (0, 1))
    if ctx.sizes.get(CONTEXT, 1) > 1 and CONTEXT not in batch + heads:
        raise UnsupportedError(
            f"attention in {ctx.path or '<top level>'!r}: Neuron's NKI flash-attention kernel on a mesh "
            f"with {CONTEXT!r}={ctx.sizes[CONTEXT]}; it computes whole sequences, so a ring over the split "
            f"sequence cannot run it. Use Plan(context='ulysses') (whole sequences per device, heads split "
            f"over {CONTEXT!r}), or compile through xtrain.compile (with {CONTEXT!r} in the mesh and a ring, "
            f"attention runs the blockwise kernel), or leave {CONTEXT!r} out of the mesh")
    target = Layout((batch, heads, (), ()))
    args = [C.relayout(ctx, a, target) for a in args]
    results = wrap(eqn, bind(ctx, eqn, [a.value for a in args]), [target] * len(eqn.outvars))
    if not ulysses:
        return results
    ctx.note(f"attention in {ctx.path or '<top level>'!r}: Ulysses over {CONTEXT!r}={ctx.sizes[CONTEXT]} "
             "(all-to-all to a head split) around the NKI flash-attention kernels")
    lse = 1 if eqn.primitive is nki.forward_p else None  # the forward's log-sum-exp stays head-split
    return [r if n == lse else C.move_split(ctx, r, 1, 2, (CONTEXT,)) for n, r in enumerate(results)]


register(nki_attention, nki.forward_p.name, nki.backward_p.name)


# -- the blockwise kernel over a sequence split along `context`: ring attention -------------------

def _splits_sequence(args) -> bool:
    q, k = args[0], args[1]
    return CONTEXT in q.layout.dims[-2] or CONTEXT in k.layout.dims[-2]


def _targets(q: Sharded, mask: list[Sharded], split_rows: bool):
    """q (..., Hk, G, L, D) with its leading splits and the sequence over `context`; k, v
    (..., Hk, S, D) alike; each mask operand (a mask, or a packed-documents mask's factors) with
    q's splits where it is not broadcast, keys whole, its rows over `context` (`split_rows`) or
    whole (Ulysses' groups and balanced chunks take theirs from it: _ulysses)."""
    n = q.ndim
    lead = tuple(tuple(a for a in d if a != CONTEXT) for d in q.layout.dims[:n - 2])
    tq = Layout(lead + ((CONTEXT,), ()))
    tk = Layout(lead[:n - 3] + ((CONTEXT,), ()))
    tm = [Layout(tuple(lead[d] if m.shape[d] == q.shape[d] else () for d in range(n - 2))
                 + ((CONTEXT,) if m.shape[n - 2] > 1 and split_rows else (), ())) for m in mask]
    return tq, tk, tm


def _check_not_gathered(ctx: Context, ring, args) -> None:
    """Attention whose operands vary over `context` on no dim: the sequence was gathered on
    the way (a padding to whole blocks, an op without a rule), so every device would attend
    over all of it. An error, not a silent loss of context parallelism."""
    if any(CONTEXT in a.layout.split_axes() for a in args[:3]):
        return  # `context` splits the batch here (a plan using it as a data axis)
    ra.check(ring, ctx.path or "<top level>")  # names a sequence that does not split, if that is why
    raise UnsupportedError(
        f"attention in {ctx.path or '<top level>'!r}: its sequence ({ring.call.length}) reaches the "
        f"attention whole on every device of mesh axis {CONTEXT!r} (an op before it gathered the "
        f"sequence), so context parallelism would not split it. A sequence that is not a multiple of "
        f"the attention block is padded to one: use a multiple of "
        f"{math.lcm(2 * ring.size, ring.call.block_q)}; else the report's all-gathers over {CONTEXT!r} "
        f"name the op")


def _lead_offsets(ctx: Context, q: Sharded) -> list:
    """Where this device's leading (batch..., Hk, G) positions of q start in the whole call."""
    return [collectives.axis_offset(ctx.sizes, axes) * n for axes, n in zip(q.layout.dims[:-2], q.value.shape[:-2])]


def _lead_index(ctx: Context, q: Sharded, heads: us.Ulysses | None = None, lead: tuple | None = None):
    """The flat global index of each of this device's leading (batch..., Hk, G) positions of q
    (`lead`: their shape after Ulysses' all-to-all), which places its attention dropout mask
    (xtrain.ir.kernels.attention_dropout)."""
    if heads is not None:
        return heads.lead_index(lead, _lead_offsets(ctx, q), q.shape[:-2])
    return dropout_mask.flat_index(q.value.shape[:-2], _lead_offsets(ctx, q), q.shape[:-2])


def _ulysses(ctx: Context, ring: ra.Ring, q: Sharded, mask: list[Sharded]):
    """The head split of this call (None: a ring alone) and each mask operand's rows that this
    device's queries take: as the ring split them, or, taken whole, the Ulysses group's sequence
    chunk or the balanced chunks (a mask must be the same for every head under Ulysses)."""
    heads, where, n = None, ctx.path or "<top level>", q.ndim
    if ring.inner > 1:
        heads = us.Ulysses(CONTEXT, ring.inner, ring.size, heads=q.value.shape[n - 4], group=q.value.shape[n - 3])
        heads.check(where, q.shape[n - 4] * q.shape[n - 3])
        for m in mask:
            if any(m.shape[d] > 1 for d in (n - 4, n - 3)):
                raise UnsupportedError(f"attention in {where!r}: a mask (or bias) of shape {m.shape} differs per head; "
                                       f"Ulysses splits the heads over {CONTEXT!r}. Use Plan(context='ring')")
    elif not ring.balanced:
        return None, [m.value for m in mask]
    return heads, [ra.mask_rows(ring, m.value) for m in mask]  # whole rows (_targets)


def _note(ctx: Context, ring: ra.Ring, heads: us.Ulysses | None, c: int, ordered: bool) -> None:
    where, causal = ctx.path or "<top level>", ring.call.causal
    skipped = ring.size - len(ring.steps)
    ring_text = (f"ring attention over {CONTEXT!r}={c}" if heads is None else
                 f"Ulysses in groups of {ring.inner} x ring attention over {ring.size} groups on {CONTEXT!r}={c}")
    if heads is not None and ring.size == 1:
        kv = heads.heads * heads.repeat // heads.size
        ctx.note(f"attention in {where!r}: Ulysses over {CONTEXT!r}={c} (all-to-all to a head split; {kv} key/value "
                 f"head{'s' if kv > 1 else ''} per device" + (", repeated" if heads.repeat > 1 else "") + ")")
        return
    if ring.balanced:
        ring_text += " (packed documents, ordered within each: load-balanced chunks)"
    elif ordered and ring.size > 1:
        b = ring.call
        ring_text += (f" (packed documents, ordered within each; not load-balanced: sequence {b.length} does not "
                      f"cut into {2 * ring.size} chunks of whole attention blocks ({b.block_q}); a multiple of "
                      f"{2 * ring.size * b.block_q} is balanced)")
    ctx.note(f"attention in {where!r}: {ring_text}" + (" (causal, load-balanced chunks)" if causal else "")
             + (f" ({skipped} of {ring.size} ring steps skipped: the mask's static band hides their chunks)"
                if skipped else ""))


def _count_blocks(ctx: Context, b: blockwise.Blocking, q: Sharded, factors: list[Sharded]) -> None:
    """Records the block pairs this call computes on this device (skipped ones left out), a
    pending sum over the axes that split its rows, for the step's outputs."""
    count = documents.executed_blocks(b, tuple(f.value for f in factors))
    ctx.count("attention_blocks", C.Sharded(count, Layout((), q.layout.split_axes()), (), count.dtype))


def documents_attention(ctx: Context, eqn, b: blockwise.Blocking, args):
    """The blockwise kernel with a mask of packed documents (Blocking.factors) on each device's
    own batch and heads, sequences whole: its run-time skip (lax.cond) then decides on the
    device's own documents, with no collective. The block pairs computed are counted."""
    args = list(C.resolve_all(ctx, args))
    key = args.pop() if b.dropout else None
    q, n = args[0], args[0].ndim
    lead = tuple(tuple(d) for d in q.layout.dims[:n - 2])
    tq, tk = Layout(lead + ((), ())), Layout(lead[:n - 3] + ((), ()))
    q, k, v = (C.relayout(ctx, a, t) for a, t in zip(args[:3], (tq, tk, tk)))
    factors = [C.relayout(ctx, f, Layout(tuple(lead[d] if f.shape[d] == q.shape[d] else () for d in range(n - 2))
                                         + ((), ()))) for f in args[3:]]
    drop = None if key is None else (C.relayout(ctx, key, Layout.replicated(key.ndim)).value, _lead_index(ctx, q))
    out = blockwise.attention_call(b, q.value, k.value, v.value, tuple(f.value for f in factors), drop)
    _count_blocks(ctx, b, q, factors)
    return wrap(eqn, [out], [tq])


def context_attention(ctx: Context, eqn, args):
    """The blockwise kernel's call on a sequence split over `context`: ring attention
    (xtrain.lowering.ring_attention), balanced under a causal mask. A call with a mask of packed
    documents runs on each device's rows (documents_attention) where the sequence is whole.
    None otherwise (the call is interpreted as any other)."""
    b = markers.innermost(blockwise.Blocking, eqn.source_info.name_stack)
    if b is not None and b.factors and (ctx.sizes.get(CONTEXT, 1) == 1 or not _splits_sequence(args)):
        return documents_attention(ctx, eqn, b, args)
    if b is None or ctx.sizes.get(CONTEXT, 1) == 1:
        return None
    # packed documents ordered within each document (HF: key position <= query position): triangular blocks per
    # document, balanced like a causal ring where the chunks are whole blocks (the mask stays exact either way)
    ordered = bool(set(b.factors) & {"le", "lt", "ge", "gt"})
    if b.causal and len(args) > (4 if b.dropout else 3):
        b = dataclasses.replace(b, causal=False)  # a mask with the causal flag (calls sharing one structure): exact alone
    c = ctx.sizes[CONTEXT]
    ulysses, rings = ctx.context.degrees(c)
    ring = ra.Ring(b, CONTEXT, rings, inner=ulysses)
    if ordered and rings > 1 and ring.balances:
        ring = dataclasses.replace(ring, balanced=True)
    if not _splits_sequence(args):
        _check_not_gathered(ctx, ring, args)
        return None
    ra.check(ring, ctx.path or "<top level>")
    args = list(C.resolve_all(ctx, args))
    key = args.pop() if b.dropout else None  # the kernel's operands: q, k, v[, mask | factors][, dropout key]
    mask = args[3:]
    tq, tk, tm = _targets(args[0], mask, ring.inner == 1 and not ring.balanced)
    q, k, v = (C.relayout(ctx, a, t) for a, t in zip(args[:3], (tq, tk, tk)))
    heads, m = _ulysses(ctx, ring, q, [C.relayout(ctx, a, t) for a, t in zip(mask, tm)])
    m = tuple(m) if b.factors else (m[0] if m else None)
    qv, kv, vv = (q.value, k.value, v.value) if heads is None else (
        heads.queries(q.value), heads.keys(k.value), heads.keys(v.value))
    if key is not None:
        drop = (C.relayout(ctx, key, Layout.replicated(key.ndim)).value, _lead_index(ctx, q, heads, qv.shape[:-2]))
    else:
        drop = None
    dim = q.ndim - 2
    if ring.halves and ring.size > 1:
        qv, kv, vv = (ra.balance(x, ring, dim if x is qv else dim - 1) for x in (qv, kv, vv))
        out = ra.unbalance(ra.ring_attention(ring, qv, kv, vv, m, drop), ring, dim)
    else:
        out = ra.ring_attention(ring, qv, kv, vv, m, drop)
    if b.factors:
        count = ra.executed_blocks(ring, qv.shape[-2], m)
        ctx.count("attention_blocks", C.Sharded(count, Layout((), tuple(dict.fromkeys(
            q.layout.split_axes() + (CONTEXT,)))), (), count.dtype))
    _note(ctx, ring, heads, c, ordered)
    return wrap(eqn, [out if heads is None else heads.output(out)], [tq])
