"""Public alias of xtrain.step.hooks.intercept_first_step: the `xtrain report` / `xtrain plan` hook
for callers that run a user's training script (defined with the step, in xtrain.step.hooks)."""
from xtrain.step.hooks import intercept_first_step

__all__ = ["intercept_first_step"]
