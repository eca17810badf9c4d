"""`xtrain.compile(..., plan="auto")` and `xtrain plan script.py --target ...`.

The plan depends on the batch shapes, which the first `step(*batch)` call brings: both build
nothing at compile time and search at the first call. `plan="auto"` then compiles the pick for
the current devices and trains; under `xtrain plan` (XTRAIN_PLAN_TARGET set) the first call
prints the search for the target cluster and exits, without devices of that kind.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from xtrain.cost import hardware
from xtrain.cost.hardware import HardwareProfile
from xtrain.cost.search import SearchResult, search

PLAN_TARGET = "XTRAIN_PLAN_TARGET"          # set by `xtrain plan --target`
PLAN_GLOBAL_BATCH = "XTRAIN_PLAN_GLOBAL_BATCH"  # set by `xtrain plan --global-batch`
# GPU kinds JAX reports -> the instance whose profile describes them
_GPU_INSTANCES = (("A100", "p4d.24xlarge"), ("H100", "p5.48xlarge"))
_NEURON_INSTANCES = (("trn2", "trn2.48xlarge"), ("nc_v3", "trn2.48xlarge"), ("trn1", "trn1.32xlarge"),
                     ("nc_v2", "trn1.32xlarge"))


def target(spec: str) -> tuple[HardwareProfile, int]:
    """'trn1.32xlarge:4' -> (its profile, 128 devices); 'emulated' or 'emulated:8' -> this
    machine's CPU devices (calibrated)."""
    from neuron_support import topology

    name, _, count = spec.partition(":")
    if name == "emulated":
        import jax

        n = int(count) if count else jax.device_count()
        return hardware.emulated(n), n
    instance, nodes = topology.parse_cluster(spec)
    return hardware.profile(instance.name), nodes * instance.devices


def current_profile() -> HardwareProfile:
    """The profile of the devices this process runs on."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return hardware.emulated(jax.device_count())
    table = _GPU_INSTANCES if device.platform in ("gpu", "cuda") else _NEURON_INSTANCES
    kind = device.device_kind.lower()
    name = next((inst for needle, inst in table if needle.lower() in kind), None)
    if name is None:
        raise ValueError(f"plan='auto' has no hardware profile for device kind {device.device_kind!r}; known "
                         f"profiles: {', '.join(hardware.PROFILES)}. Pass an explicit plan instead")
    return hardware.profile(name)


def _host_batch(batch: tuple) -> tuple:
    from xtrain.data import to_numpy

    return tuple(x if x is None or isinstance(x, (bool, int, float, str)) else to_numpy(x) for x in batch)


def _scaled(batch: tuple, global_batch: int) -> tuple:
    """The batch with its leading dimension set to `global_batch` (shapes only matter)."""
    import jax

    return tuple(jax.ShapeDtypeStruct((global_batch,) + tuple(x.shape[1:]), x.dtype)
                 if isinstance(x, np.ndarray) and x.ndim else x for x in batch)


class PlanProbe:
    """What `xtrain.compile` returns under `xtrain plan`: its first call prints the search for
    the target and exits the process (status 0).

    A training script reads a few things of its step before the first call (a Loader places
    batches on `step.mesh` by `step.batch_spec`, a Monitor counts `step.mesh.size` devices, a
    resumed run starts at `step.step_count`): the probe answers them with a one-device mesh of
    this host (the probe reads only the batch's shapes, and the script's own mesh may not fit
    the devices here), so the script reaches its first step unchanged."""

    step_count = 0
    batch_spec = ("data",)

    def __init__(self, wrapped, tx, module, spec: str):
        import jax

        from xtrain.sharding.mesh import Mesh

        self.wrapped, self.tx, self.module, self.spec = wrapped, tx, module, spec
        self.mesh = Mesh(data=1).build(jax.local_devices()[:1])

    def __call__(self, *batch: Any):
        profile, devices = target(self.spec)
        host = _host_batch(batch)
        if os.environ.get(PLAN_GLOBAL_BATCH):
            host = _scaled(host, int(os.environ[PLAN_GLOBAL_BATCH]))
        result = search(self.wrapped, self.tx, host, profile, devices, module=self.module,
                        target=f"{self.spec} ({devices} devices)")
        print(result, flush=True)
        raise SystemExit(0)


def _agreed(result: SearchResult):
    """The pick of process 0 in every process: each calibrates its own profile, and a job whose
    processes compiled different plans would deadlock in its first collective."""
    import jax

    if jax.process_count() == 1:
        return result.best
    from jax.experimental import multihost_utils

    index = multihost_utils.broadcast_one_to_all(np.int32(result.rows.index(result.best)))
    return result.rows[int(index)]


class AutoStep:
    """`plan="auto"`: at the first `step(*batch)` the search runs for the current devices and
    the pick is compiled; every later call (and attribute) goes to that TrainStep.
    `step.search` holds the full SearchResult. `pipelines=False` leaves pipeline plans out
    (compile options the pipeline step refuses, e.g. accumulate > 1)."""

    def __init__(self, wrapped, tx, module, devices: int, build: Callable, pipelines: bool = True):
        self._wrapped, self._tx, self._module, self._devices = wrapped, tx, module, devices
        self._pipelines = pipelines
        self._build = build  # (mesh sizes, plan) -> TrainStep
        self._step = None
        self.search: SearchResult | None = None

    def __call__(self, *batch: Any):
        if self._step is None:
            self.search = search(self._wrapped, self._tx, _host_batch(batch), current_profile(), self._devices,
                                 module=self._module, pipe_degrees=None if self._pipelines else (1,))
            if self.search.best is None:
                raise ValueError(f"plan='auto': no candidate plan fits the device memory:\n{self.search}")
            best = _agreed(self.search).candidate
            self._step = self._build(best.mesh, best.plan(self._module))
        return self._step(*batch)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if self._step is None:
            raise RuntimeError(f"plan='auto' chooses the plan at the first step(*batch) (it needs the batch "
                               f"shapes); call the step once before .{name}")
        return getattr(self._step, name)
