"""Mesh, per-tensor sharding specs and plans."""
from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import Plan

__all__ = ["Mesh", "Plan"]
