"""The precision policy of a Plan: which dtype matrix multiplications run in, and fp16's
dynamic loss scale.

    fp32   everything in float32.
    bf16   matrix multiplications and convolutions run in bfloat16, forward and backward
           (operands and product; the backend accumulates in float32), as under torch.autocast;
           elementwise ops, norms, softmax and the loss see float32 (the products are cast
           back); gradients cross the wire in bfloat16 (explicit lowering).
           Parameters and optimizer state (the master copy) stay float32.
    fp16   as bf16 with float16, plus a dynamic loss scale: the loss is multiplied by the
           scale before differentiation and the gradients divided by it; a step whose
           gradients are not finite is skipped (parameters, optimizer state and buffers kept),
           the scale is halved; after `growth_interval` good steps in a row it doubles. The
           scale and the good-step count live in TrainState.loss_scale (checkpointed with it).

Per-module overrides: `fp32_modules` are fnmatch patterns over torch module paths
("*.ln*", "lm_head"); matmuls inside a matching module keep float32 operands. The lowering
applies the policy to the traced graph (xtrain.lowering.precision).
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch

import ml_dtypes  # bfloat16 for numpy (a JAX dependency; importing jax here would load it for `import xtrain`)
import numpy as np

from xtrain.errors import PlanError


class Compute(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


_DTYPES = {Compute.FP32: np.dtype(np.float32), Compute.BF16: np.dtype(ml_dtypes.bfloat16),
           Compute.FP16: np.dtype(np.float16)}
_WIRE = {Compute.FP32: None, Compute.BF16: "bfloat16", Compute.FP16: "float16"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScale:
    """fp16's dynamic loss scale (torch.amp.GradScaler's rule).

    Attributes:
        initial: the scale of the first step.
        growth_interval: consecutive finite steps after which the scale is multiplied by `factor`.
        factor: growth on `growth_interval` good steps; the scale is divided by it on overflow.
    """

    initial: float = 2.0 ** 15
    growth_interval: int = 2000
    factor: float = 2.0

    def __post_init__(self):
        if not self.initial > 0:
            raise PlanError(f"LossScale.initial={self.initial!r} must be positive")
        if self.growth_interval < 1:
            raise PlanError(f"LossScale.growth_interval={self.growth_interval!r} must be >= 1")
        if not self.factor > 1:
            raise PlanError(f"LossScale.factor={self.factor!r} must be > 1 (2.0 halves on overflow)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precision:
    """The precision policy of a Plan (`Plan(precision="bf16")` is shorthand).

    Attributes:
        compute: "fp32", "bf16" or "fp16" (see the module docstring).
        fp32_modules: fnmatch patterns over module paths whose matmuls stay float32.
        loss_scale: fp16's dynamic loss scale (default LossScale()); must be None otherwise.
    """

    compute: Compute | str = Compute.FP32
    fp32_modules: tuple[str, ...] = ()
    loss_scale: LossScale | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "compute", Compute(self.compute))
        except ValueError:
            raise PlanError(f"Precision.compute={self.compute!r} must be one of "
                            f"{[c.value for c in Compute]}") from None
        if isinstance(self.fp32_modules, str):
            object.__setattr__(self, "fp32_modules", (self.fp32_modules,))
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
        if self.compute is Compute.FP16 and self.loss_scale is None:
            object.__setattr__(self, "loss_scale", LossScale())
        if self.compute is not Compute.FP16 and self.loss_scale is not None:
            raise PlanError(f"Precision.loss_scale={self.loss_scale!r} is only used with compute='fp16', "
                            f"not {self.compute.value!r}")

    @classmethod
    def of(cls, value: "Precision | str") -> "Precision":
        return value if isinstance(value, Precision) else cls(compute=value)

    @property
    def dtype(self):
        return _DTYPES[self.compute]

    @property
    def wire_dtype(self) -> str | None:
        """Gradient-sync dtype this policy implies (GradSync.comm_dtype)."""
        return _WIRE[self.compute]

    def keeps_fp32(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, p) for p in self.fp32_modules)
