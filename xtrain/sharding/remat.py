"""Activation checkpointing per layer of the layer scan (`Plan(remat=...)`, explicit lowering):
what each layer keeps for the backward pass and what it recomputes. The lowering turns it into
a jax.checkpoint policy (xtrain.lowering.remat)."""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
from typing import Callable


class Remat(enum.Enum):
    """Activation checkpointing of each layer of the layer scan (explicit lowering).

    off    keep every activation of the forward pass for the backward pass.
    full   keep only each layer's input; recompute the layer in the backward pass.
    dots   keep matmul outputs, recompute the rest (norms, activations, softmax).
    selective  keep the activations of the modules named by `remat_keep` (module-path
           patterns), recompute the rest of the layer.
    policy keep what a JAX checkpoint policy given as `Plan(remat=callable)` saves
           (`policy(prim, *avals, **params) -> bool`, e.g.
           `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`): the hook for residual
           policies of one's own.
    """

    OFF = "off"
    FULL = "full"
    DOTS = "dots"
    SELECTIVE = "selective"
    POLICY = "policy"


@dataclasses.dataclass(frozen=True)
class LayerRemat:
    """What the layer scan checkpoints (built from the Plan; read by the explicit lowering)."""

    mode: Remat
    keep: tuple[str, ...] = ()
    offload: bool = False   # what the layer saves goes to host memory (Plan(offload="activations"))
    policy: Callable | None = None  # mode POLICY: the JAX checkpoint policy (what each layer saves)

    @property
    def setting(self) -> str:
        """The plan's words for it, for messages."""
        remat = f"remat={self.mode.value!r}"
        if not self.offload:
            return remat
        return "offload='activations'" + ("" if self.mode is Remat.FULL else f", {remat}")

    @property
    def tags_dots(self) -> bool:
        """Whether matmul outputs are tagged as kept: remat='dots' offloads them by name."""
        return self.offload and self.mode is Remat.DOTS

    def keeps(self, path: str) -> bool:
        """Whether values computed in module `path` (or a module inside a kept one) are kept."""
        return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + ".*") for p in self.keep)
