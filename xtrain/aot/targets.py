"""GPU targets of a deviceless compile: an `xtrain plan --target` string -> the XLA topology and
target config of that cluster.

A target is 'INSTANCE[:NODES]' (p4d.24xlarge, p4de.24xlarge, p5.48xlarge, p5e.48xlarge,
p5en.48xlarge), parsed like the cost model's (`neuron_support.topology.parse_cluster`). XLA
describes one GPU by a text `stream_executor.GpuTargetConfigProto` (the files in `specs/`) and
the cluster by a topology string 'SLICES x HOSTS x GPUS_PER_HOST': one slice of NODES hosts.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from neuron_support import topology

from xtrain.errors import UnsupportedError

SPECS = Path(__file__).resolve().parent / "specs"
# instance type -> the spec file of its GPU (AWS P4 / P5 pages: A100 40 GB, A100 80 GB, H100 SXM, H200)
GPU_SPECS = {"p4d.24xlarge": "a100_sxm_40", "p4de.24xlarge": "a100_sxm_80", "p5.48xlarge": "h100_sxm",
             "p5e.48xlarge": "h200", "p5en.48xlarge": "h200"}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """A GPU cluster XLA compiles for without it.

    Attributes:
        spec: the target as written ('p5.48xlarge:2').
        instance: the instance type.
        nodes: instances in the cluster.
        gpus_per_node: GPUs of one instance.
        gpu: the spec file's name ('h100_sxm').
    """

    spec: str
    instance: str
    nodes: int
    gpus_per_node: int
    gpu: str

    @property
    def devices(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def topology(self) -> str:
        """XLA's topology string: one slice of `nodes` hosts with `gpus_per_node` GPUs each."""
        return f"1x{self.nodes}x{self.gpus_per_node}"

    @property
    def config(self) -> str:
        """The GpuTargetConfigProto text of one GPU."""
        return (SPECS / f"{self.gpu}.txtpb").read_text()

    @property
    def capacity(self) -> int:
        """Device memory of one GPU in bytes, as the target config gives it to XLA."""
        for line in self.config.splitlines():
            key, _, value = line.strip().partition(":")
            if key == "device_memory_size":
                return int(value)
        raise UnsupportedError(f"target config {self.gpu}.txtpb has no device_memory_size")

    @property
    def device_kind(self) -> str:
        for line in self.config.splitlines():
            key, _, value = line.strip().partition(":")
            if key == "device_description_str":
                return value.strip().strip('"')
        return self.gpu


def gpu_target(spec: str) -> GpuTarget:
    """'p5.48xlarge:2' -> its GpuTarget; an instance without a GPU spec (Trainium, p3) is an
    UnsupportedError naming the ones there are."""
    instance, nodes = topology.parse_cluster(spec)
    if instance.name not in GPU_SPECS:
        raise UnsupportedError(
            f"target {spec!r}: xtrain compiles ahead of time for NVIDIA GPU instances only "
            f"({', '.join(GPU_SPECS)}); {instance.name} has no GPU target config (Trainium plans are checked by "
            "`xtrain plan --target` with the cost model and the Neuron conformance checker)")
    return GpuTarget(spec, instance.name, nodes, instance.devices, GPU_SPECS[instance.name])
