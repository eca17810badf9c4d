"""The partition rules of the explicit lowering, one module per family of primitives; importing
this package registers them all (xtrain.lowering.explicit.registry).

    elementwise.py    same-shape ops: operands aligned, linear ops keep pending sums
    shape.py          broadcast, reshape, transpose, slices, pads, joins; layout annotations
    reductions.py     sums (pending partial sums), max/min (combined over shards), the rest whole
    contractions.py   dot_general (tensor parallel products), convolutions
    linear_grad.py    (helper) activation x 2-D weight whose weight gradient takes XLA:CPU's fast orientation
    indexing.py       gathers, vocab-parallel embedding lookups
    routing.py        mixture-of-experts routing: top-k, sorts, grouped matmuls, routed-experts calls
    experts.py        expert parallel: a routed-experts call's all-to-all dispatch and combine
    control.py        calls, custom derivative rules, scan and while loops, replicated ops
    attention.py      cuDNN's fused attention, on each device's batch and head shard; ring attention
                      of the blockwise kernel over a sequence split along `context`
"""
from xtrain.lowering.explicit.rules import (attention, contractions, control, elementwise, indexing, reductions,
                                           routing, shape)

__all__ = ["attention", "contractions", "control", "elementwise", "indexing", "reductions", "routing", "shape"]
