"""What a plan keeps in host memory instead of device memory (`Plan(offload=...)`).

    none       everything on the device.
    optimizer  the optimizer state (Adam's moments, momentum buffers, ...) lives in the host
               memory the device can address (JAX memory kind "pinned_host"); each step moves
               it to the device for the update and back (xtrain.lowering.offload). Parameters
               stay on the device: xtrain keeps them in float32 (bf16/fp16 plans cast matmul
               operands, they hold no second, master copy to offload).
    activations  what each layer of the layer scan saves for the backward pass (its input, and
               under remat='dots' / 'selective' the values that remat keeps) goes to that host
               memory instead of device memory, and comes back when the backward pass reaches
               the layer (a jax.checkpoint policy with offload: xtrain.lowering.remat). The rest
               of the layer is recomputed, as under remat='full'.
"""
from __future__ import annotations

import enum

from xtrain.errors import PlanError

HOST_MEMORY = "pinned_host"  # the JAX memory kind of host memory a device reads and writes directly


class Offload(enum.Enum):
    NONE = "none"
    OPTIMIZER = "optimizer"
    ACTIVATIONS = "activations"

    @classmethod
    def of(cls, value: "Offload | str | None") -> "Offload":
        if isinstance(value, Offload):
            return value
        try:
            return cls("none" if value is None else value)
        except ValueError:
            raise PlanError(f"Plan(offload={value!r}) must be one of {[o.value for o in cls]}") from None
