"""A Trainium (or p4d/p5) cluster flown on CPU devices: the mesh real hardware would have,
compiled and run on emulated CPU devices, then checked against the target's rules.

    xtrain.init(emulate="trn1.32xlarge:2")            # 64 CPU devices, the real layout
    cluster = neuron_support.emulate.virtual_cluster("trn1.32xlarge:2", devices=8)  # scaled
    mesh = xtrain.Mesh(**cluster.mesh_axes(tensor=2))
    findings = neuron_support.emulate.check_step(step, *batch, cluster=cluster)

With enough CPU devices the cluster is exact. With fewer (the 8-device test suite), each node
keeps whole chips and the node count, and shrinks to `devices // nodes` devices: collective
groups then keep their shape relative to the node (inside one node or across nodes with the
same cores), which is what the conformance rules look at.
"""
from __future__ import annotations

import dataclasses

from neuron_support import conformance, topology
from neuron_support.topology import Backend, InstanceTopology
from xtrain.errors import MeshError, OptionsError


@dataclasses.dataclass(frozen=True, kw_only=True)
class VirtualCluster:
    """`nodes` instances of one type, each emulated by `devices_per_node` CPU devices.

    Attributes:
        instance: the instance type emulated.
        nodes: instances in the job.
        devices_per_node: CPU devices standing in for one instance (the instance's device
            count when exact, fewer when scaled down).
    """

    instance: InstanceTopology
    nodes: int
    devices_per_node: int

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def scaled(self) -> bool:
        return self.devices_per_node < self.instance.devices

    @property
    def real_axes(self) -> dict[str, int]:
        """The physical axes of the real cluster, e.g. {"node": 2, "chip": 16, "core": 2}."""
        return topology.physical_axes(self.instance, self.nodes)

    @property
    def axes(self) -> dict[str, int]:
        """The physical axes as emulated (equal to `real_axes` unless scaled)."""
        if self.instance.backend is Backend.CUDA:
            return {"node": self.nodes, "gpu": self.devices_per_node}
        per_chip = self.instance.devices_per_chip
        return {"node": self.nodes, "chip": self.devices_per_node // per_chip, "core": per_chip}

    def mesh_axes(self, *, tensor: int = 1, pipe: int = 1) -> dict[str, int]:
        """{"data", "pipe", "tensor"} over the emulated devices, tensor innermost."""
        if self.devices_per_node % tensor:
            raise MeshError(f"tensor={tensor} does not divide the {self.devices_per_node} devices emulating "
                            f"one {self.instance.name}; use a size that divides {self.devices_per_node}")
        if self.instance.node_group_sizes and tensor not in self.instance.node_group_sizes:
            raise MeshError(f"tensor={tensor} is not a replica-group size {self.instance.name} supports "
                            f"inside a node ({', '.join(map(str, self.instance.node_group_sizes))})")
        if self.num_devices % (tensor * pipe):
            raise MeshError(f"tensor={tensor} x pipe={pipe} does not divide the {self.num_devices} devices")
        return {"data": self.num_devices // (tensor * pipe), "pipe": pipe, "tensor": tensor}

    def target(self, runtime: str = conformance.DEFAULT_RUNTIME) -> conformance.Target:
        return conformance.Target.for_instance(self.instance.name, runtime=runtime,
                                               devices_per_node=self.devices_per_node)

    def __str__(self) -> str:
        axes = " x ".join(f"{k}={v}" for k, v in self.axes.items())
        note = f" (scaled from {' x '.join(f'{k}={v}' for k, v in self.real_axes.items())})" if self.scaled else ""
        return f"{self.nodes} x {self.instance.name} on {self.num_devices} CPU devices: {axes}{note}"


def _scaled_node(t: InstanceTopology, nodes: int, devices: int) -> int:
    if devices % nodes:
        raise MeshError(f"{devices} CPU devices cannot emulate {nodes} x {t.name}: use a device count "
                        f"that is a multiple of {nodes}")
    per_node = devices // nodes
    if t.devices % per_node or per_node % t.devices_per_chip:
        raise MeshError(f"{per_node} CPU devices per node cannot stand for whole chips of one {t.name} "
                        f"({t.devices_per_chip} devices per chip, {t.devices} per instance); use "
                        f"{nodes} x a divisor of {t.devices} that is a multiple of {t.devices_per_chip}")
    return per_node


def virtual_cluster(spec: str, devices: int | None = None) -> VirtualCluster:
    """The cluster named by `spec` ("trn1.32xlarge:2" = two instances) on CPU devices.

    Args:
        spec: instance type, optionally ":<nodes>".
        devices: CPU devices available; None or at least the real device count gives the
            exact cluster, fewer gives a scaled one.
    """
    t, nodes = topology.parse_cluster(spec)
    real = nodes * t.devices
    per_node = t.devices if devices is None or devices >= real else _scaled_node(t, nodes, devices)
    return VirtualCluster(instance=t, nodes=nodes, devices_per_node=per_node)


_CURRENT: list[VirtualCluster] = []  # the cluster this process flies (xtrain.init(emulate=...))


def use(cluster: VirtualCluster | None) -> None:
    """Makes `cluster` the one this process emulates (`check_step`'s default)."""
    _CURRENT[:] = [cluster] if cluster is not None else []


def current() -> VirtualCluster | None:
    """The cluster this process emulates, if any."""
    return _CURRENT[0] if _CURRENT else None


def device_order(compiled) -> list[int] | None:
    """Physical device id of every logical device id of a compiled program (jax `Compiled`):
    the device assignment jit chose, as its argument shardings record it."""
    import jax

    for sharding in jax.tree.leaves(compiled.input_shardings):
        assignment = getattr(sharding, "_device_assignment", None)
        if assignment:
            return [d.id for d in assignment]
    executable = compiled.runtime_executable()
    return [d.id for d in executable.local_devices()] if executable is not None else None


def check_compiled(compiled, cluster: VirtualCluster, *, runtime: str = conformance.DEFAULT_RUNTIME):
    """Conformance findings of a jax `Compiled` for `cluster`."""
    return conformance.check(compiled.as_text(), cluster.target(runtime), device_ids=device_order(compiled))


def check_step(step, *batch, cluster: VirtualCluster | None = None,
               runtime: str = conformance.DEFAULT_RUNTIME) -> list[conformance.Finding]:
    """Conformance findings of an xtrain TrainStep's compiled program for `batch`'s shapes.

    Args:
        step: what `xtrain.compile` returned.
        batch: a batch (or none, after the step has run once).
        cluster: the cluster to check against; the one `xtrain.init(emulate=...)` set up by default.
        runtime: the Neuron runtime whose limits apply (see conformance.REPLICA_GROUP_LIMITS).
    """
    if cluster is None:
        cluster = current()
        if cluster is None:
            raise OptionsError("check_step needs cluster=virtual_cluster('trn1.32xlarge:2', ...) or a job "
                               "started with xtrain.init(emulate='trn1.32xlarge:2')")
    return check_compiled(step.compiled(*batch), cluster, runtime=runtime)
