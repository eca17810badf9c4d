"""Partition rules of shape primitives (broadcast, reshape, transpose, slicing, padding,
joining) and of layout annotations (xtrain.shard / with_sharding_constraint)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from xtrain.lowering import sharded as C
from xtrain.sharding.mesh import CONTEXT
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit import shift
from xtrain.lowering.explicit.registry import bind, fallback, local_shape, out_avals, register, whole_dims_where, wrap
from xtrain.lowering.explicit.rules.elementwise import _align
from xtrain.lowering.context import Context


def broadcast_in_dim(ctx: Context, eqn, args):
    """New dims whole; broadcast size-1 dims whole; operand dims keep their split. A ZeRO-3
    parameter (a bias) is gathered before it is broadcast: its use starts here."""
    x = args[0]
    shape, bdims = eqn.params["shape"], eqn.params["broadcast_dimensions"]
    if x.zero:
        x = whole_dims_where(ctx, x, lambda d: bool(set(x.layout.dims[d]) & set(x.zero)))
    for i, d in enumerate(bdims):
        if x.layout.dims[i] and x.shape[i] != shape[d]:
            x = C.gather_dim(ctx, x, i)
    dims = [()] * len(shape)
    for i, d in enumerate(bdims):
        dims[d] = x.layout.dims[i]
    layout = Layout(tuple(dims), x.layout.partial)
    out = bind(ctx, eqn, [x.value, *[a.value for a in args[1:]]], shape=local_shape(shape, layout, ctx), sharding=None)
    return wrap(eqn, out, [layout])


def _reshape_groups(src: tuple, dst: tuple) -> list[tuple[list[int], list[int]]]:
    """Pairs of (input dims, output dims) whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        gi, gj = [i] if i < len(src) else [], [j] if j < len(dst) else []
        a = src[i] if i < len(src) else 1
        b = dst[j] if j < len(dst) else 1
        i, j = i + bool(gi), j + bool(gj)
        while a != b:
            if a < b:
                a *= src[i]; gi.append(i); i += 1
            else:
                b *= dst[j]; gj.append(j); j += 1
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            gi.append(i); i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            gj.append(j); j += 1
        groups.append((gi, gj))
    return groups


def _fold_minor(ctx: Context, x, major: int, minor: int):
    """A merged group's minor dim made whole: a `context` split moved onto the group's major
    dim where the major's local size divides (a (batch, sequence) merge under context
    parallelism keeps the logits split; the batch split over `data` or not split at all, as on
    Mesh(context=8)), else gathered."""
    if x.layout.dims[minor] == (CONTEXT,) and x.value.shape[major] % x.layout.factor(minor, ctx.sizes) == 0:
        return C.move_split(ctx, x, minor, major)
    return C.gather_dim(ctx, x, minor)


def reshape(ctx: Context, eqn, args):
    """A split survives when it sits on the major dim of a merged/split group and divides
    the group's major output dim; any other split is gathered first."""
    x = args[0]
    new_sizes = tuple(eqn.params["new_sizes"])
    if eqn.params.get("dimensions") is not None:
        return fallback(ctx, eqn, args)
    dims = [()] * len(new_sizes)
    for gi, gj in _reshape_groups(x.shape, new_sizes):
        for k in gi[1:]:
            x = _fold_minor(ctx, x, gi[0], k)
        if not gi or not x.layout.dims[gi[0]]:
            continue
        # the major output dim must take the whole split (skip leading size-1 dims)
        target = next((d for d in gj if new_sizes[d] != 1), None)
        factor = x.layout.factor(gi[0], ctx.sizes)
        if target is None or new_sizes[target] % factor or any(new_sizes[d] != 1 for d in gj[:gj.index(target)]):
            x = C.gather_dim(ctx, x, gi[0])
            continue
        dims[target] = x.layout.dims[gi[0]]
    layout = Layout(tuple(dims), x.layout.partial)
    out = bind(ctx, eqn, [x.value], new_sizes=local_shape(new_sizes, layout, ctx), sharding=None)
    if x is args[0] and layout.partial:  # nothing gathered: a row-parallel sum's biases follow
        C.carry_biases(ctx, x.value, out[0], lambda v: jnp.reshape(v, out[0].shape))
    out = wrap(eqn, out, [layout])
    return [_unfold_context(ctx, out[0], _reshape_groups(x.shape, new_sizes))]


