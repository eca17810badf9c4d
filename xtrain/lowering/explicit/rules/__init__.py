"""The partition rules of the explicit lowering, one module per family of primitives; importing
this package registers them all (xtrain.lowering.explicit.registry).

    elementwise.py    same-shape ops (complex and special functions too): operands aligned,
                      linear ops keep pending sums
    shape.py          broadcast, reshape, transpose, slices, pads, joins (concatenate, stack),
                      tile, dynamic_update_slice; layout annotations
    reductions.py     sums (pending partial sums), associative reductions and variadic `reduce`
                      (combined over shards), argmax/argmin whole
    scans.py          cumulative ops: local scan plus an exclusive prefix over the shards
    windows.py        pooling (reduce_window_*) and its gradients: untouched dims keep their split
    numeric.py        bit casts, FFTs, optimization barriers, XLA's stateful RNG
    contractions.py   dot_general (tensor parallel products), convolutions
    linear_grad.py    (helper) activation x 2-D weight whose weight gradient takes XLA:CPU's fast orientation
    indexing.py       gathers, vocab-parallel embedding lookups, scatters (every combiner)
    routing.py        mixture-of-experts routing: top-k, sorts, grouped matmuls, routed-experts calls
    experts.py        expert parallel: a routed-experts call's all-to-all dispatch and combine
    control.py        calls, custom derivative rules, scan and while loops, cond, replicated ops
    attention.py      cuDNN's fused attention, on each device's batch and head shard; ring attention
                      of the blockwise kernel over a sequence split along `context`
"""
from xtrain.lowering.explicit.rules import (attention, contractions, control, elementwise, indexing, numeric,
                                           reductions, routing, scans, shape, windows)

__all__ = ["attention", "contractions", "control", "elementwise", "indexing", "numeric", "reductions", "routing",
           "scans", "shape", "windows"]
