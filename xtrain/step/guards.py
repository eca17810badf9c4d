"""A step's guards on the host: batches refused before they run (empty ones), and a skipped step
explained after it ran.

The compiled step skips an update itself (xtrain.lowering.grad_transforms.finish_step) when a
batch index is out of range (xtrain.lowering.input_checks) or, with detect_nan, when the loss or
the gradient norm is not finite. Nothing is copied on good steps: a skipped step keeps the
parameters, buffers and RNG stream it read, so the evidence is the state after it and its batch.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from xtrain.errors import BatchIndexError, InputError
from xtrain.lowering import input_checks, nan_check

_SKIPPED = "The update was skipped: parameters and optimizer state are those before this step"


def check_not_empty(batch: Sequence[Any]) -> None:
    """An empty batch would give a NaN mean loss (0 / 0): refused before it runs."""
    for index, x in enumerate(batch):
        shape = tuple(getattr(x, "shape", ()))
        if shape and shape[0] == 0:
            raise InputError(f"batch argument {index} has shape {shape}: an empty batch (no samples). Skip empty "
                             "batches before calling the step (for a loader's short last batch: drop_last=True)")


def _local_rows(x) -> list[np.ndarray]:
    """This process's distinct shards of a placed batch argument, on the host."""
    if not isinstance(x, jax.Array):
        return [np.asarray(x)]
    return [np.asarray(s.data) for s in x.addressable_shards if s.replica_id == 0]


def input_violation(checks: Sequence[input_checks.IndexCheck], placed: tuple):
    """(check, offending value) of the first input check the batch breaks, agreed by every
    process (each reads only its own rows); None if none."""
    shards = {c.arg: _local_rows(placed[c.arg]) for c in checks}
    found = input_checks.first_violation(checks, shards)
    if jax.process_count() == 1:
        return found
    mine = np.array([checks.index(found[0]) if found else -1, found[1] if found else 0], np.int32)
    rows = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    first = next((row for row in rows if row[0] >= 0), None)
    return None if first is None else (checks[int(first[0])], int(first[1]))


def raise_for_inputs(step_count: int, checks, placed: tuple, *, during: str = "train") -> None:
    """IndexError naming the first input check `placed` breaks (none: returns)."""
    violation = input_violation(checks, placed) if checks else None
    if violation is not None:
        check, value = violation
        after = _SKIPPED if during == "train" else "Nothing was evaluated"
        raise BatchIndexError(
            f"step {step_count}{'' if during == 'train' else ' (eval)'}: {check.describe(value)}. {after}")


def explain_skip(step, out: dict, placed: tuple) -> None:
    """After a skipped step: IndexError for an index out of range, else (detect_nan)
    FloatingPointError naming the first module whose forward output is not finite; else the
    skip was fp16's loss scaler's (out["skipped"] says so)."""
    raise_for_inputs(step.step_count, step.lowered.inputs.checks, placed)
    if not step.options.step.raises_on_nan(step.plan.precision.loss_scale is not None):
        return
    state = step.state  # the skipped step kept what it read: parameters, buffers, key
    key = jax.random.fold_in(state.key, state.step - 1)
    params = step.layout.stacking.unstack_dict({**state.params, **state.frozen})
    bad = nan_check.first_nonfinite(step.user_model(), params, state.buffers, key, placed)
    where = ("every forward tensor is finite; the backward pass produced the non-finite gradient"
             if bad is None else f"first non-finite tensor: output of {bad.primitive} (shape {bad.shape}) in "
             f"module {bad.module or '<top level>'!r}")
    raise FloatingPointError(f"step {step.step_count}: loss {out['loss']}, gradient norm {out.get('grad_norm')}; "
                             f"{where}. {_SKIPPED}")
