"""Hooks for callers that run a user's training script: the `xtrain report` and `xtrain plan`
commands take each compiled step's first call over, explicitly, for the duration of a block.

    with xtrain.hooks.intercept_first_step(show_report_and_stop):
        runpy.run_path("train.py", run_name="__main__")    # the script as `python train.py` runs it
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

Run = Callable[[Any, tuple], None]  # (the TrainStep, the batch of its first call)


@dataclasses.dataclass(frozen=True)
class FirstStep:
    """What a caller does with a step at its first call instead of training: `run(step, batch)`.
    `build`: the step builds its plan first (a report); False: it stays unbuilt (a plan search
    for another cluster, whose mesh need not fit this host)."""

    run: Run
    build: bool = True


_FIRST_STEP: contextvars.ContextVar[FirstStep | None] = contextvars.ContextVar("xtrain_first_step", default=None)


def first_step() -> FirstStep | None:
    """The hook a step compiled now takes its first call from (None outside such a block)."""
    return _FIRST_STEP.get()


@contextlib.contextmanager
def intercept_first_step(run: Run, *, build: bool = True) -> Iterator[None]:
    """Every step compiled inside the block calls `run(step, batch)` at its first call instead of
    training (the `xtrain report` / `xtrain plan` commands: `run` prints and raises to stop)."""
    token = _FIRST_STEP.set(FirstStep(run, build))
    try:
        yield
    finally:
        _FIRST_STEP.reset(token)
