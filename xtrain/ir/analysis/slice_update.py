"""A part of a tensor overwritten, for the dimension flow (xtrain.ir.analysis.dimflow):
`x.at[..., a:b].set(u)`, or torch's copy_ into a slice of a new tensor (HF DeepSeek-V3 builds its
keys so: the heads' non-rotary part and the shared rotary part copied into one tensor), traced as
dynamic_update_slice or as a scatter of one window. On a dimension the update spans whole, the
operand's and the update's labels meet as in an elementwise op, so a split of the heads passes
through; a split dimension only partly overwritten breaks.
"""
from __future__ import annotations

UPDATES = ("dynamic_update_slice", "scatter")


def carry(flow, eqn, ins, shapes, out_shape, path) -> tuple | None:
    """The output's labels (`flow`: the running analysis, whose `brk` and `union` it calls), or
    None for another op, a scatter whose indices are labelled or whose update is not one window
    of the operand's rank (the analysis then breaks the labels as for any op)."""
    prim = eqn.primitive.name
    if prim not in UPDATES:
        return None
    at = 1 if prim == "dynamic_update_slice" else 2
    indices = ins[at + 1:] if prim == "dynamic_update_slice" else ins[1:2]
    if any(lab is not None for lab in indices) or len(shapes[at]) != len(out_shape):
        return None
    if prim == "scatter":
        dn = eqn.params["dimension_numbers"]
        if dn.inserted_window_dims or dn.operand_batching_dims or \
                tuple(dn.update_window_dims) != tuple(range(len(out_shape))):
            return None
    out: list = [None] * len(out_shape)
    for d in range(len(out_shape)):
        here = [lab[d] for lab in (ins[0], ins[at]) if lab is not None and lab[d] is not None]
        if not here:
            continue
        if shapes[at][d] != out_shape[d]:
            flow.brk(here, "op", prim, f"{path}: a part of the split dimension overwritten")
            continue
        for other in here[1:]:
            flow.union(here[0], other)
        out[d] = here[0]
    return tuple(out)
