"""Ops besides the elementwise ones that pass a split through, for the dimension flow
(xtrain.ir.analysis.dimflow): a grouped convolution's channels (a state-space mixer's depthwise
convolution, one group per channel: each device convolves its own channels with its slice of the
kernel), and stack / unstack of operands along a new dimension (GPT-J's interleaved rotary, a
selective scan's per-step states).
"""
from __future__ import annotations

from xtrain.ir.analysis.groups import Use


def carry(flow, eqn, ins, vws, shapes, path) -> list | None:
    """The labels of `eqn`'s results (`flow`: the running analysis, whose `brk`, `union`,
    `group` and `elementwise` it calls), or None for another op."""
    prim = eqn.primitive.name
    if prim == "conv_general_dilated":
        return [_conv(flow, eqn, ins, vws, shapes, len(eqn.outvars[0].aval.shape), path)]
    if prim == "stack":  # operands of one shape stacked along a new dim
        out, axis = flow.elementwise(ins, vws, shapes, shapes[0], path), eqn.params["axis"]
        return [out[:axis] + (None,) + out[axis:]]
    if prim == "unstack":
        axis = eqn.params["axis"]
        flow.brk([ins[0][axis]], "op", prim, f"{path}: along the split dimension")
        return [ins[0][:axis] + ins[0][axis + 1:]] * len(eqn.outvars)
    return None


def _conv(flow, eqn, ins, vws, shapes, ndim: int, path) -> tuple:
    """The batch dim carries, and the channels of a convolution grouped in a multiple of the axis
    (its kernel's output channels follow them); a split kernel or spatial dim breaks."""
    dn, out = eqn.params["dimension_numbers"], [None] * ndim
    flow.brk([x for x in ins[1] or () if x is not None], "op", "conv_general_dilated", f"{path}: a split kernel")
    groups = eqn.params["feature_group_count"]
    grouped = eqn.params["batch_group_count"] == 1 and groups > 1 and groups % flow.tp == 0
    for d, x in enumerate(ins[0] or ()):
        if x is None:
            continue
        if d == dn.lhs_spec[0]:
            out[dn.out_spec[0]] = x
        elif d == dn.lhs_spec[1] and grouped:
            out[dn.out_spec[1]] = x
            kernel, k = vws[1], dn.rhs_spec[0]
            if kernel is not None and kernel.dims[k] is not None:
                flow.group(x).followers.append(Use(kernel.name, kernel.dims[k], shapes[1][k], path))
        else:
            where = "channel" if d == dn.lhs_spec[1] else "spatial"
            flow.brk([x], "op", "conv_general_dilated", f"{path}: a split {where} dimension (channels: only of a "
                     f"convolution grouped in a multiple of {flow.tp})")
    return tuple(out)
