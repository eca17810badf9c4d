"""A plain JAX loss function `loss(params, *batch)` with a params pytree."""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np
import optax

from xtrain.errors import OptionsError
from xtrain.ir.model import Model, TraceError, Trainable


def _path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


class JaxModel(Model):
    """Wraps `fn(params, *batch) -> scalar loss`; parameters are named by their pytree paths
    ("layers.0.w" for params["layers"][0]["w"])."""

    def __init__(self, fn: Callable[..., Any], params: Any):
        self.fn = fn
        self.name = getattr(fn, "__name__", type(fn).__name__)
        leaves, self.treedef = jax.tree_util.tree_flatten_with_path(params)
        self.param_names = [_path_name(p) for p, _ in leaves]
        self._initial = {n: np.asarray(v) for n, (_, v) in zip(self.param_names, leaves)}

    def initial_params(self) -> dict[str, np.ndarray]:
        return dict(self._initial)

    def initial_buffers(self, stored=None) -> dict[str, np.ndarray]:
        return {}

    def trainable(self) -> dict[str, bool]:
        return {n: True for n in self.param_names}

    def unflatten(self, params: Mapping[str, Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.treedef, [params[n] for n in self.param_names])

    def apply(self, params, buffers, key, batch, *, training):
        loss = self.fn(self.unflatten(params), *batch)
        if getattr(loss, "shape", None) != ():
            raise TraceError(
                f"{self.name} returned {type(loss).__name__} of shape {getattr(loss, 'shape', None)}, "
                "not a scalar loss; a JAX loss function must return a scalar")
        return loss, {}


def param_shapes(params: Any) -> dict[str, tuple[int, ...]]:
    """{name: shape} of a parameter pytree, named as JaxModel names them."""
    return {_path_name(p): tuple(np.shape(v)) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def wrap(fn: Callable[..., Any], params: Any, optimizer: Any) -> Trainable:
    """What `xtrain.compile(fn, mesh, params=..., optimizer=optax...)` trains."""
    if params is None:
        raise OptionsError("xtrain.compile of a JAX function needs params=<pytree of initial parameters>")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise OptionsError("xtrain.compile of a JAX function needs optimizer=<optax.GradientTransformation>")
    model = JaxModel(fn, params)
    return Trainable(model=model, tx=optimizer, optimized=frozenset(model.param_names))
