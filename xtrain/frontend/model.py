"""The interface every front end gives the rest of xtrain."""
from __future__ import annotations

import abc
from typing import Any, Mapping

import numpy as np


class TraceError(ValueError):
    """The model could not be turned into a JAX function (names the module path and op)."""


class Model(abc.ABC):
    """Named state plus a pure loss function over it.

    Parameters and buffers are flat dicts keyed by name (torch `state_dict` names for torch
    modules). `apply` is pure: it returns the loss and the new values of the buffers the
    forward updated (BatchNorm running statistics); the caller owns all state.
    """

    name: str

    @abc.abstractmethod
    def initial_params(self) -> dict[str, np.ndarray]:
        """Initial value of every unique parameter, trainable or frozen."""

    @abc.abstractmethod
    def initial_buffers(self, source: Any = None) -> dict[str, np.ndarray]:
        """Initial value of every buffer (empty for JAX functions); `source`: a safetensors
        file that may hold them (sharded init, where the model itself holds no values)."""

    def param_shapes(self) -> dict[str, Any]:
        """Global shape and dtype (jax.ShapeDtypeStruct) of every parameter, without values."""
        import jax

        return {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in self.initial_params().items()}

    @abc.abstractmethod
    def trainable(self) -> dict[str, bool]:
        """Whether each parameter receives updates."""

    @abc.abstractmethod
    def apply(self, params: Mapping[str, Any], buffers: Mapping[str, Any], key, batch: tuple,
              *, training: bool) -> tuple[Any, dict[str, Any]]:
        """Pure JAX: (loss, updated buffers) for one global batch; the loss is a scalar or a
        (loss sum, term count) pair of scalars (see xtrain.lowering.accumulation)."""

    def module_paths(self) -> frozenset[str]:
        """Module paths that can appear in the traced graph's name stacks."""
        return frozenset()

    def export_state(self, params: Mapping[str, np.ndarray], buffers: Mapping[str, np.ndarray]) -> dict:
        """Full state under the user's names (torch: every key of module.state_dict())."""
        return {**params, **buffers}
