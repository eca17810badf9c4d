"""xtrain: compiler-driven distributed training for PyTorch and JAX.

    mesh = xtrain.Mesh(data=4, tensor=2)
    step = xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(model.parameters()))
    out = step(*batch)

Heavy modules (jax, torch, torchax) load on first use, not on import.
"""
import importlib

from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import Plan

__version__ = "0.1.0"

# lazily imported public names -> (module, attribute; None: the module itself)
_LAZY = {
    "compile": ("xtrain.api", "compile"),
    "GradSync": ("xtrain.lowering.gradient_sync", "GradSync"),
    "Precision": ("xtrain.sharding.precision", "Precision"),
    "LossScale": ("xtrain.sharding.precision", "LossScale"),
    "ContextParallel": ("xtrain.sharding.context_parallel", "ContextParallel"),
    "init": ("xtrain.runtime.devices", "init"),
    "emulated_cluster": ("xtrain.runtime.devices", "emulated_cluster"),
    "shard": ("xtrain.sharding.annotate", "shard"),
    "Segments": ("xtrain.sharding.segments", "Segments"),
    "plans": ("xtrain.plans", None),
    "optim": ("xtrain.optim", None),
    "Remat": ("xtrain.sharding.remat", "Remat"),
    "TrainStep": ("xtrain.step", "TrainStep"),
    "checkpoint": ("xtrain.checkpoint", None),
    "observe": ("xtrain.observe", None),
    "Loader": ("xtrain.loader", "Loader"),
    "ShardedLoader": ("xtrain.loader", "ShardedLoader"),
    "Buckets": ("xtrain.buckets", "Buckets"),
    "Monitor": ("xtrain.observe", "Monitor"),
    "sagemaker": ("xtrain.runtime.sagemaker", None),
    "errors": ("xtrain.errors", None),
    "aot": ("xtrain.aot", None),
}
__all__ = ["Mesh", "Plan", *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'xtrain' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    loaded = importlib.import_module(module)
    return loaded if attribute is None else getattr(loaded, attribute)
