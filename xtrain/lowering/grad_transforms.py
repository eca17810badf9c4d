"""What happens to gradients between the backward pass and the optimizer, and to the update
after it, the same in both lowerings:

    unscale   fp16: divide by the loss scale (gradients are of loss x scale)
    norm      the global gradient norm (clipping.global_norm), when clipping or when a
              non-finite step must be detected (fp16 overflow, detect_nan)
    clip      torch's clip_grad_norm_ rule
    lr        each update times its param group's current lr (scale_by_lr)
    skip      fp16 / detect_nan / input checks: a step whose loss or gradient norm is not finite
              keeps the old parameters, optimizer state and buffers (finish_step); fp16's scale moves
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import jax.numpy as jnp

from xtrain.ir.stacked import member
from xtrain.lowering import clipping, precision
from xtrain.lowering.options import StepOptions
from xtrain.sharding.precision import LossScale


@dataclasses.dataclass(frozen=True)
class GradTransforms:
    """Attributes:
        max_norm: clip the global gradient norm to this (None: no clipping).
        lr_groups: parameter name -> param group whose lr scales its update (None: the lr is
            inside the optax transformation).
        check_finite: skip a step whose loss or gradient norm is not finite (detect_nan, and the
            input checks, which poison the gradients of a batch they refuse).
        loss_scale: fp16's dynamic loss scale rule (implies check_finite).
    """

    max_norm: float | None = None
    lr_groups: Mapping[str, int] | None = None
    check_finite: bool = False
    loss_scale: LossScale | None = None

    @classmethod
    def of(cls, options: StepOptions, lr_groups: Mapping[str, int] | None = None,
           loss_scale: LossScale | None = None) -> "GradTransforms":
        """What a step with `options` does to its gradients: it skips non-finite steps when it
        raises on them (detect_nan) and when it checks its inputs (a refused batch's gradients
        are NaN), and always under fp16's loss scaling."""
        skips = options.check_inputs or options.raises_on_nan(loss_scale is not None)
        return cls(options.clip_grad_norm, lr_groups, skips, loss_scale)

    @property
    def skips(self) -> bool:
        return self.check_finite or self.loss_scale is not None

    @property
    def needs_norm(self) -> bool:
        return self.max_norm is not None or self.skips

    def before_update(self, grads: Mapping, split_axes: Mapping[str, tuple[str, ...]], scale=None):
        """(gradients unscaled and clipped, global norm or None)."""
        grads = dict(grads) if scale is None else {n: g / scale.astype(g.dtype) for n, g in grads.items()}
        norm = clipping.global_norm(grads, split_axes) if self.needs_norm else None
        if self.max_norm is not None:
            grads = clipping.clip(grads, norm, self.max_norm)
        return grads, norm

    def scale_lr(self, updates: Mapping, lrs) -> dict:
        return scale_by_lr(updates, lrs, self.lr_groups)


def finish_step(old, new, loss, norm, grad_tx: GradTransforms):
    """(next TrainState, step outputs): counts the step; under fp16 / detect_nan keeps `old`'s
    parameters, optimizer state, buffers and int8 residuals when the step is not finite and moves the loss
    scale. Outputs: loss, grad_norm (pre-clip, when computed), skipped and loss_scale."""
    out = {"loss": loss} if norm is None else {"loss": loss, "grad_norm": norm}
    new = dataclasses.replace(new, step=old.step + 1)
    if not grad_tx.skips:
        return new, out
    finite = jnp.isfinite(norm) & jnp.isfinite(loss)
    fields = ("params", "opt_state", "buffers", "grad_residual")
    kept = precision.keep_if(finite, tuple(getattr(new, f) for f in fields), tuple(getattr(old, f) for f in fields))
    new = dataclasses.replace(new, **dict(zip(fields, kept)))
    out["skipped"] = ~finite
    if old.loss_scale is not None:
        out["loss_scale"] = old.loss_scale["scale"]
        new = dataclasses.replace(new, loss_scale=precision.next_state(old.loss_scale, finite, grad_tx.loss_scale))
    return new, out


def scale_by_lr(updates: Mapping, lrs, groups: Mapping[str, int] | None) -> dict:
    """Each parameter's update times its group's lr (`lrs[groups[name]]`); no-op for optax
    transformations passed by the user (groups=None: their lr is inside the transformation).
    A stacked family takes its layer 0's group (every layer of a family is in the same one)."""
    if groups is None:
        return dict(updates)
    return {n: u * lrs[groups[member(n, 0)]].astype(u.dtype) for n, u in updates.items()}
