"""Attention kernels that compute each (batch, head) pair on its own, for the dimension flow
(xtrain.ir.analysis.dimflow): a tensor-parallel split of the heads (Megatron's) passes through them.

cuDNN's fused attention (jax.nn.dot_product_attention on CUDA) takes (batch, length, heads, dim)
queries, keys and values ((batch, heads, length, dim) under its BNTH layout), keys and values
with fewer heads under grouped-query attention, and keeps per-row statistics (batch, heads,
length); its other operands (bias, mask, sequence lengths, offsets, page tables) are empty
placeholders where xtrain calls it, and carry nothing. Neuron's NKI kernels
(xtrain.ir.kernels.neuron_attention) take (batch, heads, ...) operands, heads equal.
"""
from __future__ import annotations

from xtrain.ir.kernels import neuron_attention

CUDNN_FORWARD, CUDNN_BACKWARD = "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"
_BTNH = 0  # jax's cuDNN AttentionLayout.BTNH (BNTH is 1)
_STATS = (0, 1)  # (batch, heads, length)


def lead_dims(eqn) -> tuple[list, list] | None:
    """The (batch, heads) dimensions of each operand and each result of `eqn` (None: one that
    carries no split), or None when `eqn` is not such a kernel."""
    name = eqn.primitive.name
    if name in neuron_attention.PER_HEAD:
        return [(0, 1)] * len(eqn.invars), [(0, 1)] * len(eqn.outvars)
    if name not in (CUDNN_FORWARD, CUDNN_BACKWARD):
        return None
    x = (0, 2) if eqn.params.get("layout", _BTNH) == _BTNH else (0, 1)
    if name == CUDNN_FORWARD:  # q, k, v, placeholders -> output, statistics
        return [x] * 3 + [None] * (len(eqn.invars) - 3), [x, _STATS][:len(eqn.outvars)]
    # q, k, v, placeholders, statistics, forward output, its gradient -> dq, dk, dv (, dbias)
    return [x] * 3 + [None] * (len(eqn.invars) - 6) + [_STATS, x, x], [x] * 3 + [None] * (len(eqn.outvars) - 3)


def carry(analysis, eqn, ins: list, shapes: list, path: str) -> list | None:
    """The labels of `eqn`'s results when it is such a kernel (None when it is not), for
    dimflow's `analysis`: the labels on batch and heads carry (met ones join: q's heads with
    k's, whose contiguous split keeps each query head with its key/value head when the split
    divides both), a split of any other dimension (length, head dim, a placeholder) breaks,
    and so do query heads split where other heads stay whole in a count the split cannot
    slice evenly."""
    lead = lead_dims(eqn)
    if lead is None:
        return None
    name, (at_in, at_out) = eqn.primitive.name, lead
    kept, lead_shapes = [], []
    for lab, at, shape in zip(ins, at_in, shapes):
        if lab is not None:
            analysis.brk([x for d, x in enumerate(lab) if x is not None and d not in (at or ())], "op", name, path)
        kept.append(None if lab is None or at is None else tuple(lab[d] for d in at))
        lead_shapes.append(() if at is None else tuple(shape[d] for d in at))
    split = [lab[1] for lab in kept if lab is not None and lab[1] is not None]
    whole = [s[1] for lab, s in zip(kept, lead_shapes) if s and (lab is None or lab[1] is None)]
    uneven = [h for h in whole if h > 1 and h % analysis.tp]
    if split and uneven:
        analysis.brk(split, "op", name, f"{path}: {uneven[0]} heads stay whole, not divisible by {analysis.tp}")
    here = analysis.elementwise([lab if lab is None else analysis.live(lab) or (None, None) for lab in kept],
                                [None] * len(kept), lead_shapes, (None, None), path)
    outs = []
    for var, at in zip(eqn.outvars, at_out):
        shape, out = tuple(var.aval.shape), [None] * len(var.aval.shape)
        if at is not None:
            out[at[0]] = here[0]
            out[at[1]] = here[1] if shape[at[1]] > 1 and shape[at[1]] % analysis.tp == 0 else None
        outs.append(tuple(out))
    return outs
