"""Optimizer state in host memory (`Plan(offload="optimizer")`, xtrain.sharding.offload), and
the count of offloaded activations (`Plan(offload="activations")`: xtrain.lowering.remat).

Between steps the state's arrays live in the host memory the device addresses (memory kind
"pinned_host": their shardings say so, xtrain.lowering.state). Inside the step each array is
moved to the device before the update reads it (`fetch`) and the updated array back to the
host (`store`): one transfer per tensor each way, which XLA issues as asynchronous copies and
schedules around the update; the traffic per step is twice the state's bytes.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from xtrain.errors import UnsupportedError
from xtrain.lowering import remat


def fetch(tree: Any) -> Any:
    """Every array of `tree` moved to device memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def store(tree: Any) -> Any:
    """Every array of `tree` moved to host memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def check_host_memory(device, what: str = "optimizer") -> None:
    """Fails when `device` cannot address pinned host memory (naming what it offers) for
    Plan(offload=`what`)."""
    kinds = [m.kind for m in device.addressable_memories()]
    if "pinned_host" not in kinds:
        instead = ("ZeRO, zero=1..3, splits the state over the data-parallel devices instead" if what == "optimizer"
                   else "remat='full' recomputes the activations instead")
        raise UnsupportedError(
            f"Plan(offload={what!r}) keeps the {what} {'state ' if what == 'optimizer' else ''}in host "
            f"memory the device addresses ('pinned_host'), but {device.device_kind} offers only {kinds}; "
            f"use offload='none' ({instead})")


def offloaded_activation_bytes(closed) -> int:
    """Bytes per device per step of the activations a program offloads (Plan(offload=
    "activations")): its copies to host memory of values tagged for offload (xtrain.lowering.remat),
    a scan body's once per iteration."""
    return _offloaded(closed.jaxpr, 1)


def _offloaded(jaxpr, times: int) -> int:
    named = {v for e in jaxpr.eqns if str(e.primitive) == "name" and e.params.get("name") in remat.OFFLOADED
             for v in e.outvars}
    total = 0
    for eqn in jaxpr.eqns:
        if str(eqn.primitive) == "device_put" and jax.memory.Space.Host in eqn.params.get("devices", ()):
            total += times * sum(_nbytes(v.aval) for v in eqn.invars if v in named)
        repeat = times * eqn.params["length"] if str(eqn.primitive) == "scan" else times
        total += sum(_offloaded(sub, repeat) for sub in jcore.jaxprs_in_params(eqn.params))
    return total


def _nbytes(aval) -> int:
    return math.prod(aval.shape) * np.dtype(aval.dtype).itemsize
