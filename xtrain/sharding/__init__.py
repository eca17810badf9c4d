"""How tensors are split over the mesh: what a plan says, and what it resolves to.

    mesh.py      Mesh(data=4, tensor=2): named axes
    plan.py      Plan: per-tensor specs by module-path glob, batch spec, ZeRO stage, pipeline,
                 precision, remat and offload (their settings: pipeline.py, precision.py,
                 remat.py, offload.py)
    zero.py      which dimension ZeRO splits over the data axes (shared with the presets)
    layout.py    layout resolution: plan + mesh sizes + shapes -> the state layout
    presets.py   ddp, fsdp/zero, hybrid, megatron (tensor_parallel.py: from the traced
                 program's dimension flow) as ordinary Plans; PendingPlan (plan.py) until traced
    annotate.py  xtrain.shard: activation layouts written in model code
"""
from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import Plan

__all__ = ["Mesh", "Plan"]
