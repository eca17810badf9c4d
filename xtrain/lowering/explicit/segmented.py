"""Values split per segment (xtrain.sharding.segments) through the explicit lowering.

A fused weight stored per segment (`Segments(("tensor",), (q, k, v))`) gives a matmul output
whose dimension holds this device's slice of every segment (Layout.segments). The ops between the
weight and the slices that cut the segments apart carry that layout through; the slice of one
segment is then local (this device's rows of it), an ordinary split over the same axes: no
collective where a contiguous split would gather.

    positional ops   elementwise (all operands split per the same segments on the dim, or
                     broadcast along it), broadcast_in_dim, transpose, dot_general (a free dim),
                     reshape (the dim kept as it is), squeeze (a stacked parameter's layer row):
                     the rule runs on the plain split and the segments follow the dim
    into segments    a reshape of the dim into (segments, heads, ...) (a fused q | k | v into
                     (3, heads, head_dim)): the segments become a whole dim, the heads split
    into heads       a reshape of the dim into (heads, head_dim), each segment whole heads per
                     device (Falcon's q | k + v): the heads dim split per segment, in heads
    slice, split     one whole segment cut out: this device's slice of it, local; a piece of a
                     segment (MQA's key head, stored with the value head): that segment gathered
                     once, the piece whole on every device
    anything else    the value is gathered and put back in torch's order first (`unsegment`,
                     named in the report's notes), then the op's own rule runs: correct, never silent
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from xtrain.lowering import collectives
from xtrain.lowering import sharded as C
from xtrain.lowering.explicit.registry import RULES, out_avals, wrap
from xtrain.lowering.context import Context
from xtrain.lowering.sharded import Layout, Sharded
from xtrain.sharding.mesh import CONTEXT
from xtrain.sharding.segments import Segments


def _segmented(x) -> bool:
    return isinstance(x, Sharded) and bool(x.layout.segments)


def _plain(x):
    """`x` with its per-segment dims read as plain splits (the local array is unchanged)."""
    return dataclasses.replace(x, layout=Layout(x.layout.dims, x.layout.partial)) if _segmented(x) else x


def _parts(ctx: Context, axes) -> int:
    return math.prod(ctx.sizes[a] for a in axes)


def _order(sizes, axes, ctx: Context, outer: int = 0) -> np.ndarray:
    """Indices into torch's order, in the order a gather over `axes` joins the devices' slices:
    the first `outer` axes take the segments in contiguous blocks, the rest a slice of each."""
    blocks, inner = _parts(ctx, axes[:outer]), _parts(ctx, axes[outer:])
    per, bounds = len(sizes) // blocks, Segments(axes, sizes).bounds()
    return np.concatenate([Segments(axes, sizes[b * per:(b + 1) * per]).stored_order(inner) + bounds[b * per][0]
                           for b in range(blocks)])


def unsegment(ctx: Context, x: Sharded) -> Sharded:
    """`x` with every per-segment dim gathered over the axes that split each segment and put
    back in torch's order (axes that divide the segments among them stay: a contiguous split)."""
    for dim, sizes in x.layout.segments:
        axes, outer = x.layout.dims[dim], x.layout.outer_axes(dim)
        what = f"({len(sizes)} segments of {sizes[0]})" if len(set(sizes)) == 1 and len(sizes) > 4 else f"{sizes}"
        ctx.note(f"{ctx.path or 'top level'}: a value split per segment {what} over {axes} is read by an op "
                 f"without a per-segment rule: gathered over {axes[outer:]}")

        def gather(x=x, dim=dim, sizes=sizes, axes=axes, outer=outer):
            value = collectives.all_gather(x.value, axes[outer:], dim, invariant=True)
            dims = list(x.layout.dims)
            dims[dim] = axes[:outer]
            block = sizes[:len(sizes) // _parts(ctx, axes[:outer])]  # the segments this device holds
            order = np.argsort(_order(block, axes[outer:], ctx))
            return dataclasses.replace(x, value=jnp.take(value, order, axis=dim),
                                       layout=Layout(tuple(dims), x.layout.partial, *_without(x.layout, dim)))
        x = C.memoized(ctx, ("unsegment", id(x.value), x.layout, dim), x.value, gather)
    return x


def _without(layout: Layout, dim: int) -> tuple:
    """`layout`'s segments and outer entries but `dim`'s."""
    return tuple(s for s in layout.segments if s[0] != dim), tuple(o for o in layout.outer if o[0] != dim)


def _restore(ctx: Context, out: Sharded, dim: int, sizes, axes, outer: int = 0) -> Sharded:
    """`out`'s `dim` came from a per-segment dim: per segment again, or (a rule gathered it: whole
    in the stored order, or only its outer axes left: each block of segments whole) put back in
    torch's order."""
    have = out.layout.dims[dim]
    if have == axes:
        return dataclasses.replace(out, layout=Layout(out.layout.dims, out.layout.partial,
                                                      out.layout.segments + ((dim, sizes),),
                                                      out.layout.outer + (((dim, outer),) if outer else ())))
    assert have == axes[:outer] or not have, f"a per-segment dim over {axes} left as {have}"
    if have:  # the block of segments this device's outer axes hold, in the stored order of the inner ones
        sizes, axes, outer = sizes[:len(sizes) // _parts(ctx, have)], axes[outer:], 0
    return dataclasses.replace(out, value=jnp.take(out.value, np.argsort(_order(sizes, axes, ctx)), axis=dim))


def _localize(ctx: Context, a: Sharded, dim: int, like: Sharded, at: int) -> Sharded | None:
    """`a` (its `dim` whole, or split over the outer axes of `like`'s per-segment dim `at`) with
    that dim in `like`'s per-segment layout: this device's rows of it taken (no communication;
    an ALiBi bias added to scores over batch x heads), or None when it is split otherwise."""
    sizes, axes, outer = like.layout.segmented(at), like.layout.dims[at], like.layout.outer_axes(at)
    if a.layout.segmented(dim) or a.layout.dims[dim] not in ((), axes[:outer]) or a.layout.partial:
        return None
    table = _order(sizes, axes, ctx, outer).reshape(_parts(ctx, axes), -1)
    if a.layout.dims[dim]:  # its rows are those of this device's block of segments
        table = table - np.repeat(np.arange(_parts(ctx, axes[:outer])), _parts(ctx, axes[outer:]))[:, None] * \
            (a.shape[dim] // _parts(ctx, axes[:outer]))
    value = jnp.take(a.value, jnp.asarray(table, np.int32)[C.axis_offset(ctx, axes)], axis=dim)
    dims = list(a.layout.dims)
    dims[dim] = axes
    outer_entry = ((dim, outer),) if outer else ()
    return dataclasses.replace(a, value=value, layout=Layout(tuple(dims), a.layout.partial, a.layout.segments +
                                                             ((dim, sizes),), a.layout.outer + outer_entry))


def _positional(ctx, eqn, args, rule, where):
    """Runs `rule` on the plain splits; `where(i, dim)` is the output dim of operand i's
    per-segment `dim` (None: this op cannot carry it)."""
    moves = []
    for i, x in enumerate(args):
        for dim, sizes in (x.layout.segments if _segmented(x) else ()):
            to = where(i, dim)
            if to is None:
                return None
            moves.append((to, sizes, x.layout.dims[dim], x.layout.outer_axes(dim)))
    if len({m[0] for m in moves}) != len({m for m in moves}):
        return None
    (out,) = rule(ctx, eqn, [_plain(a) for a in args])
    for to, sizes, axes, outer in dict.fromkeys(moves):
        out = _restore(ctx, out, to, sizes, axes, outer)
    return [out]


def _agree(a, x, dim: int, at: int | None = None) -> bool:
    at = dim if at is None else at
    return a.layout.segmented(dim) == x.layout.segmented(at) and a.layout.dims[dim] == x.layout.dims[at] and \
        a.layout.outer_axes(dim) == x.layout.outer_axes(at)


def _localized(ctx, args, pairs):
    """`args` with each operand whose dim of `pairs` ((i, dim, j, at): operand i's dim against
    operand j's per-segment dim at) disagrees taken into that layout; None if one cannot be."""
    args = list(args)
    for i, dim, j, at in pairs:
        x = args[j]
        if not isinstance(args[i], Sharded) or not x.layout.segmented(at) or _agree(args[i], x, dim, at):
            continue
        args[i] = _localize(ctx, args[i], dim, x, at)
        if args[i] is None:
            return None
    return args


def _elementwise(ctx, eqn, args, rule):
    shape = tuple(out_avals(eqn)[0].shape)
    spans = [i for i, a in enumerate(args) if isinstance(a, Sharded) and a.ndim == len(shape)]
    args = _localized(ctx, args, [(i, d, j, d) for j in spans for d, _ in args[j].layout.segments for i in spans
                                  if args[i].shape[d] == shape[d]])
    if args is None:
        return None

    def where(i, dim):  # every operand along the dim split per the same segments, or broadcast along it
        x = args[i]
        agree = all(not isinstance(a, Sharded) or a.ndim == 0 or a.shape[dim] == 1 or _agree(a, x, dim) for a in args)
        return dim if agree and len(shape) == x.ndim else None
    return _positional(ctx, eqn, args, rule, where)


def _broadcast(ctx, eqn, args, rule):
    bdims, shape = eqn.params["broadcast_dimensions"], eqn.params["shape"]
    return _positional(ctx, eqn, args, rule, lambda i, d: bdims[d] if i == 0 and shape[bdims[d]] == args[0].shape[d]
                       else None)


def _transpose(ctx, eqn, args, rule):
    return _positional(ctx, eqn, args, rule, lambda i, d: tuple(eqn.params["permutation"]).index(d))


def _dot(ctx, eqn, args, rule):
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    free = [[d for d in range(args[0].ndim) if d not in lc and d not in lb],
            [d for d in range(args[1].ndim) if d not in rc and d not in rb]]

    args = _localized(ctx, args, [(1 - i, (rb, lb)[i][k], i, d) for i in (0, 1) for k, d in enumerate((lb, rb)[i])])
    if args is None:
        return None

    def where(i, dim):  # batch dims (both sides alike), then the lhs's free dims, then the rhs's
        if dim in (lb, rb)[i]:
            return (lb, rb)[i].index(dim)
        return len(lb) + (len(free[0]) if i else 0) + free[i].index(dim) if dim in free[i] else None
    return _positional(ctx, eqn, args, rule, where)


def _into_segments(ctx, eqn, x, rule):
    """A reshape of the one per-segment dim into (segments, each segment's shape...) with equal
    segments (a fused q | k | v into (3, heads, head_dim)): locally this device's slice of every
    segment is one row each, so the value is read as (segments, whole; the segment split
    contiguously) and the plain rule reshapes the rest (the heads keep the split)."""
    new, old = tuple(eqn.params["new_sizes"]), x.shape
    if len(x.layout.segments) != 1:
        return None
    ((dim, sizes),) = x.layout.segments
    outer = x.layout.outer_axes(dim)
    axes, count = x.layout.dims[dim], len(sizes) // _parts(ctx, x.layout.dims[dim][:outer])  # segments held here
    at = next((t for t in range(len(new)) if math.prod(new[:t]) == math.prod(old[:dim])), None)
    if at is None or len(set(sizes)) != 1 or new[at] != len(sizes) or at + 1 >= len(new) or \
            math.prod(new[at + 1:]) * math.prod(old[:dim]) * len(sizes) != math.prod(new) or \
            math.prod(new[:at + 1]) * sizes[0] != math.prod(old[:dim + 1]):
        return None
    local = x.value.shape[:dim] + (count, x.value.shape[dim] // count) + x.value.shape[dim + 1:]
    dims = x.layout.dims[:dim] + (axes[:outer], axes[outer:]) + x.layout.dims[dim + 1:]
    rows = Sharded(jnp.reshape(x.value, local), Layout(dims, x.layout.partial), old[:dim] + (len(sizes), sizes[0])
                   + old[dim + 1:], x.dtype, x.zero)
    return rule(ctx, eqn, [rows])


def _into_heads(ctx, eqn, x):
    """A reshape of the one per-segment dim into (heads, head_dim), each segment whole heads on
    every device (Falcon's q | k + v): locally this device's heads of every segment, so the
    heads dim is split per segment in heads."""
    new, old = tuple(eqn.params["new_sizes"]), x.shape
    if len(x.layout.segments) != 1 or x.layout.partial or x.layout.outer:
        return None
    ((dim, sizes),) = x.layout.segments
    parts = _parts(ctx, x.layout.dims[dim])
    if new[:dim] != old[:dim] or new[dim + 2:] != old[dim + 1:] or len(new) != len(old) + 1 or \
            new[dim] * new[dim + 1] != old[dim] or any(s % (new[dim + 1] * parts) for s in sizes):
        return None
    unit = new[dim + 1]
    local = x.value.shape[:dim] + (x.value.shape[dim] // unit, unit) + x.value.shape[dim + 1:]
    dims = x.layout.dims[:dim] + (x.layout.dims[dim], ()) + x.layout.dims[dim + 1:]
    return wrap(eqn, [jnp.reshape(x.value, local)], [Layout(dims, (), ((dim, tuple(s // unit for s in sizes)),))])


def _reshape(ctx, eqn, args, rule):
    new, old = tuple(eqn.params["new_sizes"]), args[0].shape
    if (rows := _into_segments(ctx, eqn, args[0], rule)) is not None:
        return rows
    if (heads := _into_heads(ctx, eqn, args[0])) is not None:
        return heads

    def where(i, dim):  # the dim kept as one output dim, the same elements before it
        hits = [t for t, s in enumerate(new) if s == old[dim] and math.prod(new[:t]) == math.prod(old[:dim])]
        return hits[0] if hits else None
    return _positional(ctx, eqn, args, rule, where)


def _squeeze(ctx, eqn, args, rule):
    gone = eqn.params["dimensions"]  # (a stacked parameter's layer row: slice, then squeeze)
    return _positional(ctx, eqn, args, rule, lambda i, d: None if d in gone else d - sum(g < d for g in gone))


def _cut(ctx, eqn, x, dim, pieces):
    """Each (start, stop) of `pieces`: a whole segment of `dim` is this device's slice of it; a
    piece inside one segment (MQA's key heads, stored with the value heads: _into_heads) is cut
    from that segment gathered over the axes (once for all its pieces), whole on every device."""
    sizes, axes = x.layout.segmented(dim), x.layout.dims[dim]
    if x.layout.outer_axes(dim):
        return None
    bounds = Segments(axes, sizes).bounds()
    within = [next((b for b in bounds if b[0] <= p[0] and p[1] <= b[1]), None) for p in pieces]
    if None in within:
        return None
    parts = _parts(ctx, axes)
    x = _plain(x)
    outs, layouts = [], []
    rest = _without(x.layout, dim)
    for (start, stop), (a, b) in zip(pieces, within):
        starts, limits = [0] * x.ndim, list(x.value.shape)
        if (start, stop) == (a, b):
            starts[dim], limits[dim] = start // parts, stop // parts
            outs.append(lax.slice(x.value, starts, limits))
            layouts.append(Layout(x.layout.dims, x.layout.partial, *rest))
            continue
        whole = _segment_gathered(ctx, x, dim, (a, b), parts)
        starts[dim], limits[dim] = start - a, stop - a
        outs.append(lax.slice(whole, starts, limits))
        dims = list(x.layout.dims)
        dims[dim] = ()
        layouts.append(Layout(tuple(dims), x.layout.partial, *rest))
    return wrap(eqn, outs, layouts)


def _segment_gathered(ctx, x: Sharded, dim: int, segment: tuple[int, int], parts: int):
    """The whole of one segment of `x`'s per-segment `dim` (its local slices all-gathered)."""
    def gather():
        start, stop = segment[0] // parts, segment[1] // parts
        local = lax.slice_in_dim(x.value, start, stop, axis=dim)
        # varying: every device's query heads read it, so its backward is one reduce-scatter
        return dataclasses.replace(x, value=collectives.all_gather(local, x.layout.dims[dim], dim))
    return C.memoized(ctx, ("segment", id(x.value), x.layout, dim, segment), x.value, gather).value


def _slice(ctx, eqn, args, rule):
    x = args[0]
    start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
    cut = [d for d in range(x.ndim) if start[d] != 0 or limit[d] != x.shape[d] or (strides and strides[d] != 1)]
    if not any(x.layout.segmented(d) for d in cut):
        return _positional(ctx, eqn, args, rule, lambda i, d: d)
    if len(cut) != 1 or (strides and strides[cut[0]] != 1):
        return None
    return _cut(ctx, eqn, x, cut[0], [(start[cut[0]], limit[cut[0]])])


def _split(ctx, eqn, args, rule):
    x, axis = args[0], eqn.params["axis"]
    if not x.layout.segmented(axis) or len(x.layout.segments) != 1:
        return None
    ends = np.cumsum((0,) + tuple(eqn.params["sizes"]))
    return _cut(ctx, eqn, x, axis, [(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:])])


HANDLERS = {"broadcast_in_dim": _broadcast, "transpose": _transpose, "dot_general": _dot, "reshape": _reshape,
            "slice": _slice, "split": _split, "squeeze": _squeeze}


def _merge(ctx, eqn, x: Sharded):
    """A reshape merging two dims (major, minor) whose minor is split, not over `context`, and
    followed by two more (Bloom's (batch, heads, length, dim) into batch x heads for baddbmm):
    locally this device's majors times its minors, which is the merged dim split per segment (one segment per major index; the major's axes, if any, divide
    the segments among them); a plain split would gather the heads. None: not such a reshape."""
    new, old = tuple(eqn.params["new_sizes"]), x.shape
    a = next((d for d in range(len(new)) if d >= len(old) - 1 or new[d] != old[d]), None)
    if a is None or x.layout.segments or len(new) != len(old) - 1 or a + 1 >= len(old) or \
            new[a] != old[a] * old[a + 1] or new[a + 1:] != old[a + 2:] or min(old[a], old[a + 1]) == 1 or \
            len(old) - a < 4:  # (batch, heads, length, dim): a merged (batch, sequence) gathers as it did
        return None
    major, minor = x.layout.dims[a], x.layout.dims[a + 1]
    if not minor or CONTEXT in minor or eqn.params.get("dimensions") is not None:
        return None
    local = x.value.shape[:a] + (x.value.shape[a] * x.value.shape[a + 1],) + x.value.shape[a + 2:]
    dims = x.layout.dims[:a] + (major + minor,) + x.layout.dims[a + 2:]
    layout = Layout(dims, x.layout.partial, ((a, (old[a + 1],) * old[a]),), ((a, len(major)),) if major else ())
    return wrap(eqn, [jnp.reshape(x.value, local)], [layout])


def apply(ctx: Context, eqn, args, rule) -> list:
    """The outputs of `rule` on `args`, through a per-segment handler where an operand is split
    per segment (else it is first gathered back to torch's order)."""
    if str(eqn.primitive) == "reshape" and isinstance(args[0], Sharded) and \
            (merged := _merge(ctx, eqn, args[0])) is not None:
        return merged
    if not any(_segmented(a) for a in args):
        return rule(ctx, eqn, args)
    name = str(eqn.primitive)
    # the primitives of the elementwise rule (the one `add` has: rules/elementwise.py, not imported here,
    # since rules/control.py interprets nested jaxprs through this module)
    handler = HANDLERS.get(name) or (_elementwise if rule is RULES.get("add") else None)
    outs = handler(ctx, eqn, args, rule) if handler is not None and len(eqn.outvars) >= 1 else None
    if outs is not None:
        return outs
    return rule(ctx, eqn, [unsegment(ctx, a) if _segmented(a) else a for a in args])
