"""`xtrain report`: the compiled step's report (collectives, memory) for a script, without training."""
from __future__ import annotations

from typing import Sequence

from xtrain.cli.script import _intercepted


def report(script: str, args: Sequence[str]) -> int:
    """Runs `script`; its first training step prints the step's report instead of training."""
    def show(step, batch):
        text = str(step.report(*batch))
        import jax

        if jax.process_index() == 0:
            print(text, flush=True)

    return _intercepted(script, args, show, build=True, what="report")
