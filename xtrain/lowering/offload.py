"""Optimizer state in host memory (`Plan(offload="optimizer")`, xtrain.sharding.offload).

Between steps the state's arrays live in the host memory the device addresses (memory kind
"pinned_host": their shardings say so, xtrain.lowering.state). Inside the step each array is
moved to the device before the update reads it (`fetch`) and the updated array back to the
host (`store`): one transfer per tensor each way, which XLA issues as asynchronous copies and
schedules around the update; the traffic per step is twice the state's bytes.
"""
from __future__ import annotations

from typing import Any

import jax


def fetch(tree: Any) -> Any:
    """Every array of `tree` moved to device memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def store(tree: Any) -> Any:
    """Every array of `tree` moved to host memory."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def check_host_memory(device) -> None:
    """Fails when `device` cannot address pinned host memory (naming what it offers)."""
    kinds = [m.kind for m in device.addressable_memories()]
    if "pinned_host" not in kinds:
        raise ValueError(f"Plan(offload='optimizer') keeps the optimizer state in host memory the device addresses "
                         f"('pinned_host'), but {device.device_kind} offers only {kinds}; use offload='none' "
                         "(ZeRO, zero=1..3, splits the state over the data-parallel devices instead)")
