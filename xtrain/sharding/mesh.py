"""Named device meshes: `Mesh(data=4, tensor=2)`.

`import xtrain` loads this module, so JAX is imported only where a mesh meets devices."""
from __future__ import annotations

import math

import numpy as np

from xtrain.errors import MeshError

# Axis names xtrain's presets and the batch default refer to.
DATA, TENSOR, PIPE = "data", "tensor", "pipe"
# The axis context parallelism splits the sequence over (dimension 1 of the batch by default:
# xtrain.sharding.layout.batch_spec); attention over it is a ring (xtrain.lowering.ring_attention).
CONTEXT = "context"
EXPERT = "expert"  # the expert-parallel axis: one more data axis, and MoE layers' experts split over it


class Mesh:
    """A logical mesh of devices with named axes, in the order given.

    `Mesh(data=4, tensor=2)` puts 4 x 2 devices on axes "data" and "tensor"; the last axis
    varies fastest over the device list, so "tensor" groups neighbouring devices. One axis
    may be -1, meaning "all remaining devices".
    """

    def __init__(self, **axes: int):
        if not axes:
            raise MeshError("Mesh needs at least one named axis, e.g. xtrain.Mesh(data=-1)")
        for name, size in axes.items():
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise MeshError(f"Mesh axis {name}={size!r} must be a positive int or -1")
        if sum(1 for s in axes.values() if s == -1) > 1:
            raise MeshError(
                f"Mesh({self._fmt(axes)}) has more than one -1 axis; at most one axis can take the remaining devices")
        self.axes: dict[str, int] = dict(axes)

    @staticmethod
    def _fmt(axes: dict[str, int]) -> str:
        return ", ".join(f"{k}={v}" for k, v in axes.items())

    def __repr__(self) -> str:
        return f"Mesh({self._fmt(self.axes)})"

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with -1 filled in for `num_devices` devices; errors when they don't fit."""
        known = math.prod(s for s in self.axes.values() if s != -1)
        if -1 in self.axes.values():
            if num_devices % known:
                raise MeshError(
                    f"{self} cannot fill {num_devices} devices: the fixed axes take {known}, "
                    f"which does not divide {num_devices}")
            return {k: (num_devices // known if v == -1 else v) for k, v in self.axes.items()}
        if known != num_devices:
            raise MeshError(f"{self} needs {known} devices but {num_devices} are available; "
                            + self._fixes(known, num_devices))
        return dict(self.axes)

    def _fixes(self, known: int, num_devices: int) -> str:
        """What to change when the axis sizes ask for `known` devices and there are `num_devices`."""
        fixes = []
        if known > num_devices:
            # the likeliest slip: the script never asked for emulated devices
            fixes.append(f"on CPU, emulate {known} devices with xtrain.init(cpu_devices={known}) at the start of "
                         "the script, before any other JAX use")
        fixes.append(f"make the axis sizes multiply to {num_devices}")
        for name in self.axes:  # -1 for one axis fits when the others divide the device count
            rest = known // self.axes[name]
            if num_devices % rest == 0:
                fixed = ", ".join(f"{k}={-1 if k == name else v}" for k, v in self.axes.items())
                fixes.append(f"use -1 for one axis (Mesh({fixed}))")
                break
        return "; or ".join(fixes)

    def build(self, devices: list | None = None):
        """The jax.sharding.Mesh over `devices` (all devices of the job by default)."""
        import jax

        devices = job_devices() if devices is None else list(devices)
        sizes = self.resolve(len(devices))
        grid = np.array(devices, dtype=object).reshape(tuple(sizes.values()))
        return jax.sharding.Mesh(grid, tuple(sizes))


def job_devices() -> list:
    """All devices of the job (every process), in process-major order: a mesh's device order."""
    import jax

    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
