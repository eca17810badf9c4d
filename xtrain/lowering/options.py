"""Options of the training step beyond the plan: clipping, accumulation, NaN detection, input
checks and the recompilation guard (`xtrain.compile(..., **options)`). Activation checkpointing
is the plan's (`Plan(remat=...)`)."""
from __future__ import annotations

import dataclasses

from xtrain.errors import OptionsError


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
        detect_nan: check every step's loss and gradient norm; on a non-finite one, skip the
            update and raise FloatingPointError naming the first module whose output is not
            finite (found after the fact by re-running that step's forward: good steps pay only
            for the norm and the skip's select). None (default): on, except under fp16's
            dynamic loss scaling, whose scaler skips non-finite steps as it searches its scale
            (True raises there too). On by default because one bad step would otherwise write
            NaN into every parameter and the optimizer state for good.
        check_inputs: hold the batch's integer indices (embedding ids, cross-entropy targets,
            x[idx]) to their dimension's range inside the step, as torch does
            (xtrain.lowering.input_checks); an index out of range skips the update and raises
            IndexError naming the batch argument, module, op and value.
        allow_recompile: how many batch shapes (and dtypes) the step may compile: False (one:
            any other is an error naming the input that changed), an integer N (e.g. the number
            of buckets of a bucketing loader) or True (no limit).
    """

    clip_grad_norm: float | None = None
    accumulate: int = 1
    detect_nan: bool | None = None
    check_inputs: bool = True
    allow_recompile: bool | int = False

    def __post_init__(self):
        if self.clip_grad_norm is not None and not self.clip_grad_norm > 0:
            raise OptionsError(f"clip_grad_norm={self.clip_grad_norm!r} must be a positive number or None")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise OptionsError(f"accumulate={self.accumulate!r} must be an integer >= 1 (micro-batches per step)")
        if not isinstance(self.allow_recompile, bool) and not (isinstance(self.allow_recompile, int)
                                                                 and self.allow_recompile >= 1):
            raise OptionsError(f"allow_recompile={self.allow_recompile!r} must be True, False or a number of batch "
                               "shapes >= 1")

    def raises_on_nan(self, loss_scaled: bool) -> bool:
        """Whether a non-finite step is an error (detect_nan resolved for the precision)."""
        return (not loss_scaled) if self.detect_nan is None else self.detect_nan

    @property
    def shape_limit(self) -> float:
        """Batch shapes the step may compile."""
        if isinstance(self.allow_recompile, bool):
            return float("inf") if self.allow_recompile else 1
        return self.allow_recompile
