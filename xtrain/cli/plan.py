"""`xtrain plan`: the plan search for a target cluster (memory, step time, tokens/s, MFU of candidate
plans), lowered for an abstract mesh from a script's first step, without training."""
from __future__ import annotations

import contextlib
import sys
from typing import Sequence

from xtrain.cli.script import _intercepted
from xtrain.errors import OptionsError


# xtrain plan's own options: after the script they are the script's (it may define the same flag)
OWN_OPTIONS = ("--target", "--global-batch", "--all", "--compile", "--precision", "--capacity-factor")


def plan(script: str, args: Sequence[str], target: str, global_batch: int | None = None, *,
         show_all: bool = False, compile_top: int = 0, precision: str | None = None,
         capacity_factor: float | None = None) -> int:
    """Runs `script`; its first training step prints the plan search for `target` (lowered for
    an abstract mesh: no devices of that kind needed) instead of training. `compile_top` > 0:
    also compile the best that many candidates with XLA's GPU compiler (xtrain.aot, GPU targets)
    and never pick one the compiler says does not fit. `precision`: every candidate's compute
    precision (None: the target's default, `HardwareProfile.plan_precision`). `capacity_factor`:
    every candidate's MoE capacity (None: the script's plan's, drop-free when it sets none)."""
    from xtrain.cost import hardware

    late = [i for i, a in enumerate(args) if a.split("=")[0] in OWN_OPTIONS]
    if late:
        names = ", ".join(args[i].split("=")[0] for i in late)
        moved = " ".join(" ".join(args[i:i + (1 if "=" in args[i] or args[i] == "--all" else 2)]) for i in late)
        print(f"xtrain plan: {names} after {script} go to the script, not to xtrain plan; xtrain plan's options "
              f"come before the script: xtrain plan --target {target} {moved} {script} ...", file=sys.stderr, flush=True)

    hardware.check_target(target)  # a bad target fails here, before the script runs
    if precision is not None:  # bf16 on a GPU without it fails here too
        hardware.target(target)[0].check_precision(precision)
    if global_batch is not None and global_batch < 1:
        raise OptionsError(f"--global-batch {global_batch} must be >= 1")
    if capacity_factor is not None and not capacity_factor > 0:
        raise OptionsError(f"--capacity-factor {capacity_factor} must be > 0 (e.g. 1.25)")

    def show(step, batch):
        from xtrain.cost import hardware, search
        from xtrain.step import host_batch

        profile, devices = hardware.target(target)
        shapes = _scaled(host_batch(batch), global_batch) if global_batch else host_batch(batch)
        t = step.trainable
        verify = _compiler(step.trainable, shapes, target) if compile_top else None
        capacity = capacity_factor if capacity_factor is not None else getattr(step.plan, "capacity_factor", None)
        with _progress() as lowered:
            result = search.search(t.model, t.tx, shapes, profile, devices, structure=t.structure,
                                   target=f"{target} ({devices} devices)", experts=sorted(t.experts),
                                   verify=verify, verify_top=compile_top or search.VERIFY_TOP, precision=precision,
                                   capacity_factor=capacity, progress=lowered)
        print(result.listing(show_all=show_all), flush=True)

    return _intercepted(script, args, show, build=False, what="plan")


@contextlib.contextmanager
def _progress():
    """A progress line on stderr while the search lowers candidates (seconds each at real size)."""
    from tqdm import tqdm

    with tqdm(desc="xtrain plan: lowering candidates", unit=" plans", file=sys.stderr, leave=False) as bar:
        def lowered(candidate) -> None:
            bar.set_postfix_str(candidate.name, refresh=False)
            bar.update(1)
        yield lowered


def _compiler(trainable, shapes: tuple, target: str):
    """search(verify=...): a candidate compiled for `target`'s GPUs (xtrain.aot), its memory per
    device as XLA's buffer assignment gives it."""
    from xtrain import aot
    from xtrain.aot import request
    from xtrain.cost import search
    from xtrain.sharding.mesh import Mesh

    gpu = aot.gpu_target(target)  # a non-GPU target is refused here, before any search

    def verify(row, plan) -> search.Verified:
        prepared = request.prepare(trainable, Mesh(**row.candidate.mesh), plan, shapes, gpu)
        program, = aot.compile_prepared([prepared])
        return search.Verified(fits=program.memory.fits, memory_bytes=program.memory.total,
                               note=f"compiled for {gpu.spec} in {program.compile_s:.0f} s")

    return verify


def _scaled(batch: tuple, global_batch: int) -> tuple:
    """The batch with its leading dimension set to `global_batch` (shapes only matter)."""
    import jax
    import numpy as np

    return tuple(jax.ShapeDtypeStruct((global_batch,) + tuple(x.shape[1:]), x.dtype)
                 if isinstance(x, np.ndarray) and x.ndim else x for x in batch)
