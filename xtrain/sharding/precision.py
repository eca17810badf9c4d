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
    fp8    as bf16, but matrix multiplications (not convolutions, not attention's kernel)
           take float8_e4m3fn operands and their output gradients float8_e5m2, each tensor
           with its current scale (amax / the format's largest value, this step's), or with
           `scaling="delayed"` the largest amax of the last `amax_history` steps (a history per
           weight, kept as training state: a buffer named `<weight>.amax_history`, checkpointed),
           or with `scaling="rowwise"` one current scale per row of each operand;
           `bf16_modules` keep bf16 matmuls (the LM head, say). On H100 / H200 XLA runs them
           as FP8 GEMMs; on CPU it computes the same values by upcasting
           (xtrain.lowering.fp8). A100, V100 and Trainium1 have no FP8 arithmetic: refused.

Per-module overrides: `fp32_modules` are fnmatch patterns over torch module paths
("*.ln*", "lm_head"); matmuls inside a matching module keep float32 operands; under fp8,
`bf16_modules` likewise keep bf16 ones. The lowering
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
    FP8 = "fp8"


_DTYPES = {Compute.FP32: np.dtype(np.float32), Compute.BF16: np.dtype(ml_dtypes.bfloat16),
           Compute.FP16: np.dtype(np.float16), Compute.FP8: np.dtype(ml_dtypes.bfloat16)}
SCALINGS = ("current", "delayed", "rowwise")  # FP8 scale recipes (xtrain.lowering.fp8)
_WIRE = {Compute.FP32: None, Compute.BF16: "bfloat16", Compute.FP16: "float16", Compute.FP8: "bfloat16"}


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
        compute: "fp32", "bf16", "fp16" or "fp8" (see the module docstring).
        fp32_modules: fnmatch patterns over module paths whose matmuls stay float32.
        bf16_modules: under fp8, fnmatch patterns over module paths whose matmuls run in bf16.
        loss_scale: fp16's dynamic loss scale (default LossScale()); must be None otherwise.
        scaling: under fp8, "current" (each tensor's amax this step), "delayed" (the largest
            amax of the last `amax_history` steps, recorded per weight) or "rowwise" (this step's,
            one scale per row of each operand): xtrain.lowering.fp8.
        amax_history: delayed scaling's history length (steps).
    """

    compute: Compute | str = Compute.FP32
    fp32_modules: tuple[str, ...] = ()
    loss_scale: LossScale | None = None
    bf16_modules: tuple[str, ...] = ()
    scaling: str = "current"
    amax_history: int = 16

    def __post_init__(self):
        try:
            object.__setattr__(self, "compute", Compute(self.compute))
        except ValueError:
            raise PlanError(f"Precision.compute={self.compute!r} must be one of "
                            f"{[c.value for c in Compute]}") from None
        if isinstance(self.fp32_modules, str):
            object.__setattr__(self, "fp32_modules", (self.fp32_modules,))
        object.__setattr__(self, "fp32_modules", tuple(self.fp32_modules))
        if isinstance(self.bf16_modules, str):
            object.__setattr__(self, "bf16_modules", (self.bf16_modules,))
        object.__setattr__(self, "bf16_modules", tuple(self.bf16_modules))
        if self.bf16_modules and self.compute is not Compute.FP8:
            raise PlanError(f"Precision.bf16_modules={self.bf16_modules!r} is for compute='fp8' (it keeps those "
                            f"modules' matmuls in bf16), not {self.compute.value!r}")
        if self.scaling not in SCALINGS:
            raise PlanError(f"Precision.scaling={self.scaling!r} must be one of {list(SCALINGS)}")
        if self.scaling != "current" and self.compute is not Compute.FP8:
            raise PlanError(f"Precision.scaling={self.scaling!r} scales FP8 matmuls: it needs compute='fp8', "
                            f"not {self.compute.value!r}")
        if not isinstance(self.amax_history, int) or self.amax_history < 1:
            raise PlanError(f"Precision.amax_history={self.amax_history!r} must be a positive number of steps")
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

    @property
    def delayed(self) -> bool:
        """Whether FP8 matmuls scale from amax histories (training state)."""
        return self.compute is Compute.FP8 and self.scaling == "delayed"

    def fp8_matmul(self, path: str) -> bool:
        """Whether the matmuls at module `path` run in FP8."""
        return self.compute is Compute.FP8 and not self.keeps_fp32(path) and \
            not any(fnmatch.fnmatchcase(path, p) for p in self.bf16_modules)
