"""The program xtrain compiles, free of torch: what every other layer builds on.

    model.py     the Model contract every front end implements; TraceError (from xtrain.errors)
    trace_options.py  how a front end traces the model for a plan (head split, sequence-parallel
                 blocks, kernels ruled out): plain data the plan and step carry, `Model.specialised`
    markers.py   typed markers (frozen dataclasses) encoded in traced names, and decoded back
    graph.py     the traced graph (a jaxpr) and the torch module path of each equation
    walk.py      the one jaxpr walker: environment, inlined calls, module paths
    stacked.py   block parameters stored stacked, (L, ...) per block position
    tree.py      logical names of a state's arrays (pytree key paths)
    interop.py   how a front end's tensors reach JAX functions
    hlo.py       the replica groups of a compiled collective, from HLO text
    trust_ratio.py  LARS / LAMB's per-layer trust ratio; the step supplies whole-tensor norms
    structure.py a torch module tree as plain data (shapes, kinds, children)
    index_ops.py markers (xtrain.ir.markers) of torch index ops whose rules differ from JAX's (read by the input checks)
    attention.py markers (xtrain.ir.markers) naming the attention each call site got (read by the report)
    kernels/     pure JAX computations the front end traces and the lowering recognises: blockwise
                 attention, Neuron's NKI flash attention, MoE's routed experts, the dropout hash
    analysis/    what is read off a traced program: FLOPs, the dimension flow (tensor parallel's
                 column -> row pairs) with parameter provenance, low-rank detours, per-head kernels
"""
from xtrain.ir.model import Model, TraceError

__all__ = ["Model", "TraceError"]
