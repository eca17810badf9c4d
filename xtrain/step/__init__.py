"""The training step and the helpers that live with it.

    train.py      TrainStep: deferred (waiting for the first batch) or built; runs, evaluates,
                  holds the state, saves and loads checkpoints
    autoplan.py   plan="auto": the cost search for these devices, the same pick in every process
    explain.py    step.report(): the plan, layout, collectives, memory and notes of a built step
    guards.py     empty batches refused; a skipped step explained (an index out of range, the first NaN)
    recompile.py  batch signatures: a new one recompiles, past the shape limit it is refused
    hooks.py      callers that run a user's script (`xtrain report`, `xtrain plan`) take each
                  step's first call over (public as xtrain.hooks)
"""
from xtrain.step.train import AUTO, RESIDUAL, CompileOptions, Deferred, TrainStep, host_batch

__all__ = ["AUTO", "RESIDUAL", "CompileOptions", "Deferred", "TrainStep", "host_batch"]
