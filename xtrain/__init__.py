"""xtrain: compiler-driven distributed training for PyTorch and JAX.

    mesh = xtrain.Mesh(data=4, tensor=2)
    step = xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(model.parameters()))
    out = step(*batch)

Heavy modules (jax, torch, torchax) load on first use, not on import.
"""
from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import Plan

__version__ = "0.1.0"
__all__ = ["Mesh", "Plan", "GradSync", "Precision", "LossScale", "compile", "init", "plans", "shard"]


def __getattr__(name):
    if name == "compile":
        from xtrain.api import compile

        return compile
    if name == "GradSync":
        from xtrain.lowering.explicit.gradient_sync import GradSync

        return GradSync
    if name in ("Precision", "LossScale"):
        import xtrain.precision

        return getattr(xtrain.precision, name)
    if name == "plans":
        import xtrain.plans

        return xtrain.plans
    if name == "shard":
        from xtrain.sharding.annotate import shard

        return shard
    if name == "init":
        from xtrain.runtime.devices import init

        return init
    raise AttributeError(f"module 'xtrain' has no attribute {name!r}")
