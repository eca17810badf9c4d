"""Options of the training step beyond the plan: clipping, accumulation, activation
checkpointing, NaN detection and the recompilation guard (`xtrain.compile(..., **options)`)."""
from __future__ import annotations

import dataclasses
import enum
import fnmatch

KEPT = "xtrain.remat.kept"  # checkpoint_name of the values remat='selective' keeps


class Remat(enum.Enum):
    """Activation checkpointing of each layer of the layer scan (explicit lowering).

    off    keep every activation of the forward pass for the backward pass.
    full   keep only each layer's input; recompute the layer in the backward pass.
    dots   keep matmul outputs, recompute the rest (norms, activations, softmax).
    selective  keep the activations of the modules named by `remat_keep` (module-path
           patterns), recompute the rest of the layer.
    """

    OFF = "off"
    FULL = "full"
    DOTS = "dots"
    SELECTIVE = "selective"


@dataclasses.dataclass(frozen=True)
class LayerRemat:
    """What the layer scan checkpoints (built from StepOptions; read by the explicit lowering)."""

    mode: Remat
    keep: tuple[str, ...] = ()

    def policy(self):
        """jax.checkpoint policy of one layer (None: save nothing but the layer's input)."""
        import jax

        if self.mode is Remat.DOTS:
            return jax.checkpoint_policies.dots_saveable
        if self.mode is Remat.SELECTIVE:
            return jax.checkpoint_policies.save_only_these_names(KEPT)
        return None

    def keeps(self, path: str) -> bool:
        """Whether values computed in module `path` (or a module inside a kept one) are kept."""
        return any(fnmatch.fnmatchcase(path, p) or fnmatch.fnmatchcase(path, p + ".*") for p in self.keep)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepOptions:
    """How `step(*batch)` trains on one global batch.

    Attributes:
        clip_grad_norm: clip the global gradient norm to this value (torch's clip_grad_norm_
            rule, across every shard); None: no clipping. The pre-clip norm is returned as
            out["grad_norm"].
        accumulate: micro-batches per optimizer step: the global batch is split into this many
            (the mean of their losses and gradients is the large batch's; see
            xtrain.lowering.accumulation for what that assumes).
        remat: activation checkpointing per layer of the layer scan: "off", "full", "dots" or
            "selective" (see Remat).
        remat_keep: remat="selective": fnmatch patterns over module paths whose activations are
            kept ("blocks.*.attn"); everything else in the layer is recomputed.
        detect_nan: check every step's loss and gradient norm; on a non-finite one, skip the
            update and raise FloatingPointError naming the first module whose output is not finite.
        allow_recompile: let a batch of another shape or dtype compile a new step; by default it
            is an error naming the input that changed.
    """

    clip_grad_norm: float | None = None
    accumulate: int = 1
    remat: Remat | str = Remat.OFF
    remat_keep: tuple[str, ...] = ()
    detect_nan: bool = False
    allow_recompile: bool = False

    def __post_init__(self):
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm={self.clip_grad_norm!r} must be a positive number or None")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate={self.accumulate!r} must be an integer >= 1 (micro-batches per step)")
        try:
            object.__setattr__(self, "remat", Remat(self.remat))
        except ValueError:
            raise ValueError(f"remat={self.remat!r} must be one of {[r.value for r in Remat]}") from None
        object.__setattr__(self, "remat_keep", (self.remat_keep,) if isinstance(self.remat_keep, str)
                           else tuple(self.remat_keep))
        if (self.remat is Remat.SELECTIVE) != bool(self.remat_keep):
            raise ValueError(f"remat_keep={self.remat_keep!r} with remat={self.remat.value!r}: remat='selective' "
                             "needs remat_keep=(module-path patterns, e.g. 'blocks.*.attn'), and only it uses them")

    @property
    def layer_remat(self) -> LayerRemat | None:
        return None if self.remat is Remat.OFF else LayerRemat(self.remat, self.remat_keep)
