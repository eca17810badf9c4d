"""Front ends: a torch.nn.Module or a JAX loss function -> named state + pure JAX loss."""
from xtrain.frontend.model import Model, TraceError
from xtrain.frontend.torch_module import TorchModel
from xtrain.frontend.jax_function import JaxModel
from xtrain.frontend.graph import TracedGraph, trace

__all__ = ["Model", "TraceError", "TorchModel", "JaxModel", "TracedGraph", "trace"]