def _unfold_context(ctx: Context, out, groups):
    """A (batch x sequence) dim split back into (batch, sequence): a `context` split that
    `_fold_minor` moved onto the batch goes back to the sequence (one all-to-all), so the
    sequence stays split (a Conv1D's view(-1, E) ... view(B, L, -1) in GPT-2)."""
    for _, gj in groups:
        major = next((d for d in gj if out.layout.dims[d]), None)
        if major is None or out.layout.dims[major][-1] != CONTEXT:
            continue
        rest = [d for d in gj if d > major and out.shape[d] % ctx.sizes[CONTEXT] == 0]
        if rest and len(gj) > 1:
            out = C.move_split(ctx, out, major, rest[0], (CONTEXT,))
    return out


def transpose(ctx: Context, eqn, args):
    x = args[0]
    perm = eqn.params["permutation"]
    layout = Layout(tuple(x.layout.dims[p] for p in perm), x.layout.partial)
    out = bind(ctx, eqn, [x.value])
    if layout.partial:
        C.carry_biases(ctx, x.value, out[0], lambda v: jnp.transpose(v, perm))
    return wrap(eqn, out, [layout])


def squeeze(ctx: Context, eqn, args):
    x = args[0]
    drop = set(d % x.ndim for d in eqn.params["dimensions"])
    layout = Layout(tuple(d for i, d in enumerate(x.layout.dims) if i not in drop), x.layout.partial)
    return wrap(eqn, bind(ctx, eqn, [x.value]), [layout])


def concatenate(ctx: Context, eqn, args):
    """The joined dim must be whole; other dims aligned like elementwise operands."""
    dim = eqn.params["dimension"]
    args = [C.gather_dim(ctx, a, dim) for a in args]
    if len({a.layout.partial for a in args}) > 1:
        args = C.resolve_all(ctx, args)
    args, dims = _align(ctx, args, tuple(out_avals(eqn)[0].shape))
    layout = Layout(dims, args[0].layout.partial)
    return wrap(eqn, bind(ctx, eqn, [a.value for a in args]), [layout])


def stack(ctx: Context, eqn, args):
    """Operands joined along a new dim (torch.stack: GPT-J's rotary pairs, a scan's states):
    the new dim whole, the others aligned like elementwise operands."""
    axis = eqn.params["axis"]
    out_shape = tuple(out_avals(eqn)[0].shape)
    if len({a.layout.partial for a in args}) > 1:
        args = C.resolve_all(ctx, args)
    args, dims = _align(ctx, args, out_shape[:axis] + out_shape[axis + 1:])
    layout = Layout(dims[:axis] + ((),) + dims[axis:], args[0].layout.partial)
    return wrap(eqn, bind(ctx, eqn, [a.value for a in args]), [layout])


def unstack(ctx: Context, eqn, args):
    """Slices along one dim (the transpose of stack): that dim whole, the others keep their split."""
    axis = eqn.params["axis"]
    x = C.gather_dim(ctx, args[0], axis)
    layout = Layout(x.layout.dims[:axis] + x.layout.dims[axis + 1:], x.layout.partial)
    outs = bind(ctx, eqn, [x.value])
    return wrap(eqn, outs, [layout] * len(outs))


def tile(ctx: Context, eqn, args):
    """Dims repeated more than once whole; the others keep their split."""
    reps = eqn.params["reps"]
    x = whole_dims_where(ctx, args[0], lambda d: reps[d] != 1)
    return wrap(eqn, bind(ctx, eqn, [x.value]), [x.layout])


def dynamic_update_slice(ctx: Context, eqn, args):
    """Writes `update` into `operand` at dynamic starts: dims the update spans whole keep their
    split (the operand and update split alike there; the start is 0), dims written in part
    are whole. A pending sum is kept when both sides carry it (the write is linear)."""
    operand, update, *starts = args
    if operand.layout.partial != update.layout.partial:
        operand, update = C.resolve(ctx, operand), C.resolve(ctx, update)
    operand = whole_dims_where(ctx, operand, lambda d: update.shape[d] != operand.shape[d])
    update = C.relayout(ctx, update, operand.layout)
    starts = [C.replicate(ctx, s) for s in starts]
    out = bind(ctx, eqn, [operand.value, update.value, *[s.value for s in starts]])
    return wrap(eqn, out, [operand.layout])


