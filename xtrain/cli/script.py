"""Running a user's training script in this process with its first training step taken over
(`xtrain report`, `xtrain plan`): the script runs as `python script args` would, and stops once
the command has printed."""
from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

from xtrain.errors import LaunchError


class _Stop(Exception):
    """Raised by the first-step hooks below to end the user's script once they have printed."""


def _run_script(script: str, args: Sequence[str]) -> None:
    """Runs `script` in this process as `python script args` would (its __main__ block included)."""
    if not os.path.isfile(script):
        raise LaunchError(f"no script {script!r} (from {os.getcwd()}): give the path of a training script, "
                          "e.g. examples/train_gpt.py")
    argv, path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path


def _intercepted(script: str, args: Sequence[str], run, *, build: bool, what: str) -> int:
    """Runs `script` with its first training step taken over by `run`; 0 once `run` has
    printed, an error when the script never calls a training step."""
    from xtrain.step.hooks import intercept_first_step

    def stop_after(step, batch):
        run(step, batch)
        raise _Stop

    with intercept_first_step(stop_after, build=build):
        try:
            _run_script(script, args)
        except _Stop:
            return 0
    raise LaunchError(f"{script} finished without calling a compiled training step, so there is no {what}: "
                      "`xtrain.compile(...)` then `step(*batch)` must run")
