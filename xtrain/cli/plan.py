"""`xtrain plan`: the plan search for a target cluster (memory, step time, tokens/s, MFU of candidate
plans), lowered for an abstract mesh from a script's first step, without training."""
from __future__ import annotations

import sys
from typing import Sequence

from xtrain.cli.script import _intercepted
from xtrain.errors import OptionsError


# xtrain plan's own options: after the script they are the script's (it may define the same flag)
OWN_OPTIONS = ("--target", "--global-batch", "--all")


def plan(script: str, args: Sequence[str], target: str, global_batch: int | None = None, *,
         show_all: bool = False) -> int:
    """Runs `script`; its first training step prints the plan search for `target` (lowered for
    an abstract mesh: no devices of that kind needed) instead of training."""
    from xtrain.cost import hardware

    late = [i for i, a in enumerate(args) if a.split("=")[0] in OWN_OPTIONS]
    if late:
        names = ", ".join(args[i].split("=")[0] for i in late)
        moved = " ".join(" ".join(args[i:i + (1 if "=" in args[i] or args[i] == "--all" else 2)]) for i in late)
        print(f"xtrain plan: {names} after {script} go to the script, not to xtrain plan; xtrain plan's options "
              f"come before the script: xtrain plan --target {target} {moved} {script} ...", file=sys.stderr, flush=True)

    hardware.check_target(target)  # a bad target fails here, before the script runs
    if global_batch is not None and global_batch < 1:
        raise OptionsError(f"--global-batch {global_batch} must be >= 1")

    def show(step, batch):
        from xtrain.cost import hardware, search
        from xtrain.step import host_batch

        profile, devices = hardware.target(target)
        shapes = _scaled(host_batch(batch), global_batch) if global_batch else host_batch(batch)
        t = step.trainable
        result = search.search(t.model, t.tx, shapes, profile, devices, structure=t.structure,
                               target=f"{target} ({devices} devices)", experts=sorted(t.experts))
        print(result.listing(show_all=show_all), flush=True)

    return _intercepted(script, args, show, build=False, what="plan")


def _scaled(batch: tuple, global_batch: int) -> tuple:
    """The batch with its leading dimension set to `global_batch` (shapes only matter)."""
    import jax
    import numpy as np

    return tuple(jax.ShapeDtypeStruct((global_batch,) + tuple(x.shape[1:]), x.dtype)
                 if isinstance(x, np.ndarray) and x.ndim else x for x in batch)