def slice_(ctx: Context, eqn, args):
    """Dims that are cut must be whole; untouched dims keep their split."""
    x = args[0]
    start, limit, strides = eqn.params["start_indices"], eqn.params["limit_indices"], eqn.params["strides"]
    if isinstance(x, shift.PendingPad):
        if shift.is_shift(x, start, limit, strides):
            return [shift.shifted(ctx, x)]
        x = shift.materialize(ctx, x)
    cut = lambda d: start[d] != 0 or limit[d] != x.shape[d] or (strides and strides[d] != 1)
    x = whole_dims_where(ctx, x, cut)
    local_limit = tuple(lim // x.layout.factor(d, ctx.sizes) for d, lim in enumerate(limit))
    return wrap(eqn, bind(ctx, eqn, [x.value], limit_indices=local_limit), [x.layout])


def pad(ctx: Context, eqn, args):
    x, value = args
    config = eqn.params["padding_config"]
    deferred = shift.defer(ctx, x, value, config)
    if deferred is not None:  # a shift along the context-split sequence, if a slice follows
        return [deferred]
    x = whole_dims_where(ctx, x, lambda d: config[d] != (0, 0, 0))
    zero_pad = isinstance(value.value, (int, float)) and value.value == 0
    if x.layout.partial and not zero_pad:
        x = C.resolve(ctx, x)
    value = C.resolve(ctx, value)
    return wrap(eqn, bind(ctx, eqn, [x.value, value.value]), [x.layout])


def dynamic_slice(ctx: Context, eqn, args):
    """Dims sliced to less than their size must be whole; full-size dims keep their split."""
    x, *starts = args
    sizes = eqn.params["slice_sizes"]
    x = whole_dims_where(ctx, x, lambda d: sizes[d] != x.shape[d])
    starts = [C.replicate(ctx, s) for s in starts]
    local = tuple(s // x.layout.factor(d, ctx.sizes) for d, s in enumerate(sizes))
    out = bind(ctx, eqn, [x.value, *[s.value for s in starts]], slice_sizes=local)
    return wrap(eqn, out, [x.layout])


def split(ctx: Context, eqn, args):
    x = C.gather_dim(ctx, args[0], eqn.params["axis"])
    outs = bind(ctx, eqn, [x.value])
    return wrap(eqn, outs, [x.layout] * len(outs))


def sharding_constraint(ctx: Context, eqn, args):
    """xtrain.shard / with_sharding_constraint: move the value to the spec's layout, pending
    sums resolved (by reduce-scatter onto the dims the spec splits over their axes)."""
    (x,) = args
    sharding = eqn.params["sharding"] if "sharding" in eqn.params else eqn.params["dst_sharding"]
    if eqn.primitive.name == "reshard" and _all_manual(sharding):
        return [x]  # JAX's own cast in a manual trace (custom_vjp inserts one per input): nothing to move
    spec = tuple(getattr(sharding, "spec", sharding))
    dims = tuple(_spec_axes(e) for e in spec) + ((),) * (x.ndim - len(spec))
    return [C.relayout(ctx, x, Layout(dims))]


def _all_manual(sharding) -> bool:
    """A sharding over a mesh whose axes are all manual (xtrain traces the model per device)."""
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return bool(types) and all(t == jax.sharding.AxisType.Manual for t in types)


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def rev(ctx: Context, eqn, args):
    """Reversal of some dims: those whole, the others keep their split."""
    x = C.resolve(ctx, args[0])
    x = whole_dims_where(ctx, x, lambda d: d in eqn.params["dimensions"])
    return wrap(eqn, bind(ctx, eqn, [x.value]), [x.layout])


register(broadcast_in_dim, "broadcast_in_dim")
register(reshape, "reshape")
register(transpose, "transpose")
register(squeeze, "squeeze")
register(concatenate, "concatenate")
register(stack, "stack")
register(unstack, "unstack")
register(tile, "tile")
register(dynamic_update_slice, "dynamic_update_slice")
register(slice_, "slice")
register(pad, "pad")
register(dynamic_slice, "dynamic_slice")
register(split, "split")
register(rev, "rev")
register(sharding_constraint, "sharding_constraint", "reshard")
