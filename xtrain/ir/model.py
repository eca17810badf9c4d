"""The interface every front end gives the rest of xtrain."""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Mapping, Protocol

import numpy as np
import optax

from xtrain.errors import TraceError  # re-exported: defined with the other errors
from xtrain.ir.structure import Structure
from xtrain.ir.trace_options import TraceOptions


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
    def initial_buffers(self, stored: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Initial value of every buffer (empty for JAX functions); `stored`: values of some of
        them read from a checkpoint (sharded init, where the model itself may hold none)."""

    def buffer_names(self) -> list[str]:
        """Every buffer's name (what `initial_buffers` returns)."""
        return []

    def buffer_shapes(self) -> dict[str, Any]:
        """Shape and dtype (jax.ShapeDtypeStruct) of every buffer, without values: what
        planning and lowering read (a module built on the meta device has no buffer values)."""
        import jax

        return {n: jax.ShapeDtypeStruct(v.shape, v.dtype) for n, v in self.initial_buffers().items()}

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

    def specialised(self, options: TraceOptions) -> "Model":
        """This model traced under `options` (xtrain.ir.trace_options): a new Model, this one
        unchanged. A front end without such choices (JAX functions) returns itself."""
        return self

    def export_state(self, params: Mapping[str, np.ndarray], buffers: Mapping[str, np.ndarray]) -> dict:
        """Full state under the user's names (torch: every key of module.state_dict())."""
        return {**params, **buffers}


class LearningRates(Protocol):
    """The current lr of each param group of a torch optimizer (xtrain.frontend.optim)."""

    groups: Mapping[str, int]  # parameter name -> param group

    def current(self) -> np.ndarray:
        """(groups,) float32: every group's lr now (a scheduler may have changed it)."""

    def mark_stepped(self) -> None:
        """Tells the optimizer's schedulers that it stepped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trainable:
    """A model and what trains it: what a front end hands `xtrain.compile`'s step.

    Attributes:
        model: the named state and pure loss function.
        tx: the optax transformation (lr 1 for torch optimizers: `learning_rates` scales it).
        optimized: the parameters the optimizer updates.
        learning_rates: a torch optimizer's per-group lrs, read before every step; None for
            an optax transformation, whose lr is inside it.
        structure: the module tree (for presets, e.g. plan="auto"'s megatron candidates);
            None for a JAX function.
        experts: parameters of MoE layers' experts, stored (experts, ...): what a mesh axis
            named `expert` splits (on dim 0).
    """

    model: Model
    tx: optax.GradientTransformation
    optimized: frozenset[str]
    learning_rates: LearningRates | None = None
    structure: Structure | None = None
    experts: frozenset[str] = frozenset()

    @property
    def lr_groups(self) -> Mapping[str, int] | None:
        return self.learning_rates.groups if self.learning_rates is not None else None
