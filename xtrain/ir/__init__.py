"""The program xtrain compiles, free of torch: what every other layer builds on.

    model.py     the Model contract every front end implements; TraceError (from xtrain.errors)
    trace_options.py  how a front end traces the model for a plan (head split, sequence-parallel
                 blocks, kernels ruled out): plain data the plan and step carry, `Model.specialised`
    markers.py   typed markers (frozen dataclasses) encoded in traced names, and decoded back
    graph.py     the traced graph (a jaxpr) and the torch module path of each equation
    walk.py      the one jaxpr walker: environment, inlined calls, module paths
    stacked.py   block parameters stored stacked, (L, ...) per block position
    flops.py     FLOPs of a jaxpr's equations, by kind
    trust_ratio.py  LARS / LAMB's per-layer trust ratio; the step supplies whole-tensor norms
    dimflow.py   which matmul output dimensions reach a matmul that contracts them (tensor
                 parallel's column -> row pairs); provenance.py: jaxpr inputs as parameters
                 per_head.py: attention kernels (cuDNN, NKI) carry its head split
    structure.py a torch module tree as plain data (shapes, kinds, children)
    index_ops.py markers (xtrain.ir.markers) of torch index ops whose rules differ from JAX's (read by the input checks)
    attention.py markers (xtrain.ir.markers) naming the attention each call site got (read by the report)
    neuron_attention.py  Neuron's NKI flash-attention kernels as primitives with a custom VJP
"""
from xtrain.ir.model import Model, TraceError

__all__ = ["Model", "TraceError"]
