"""What one instance holds: chips, cores, memory and links, and the mesh that follows them.

Each number names its public source: the AWS EC2 instance pages (aws.amazon.com/ec2/instance-types/
trn1/, /trn2/, /p3/, /p4/, /p5/; the P5 page covers p5e and p5en, the H200 instances), NVIDIA's
datasheets (V100, A100, H100, H200) and the AWS Neuron documentation
(awsdocs-neuron.readthedocs-hosted.com: "Trainium Architecture", "Neuron Collective
Communication"). The GPU rows exist so p3/p4/p5-shaped meshes can be planned and emulated the
same way.
"""
from __future__ import annotations

import dataclasses
import enum
import math

from xtrain.errors import MeshError, OptionsError

GIB = 2**30

# Neuron docs (Neuron Collective Communication, trn1): inside a node, replica groups of size 1,
# 2, (4), 8 or 32 starting at a core index that is a multiple of the size. The docs print 4 in
# parentheses (allowed, but marked apart); it is accepted here. 16 is not in the list.
TRN1_GROUP_SIZES = (1, 2, 4, 8, 32)


class Backend(str, enum.Enum):
    NEURON = "neuron"
    CUDA = "cuda"


@dataclasses.dataclass(frozen=True, kw_only=True)
class InstanceTopology:
    """One instance type.

    Attributes:
        name: EC2 instance type, e.g. "trn1.32xlarge".
        backend: the PJRT backend its accelerators use.
        chips: accelerator chips (Trainium chips or GPUs) per instance.
        cores_per_chip: physical cores per chip (NeuronCores; 1 for a GPU).
        logical_core_size: physical cores fused into one device JAX sees (trn2's LNC=2).
        hbm_gib_per_chip: HBM capacity per chip, GiB.
        hbm_gib_s_per_chip: HBM bandwidth per chip, GiB/s (None: not known here).
        interconnect: links between the chips of one instance.
        efa_gbit_s: EFA bandwidth of the instance, Gbit/s (0: no EFA).
        ena_gbit_s: the instance's network without EFA (ENA), Gbit/s, where it has no EFA.
        compiler_target: neuronx-cc --target (None for GPUs).
        node_group_sizes: replica-group sizes a collective may use inside one instance (None:
            no known restriction).
    """

    name: str
    backend: Backend
    chips: int
    cores_per_chip: int
    logical_core_size: int = 1
    hbm_gib_per_chip: float
    hbm_gib_s_per_chip: float | None
    interconnect: str
    efa_gbit_s: int
    ena_gbit_s: float = 0.0
    compiler_target: str | None = None
    node_group_sizes: tuple[int, ...] | None = None

    @property
    def devices_per_chip(self) -> int:
        """Devices JAX shows per chip (NeuronCores, logical cores on trn2, 1 per GPU)."""
        return self.cores_per_chip // self.logical_core_size

    @property
    def devices(self) -> int:
        """Devices JAX shows per instance."""
        return self.chips * self.devices_per_chip

    @property
    def network_gbit_s(self) -> float:
        """What the instance sends to other instances, Gbit/s: its EFA, else its ENA network."""
        return self.efa_gbit_s or self.ena_gbit_s

    @property
    def hbm_bytes_per_device(self) -> int:
        return int(self.hbm_gib_per_chip * GIB) // self.devices_per_chip


INSTANCES: dict[str, InstanceTopology] = {t.name: t for t in (
    InstanceTopology(
        name="trn1.2xlarge", backend=Backend.NEURON, compiler_target="trn1",
        chips=1, cores_per_chip=2,            # AWS Trn1 page: 1 Trainium chip; Neuron docs: 2 NeuronCore-v2 per chip
        hbm_gib_per_chip=32,                  # AWS Trn1 page: 32 GiB accelerator memory
        hbm_gib_s_per_chip=820,               # Neuron docs (Trainium Architecture): 820 GB/s per chip
        interconnect="none (one chip)",
        efa_gbit_s=0, ena_gbit_s=12.5,        # AWS Trn1 page: no EFA, up to 12.5 Gbps ENA
        node_group_sizes=(1, 2),              # TRN1_GROUP_SIZES that fit 2 cores
    ),
    InstanceTopology(
        name="trn1.32xlarge", backend=Backend.NEURON, compiler_target="trn1",
        chips=16, cores_per_chip=2,           # AWS Trn1 page: 16 Trainium chips (2 NeuronCore-v2 each)
        hbm_gib_per_chip=32,                  # AWS Trn1 page: 512 GiB accelerator memory in all
        hbm_gib_s_per_chip=820,               # Neuron docs (Trainium Architecture): 820 GB/s per chip
        interconnect="NeuronLink-v2 2D torus",  # Neuron docs (Trn1 Architecture): NeuronLink-v2 2D torus
        efa_gbit_s=800,                       # AWS Trn1 page: 800 Gbps EFA
        node_group_sizes=TRN1_GROUP_SIZES,
    ),
    InstanceTopology(
        name="trn1n.32xlarge", backend=Backend.NEURON, compiler_target="trn1n",
        chips=16, cores_per_chip=2,           # AWS Trn1 page: trn1n as trn1.32xlarge, twice the network
        hbm_gib_per_chip=32,                  # AWS Trn1 page: as trn1.32xlarge
        hbm_gib_s_per_chip=820,               # AWS Trn1 page: as trn1.32xlarge
        interconnect="NeuronLink-v2 2D torus",  # AWS Trn1 page: as trn1.32xlarge
        efa_gbit_s=1600,                      # AWS Trn1 page: 1600 Gbps EFA
        node_group_sizes=TRN1_GROUP_SIZES,
    ),
    InstanceTopology(
        name="trn2.48xlarge", backend=Backend.NEURON, compiler_target="trn2",
        chips=16, cores_per_chip=8,           # AWS Trn2 page: 16 Trainium2 chips; Neuron docs: 8 NeuronCore-v3 each
        logical_core_size=2,                  # Neuron docs (Logical NeuronCore): 64 logical cores at LNC=2
        hbm_gib_per_chip=96,                  # AWS Trn2 page: 1.5 TiB accelerator memory in all
        hbm_gib_s_per_chip=None,              # not given per chip by the pages above
        interconnect="NeuronLink-v3 2D torus",  # AWS Trn2 page
        efa_gbit_s=3200,                      # AWS Trn2 page: 3.2 Tbps EFAv3
    ),
    InstanceTopology(
        name="p4d.24xlarge", backend=Backend.CUDA,
        chips=8, cores_per_chip=1,            # AWS P4d page: 8 x A100
        hbm_gib_per_chip=40,                  # AWS P4d page: 40 GB HBM2 per A100 (320 GB total)
        hbm_gib_s_per_chip=1448,              # NVIDIA A100 40GB datasheet: 1,555 GB/s = 1448 GiB/s
        interconnect="NVLink 3 through NVSwitch, 600 GB/s per GPU",  # AWS P4d page
        efa_gbit_s=400,                       # AWS P4d page: 400 Gbps EFA
    ),
    InstanceTopology(
        name="p4de.24xlarge", backend=Backend.CUDA,
        chips=8, cores_per_chip=1,            # AWS P4 page: p4de, 8 x A100 80GB
        hbm_gib_per_chip=80,                  # AWS P4 page: 80 GB HBM2e per A100 (640 GB total)
        hbm_gib_s_per_chip=1899,              # NVIDIA A100 80GB SXM datasheet: 2,039 GB/s = 1899 GiB/s
        interconnect="NVLink 3 through NVSwitch, 600 GB/s per GPU",  # AWS P4 page: as p4d
        efa_gbit_s=400,                       # AWS P4 page: 400 Gbps EFA
    ),
    InstanceTopology(
        name="p5.48xlarge", backend=Backend.CUDA,
        chips=8, cores_per_chip=1,            # AWS P5 page: 8 x H100
        hbm_gib_per_chip=80,                  # AWS P5 page: 80 GB HBM3 per H100 (640 GB total)
        hbm_gib_s_per_chip=3120,              # NVIDIA H100 SXM datasheet: 3.35 TB/s = 3120 GiB/s
        interconnect="NVLink 4 through NVSwitch, 900 GB/s per GPU",  # AWS P5 page
        efa_gbit_s=3200,                      # AWS P5 page: 3200 Gbps EFA
    ),
    InstanceTopology(
        name="p5e.48xlarge", backend=Backend.CUDA,
        chips=8, cores_per_chip=1,            # AWS P5 page: p5e, 8 x H200
        hbm_gib_per_chip=141,                 # AWS P5 page / NVIDIA H200 datasheet: 141 GB HBM3e per GPU
        hbm_gib_s_per_chip=4470,              # NVIDIA H200 datasheet: 4.8 TB/s = 4470 GiB/s
        interconnect="NVLink 4 through NVSwitch, 900 GB/s per GPU",  # AWS P5 page
        efa_gbit_s=3200,                      # AWS P5 page: 3200 Gbps EFA
    ),
    InstanceTopology(
        name="p5en.48xlarge", backend=Backend.CUDA,
        chips=8, cores_per_chip=1,            # AWS P5 page: p5en, 8 x H200 (with Intel Sapphire Rapids, PCIe Gen5)
        hbm_gib_per_chip=141,                 # AWS P5 page / NVIDIA H200 datasheet: 141 GB HBM3e per GPU
        hbm_gib_s_per_chip=4470,              # NVIDIA H200 datasheet: 4.8 TB/s = 4470 GiB/s
        interconnect="NVLink 4 through NVSwitch, 900 GB/s per GPU",  # AWS P5 page
        efa_gbit_s=3200,                      # AWS P5 page: 3200 Gbps EFAv3
    ),
    # V100 (AWS P3 page; NVIDIA V100 datasheet, SXM2: 16 or 32 GB HBM2 at 900 GB/s = 838 GiB/s,
    # NVLink 2 at 300 GB/s per GPU). No EFA except on p3dn; the others' network is ENA.
    InstanceTopology(
        name="p3.2xlarge", backend=Backend.CUDA,
        chips=1, cores_per_chip=1,            # AWS P3 page: 1 x V100, 16 GB
        hbm_gib_per_chip=16, hbm_gib_s_per_chip=838,
        interconnect="none (one GPU)",
        efa_gbit_s=0, ena_gbit_s=10,          # AWS P3 page: up to 10 Gbps
    ),
    InstanceTopology(
        name="p3.8xlarge", backend=Backend.CUDA,
        chips=4, cores_per_chip=1,            # AWS P3 page: 4 x V100, 64 GB in all
        hbm_gib_per_chip=16, hbm_gib_s_per_chip=838,
        interconnect="NVLink 2, 300 GB/s per GPU",  # AWS P3 page: NVLink peer to peer
        efa_gbit_s=0, ena_gbit_s=10,          # AWS P3 page: 10 Gbps
    ),
    InstanceTopology(
        name="p3.16xlarge", backend=Backend.CUDA,
        chips=8, cores_per_chip=1,            # AWS P3 page: 8 x V100, 128 GB in all
        hbm_gib_per_chip=16, hbm_gib_s_per_chip=838,
        interconnect="NVLink 2 hybrid cube-mesh, 300 GB/s per GPU",  # AWS P3 page; NVIDIA DGX-1 layout
        efa_gbit_s=0, ena_gbit_s=25,          # AWS P3 page: 25 Gbps
    ),
    InstanceTopology(
        name="p3dn.24xlarge", backend=Backend.CUDA,
        chips=8, cores_per_chip=1,            # AWS P3 page: 8 x V100 32 GB, 256 GB in all
        hbm_gib_per_chip=32, hbm_gib_s_per_chip=838,
        interconnect="NVLink 2 hybrid cube-mesh, 300 GB/s per GPU",  # AWS P3 page
        efa_gbit_s=100,                       # AWS P3 page: 100 Gbps, EFA
    ),
)}


def instance(name: str | InstanceTopology) -> InstanceTopology:
    """The topology of an instance type ("trn1.32xlarge"; SageMaker's "ml." prefix is allowed)."""
    if isinstance(name, InstanceTopology):
        return name
    key = name[3:] if name.startswith("ml.") else name
    if key not in INSTANCES:
        raise OptionsError(f"unknown instance type {name!r}; known: {', '.join(INSTANCES)}")
    return INSTANCES[key]


def parse_cluster(spec: str) -> tuple[InstanceTopology, int]:
    """'trn1.32xlarge:2' -> (trn1.32xlarge, 2 nodes); a bare name means one node."""
    name, _, count = spec.partition(":")
    if count and not (count.isdigit() and int(count) >= 1):
        raise OptionsError(f"cluster spec {spec!r}: the node count after ':' must be a positive "
                           "integer, e.g. 'trn1.32xlarge:2'")
    return instance(name), int(count or 1)


def physical_axes(topology: str | InstanceTopology, nodes: int = 1) -> dict[str, int]:
    """Mesh axes in the order devices are numbered: node, then chip, then core.

    Trainium: {"node": n, "chip": 16, "core": 2} for trn1.32xlarge (4 logical cores per chip
    on trn2); GPUs: {"node": n, "gpu": 8}.
    """
    t = instance(topology)
    if t.backend is Backend.CUDA:
        return {"node": nodes, "gpu": t.chips}
    return {"node": nodes, "chip": t.chips, "core": t.devices_per_chip}


def mesh_axes(topology: str | InstanceTopology, nodes: int = 1, *, tensor: int = 1,
              pipe: int = 1) -> dict[str, int]:
    """Logical axes {"data", "pipe", "tensor"} laid over the physical layout.

    Devices are numbered node-major (node, chip, core) and the last mesh axis varies fastest,
    so "tensor" (the chattiest axis) takes neighbouring cores inside one instance, "pipe" the
    next ones and "data" the rest, across nodes. Axes of size 1 are kept so a plan can always
    name them.

    Args:
        topology: instance type or its topology.
        nodes: instances in the job.
        tensor: tensor-parallel degree; must divide the devices of one instance.
        pipe: pipeline stages.

    Returns:
        {"data": d, "pipe": p, "tensor": t} with d * p * t = nodes * devices per instance.
    """
    t = instance(topology)
    if t.node_group_sizes and tensor not in t.node_group_sizes:
        raise MeshError(f"tensor={tensor} is not a replica-group size {t.name} supports inside a node "
                        f"({', '.join(map(str, t.node_group_sizes))}); pick one of those")
    if t.devices % tensor:
        raise MeshError(f"tensor={tensor} does not divide the {t.devices} devices of one {t.name}; "
                        "tensor parallelism stays inside an instance: use a size that divides "
                        f"{t.devices}")
    total = nodes * t.devices
    if total % (tensor * pipe):
        raise MeshError(f"tensor={tensor} x pipe={pipe} does not divide the {total} devices of "
                        f"{nodes} x {t.name}; choose sizes whose product divides {total}")
    return {"data": total // (tensor * pipe), "pipe": pipe, "tensor": tensor}


def describe(topology: str | InstanceTopology) -> str:
    t = instance(topology)
    bandwidth = f"{t.hbm_gib_s_per_chip:g} GiB/s" if t.hbm_gib_s_per_chip else "bandwidth n/a"
    return (f"{t.name}: {t.chips} chips x {t.cores_per_chip} cores "
            f"({t.devices} devices), {t.hbm_gib_per_chip:g} GiB HBM per chip ({bandwidth}), "
            f"{t.interconnect}, " + (f"EFA {t.efa_gbit_s} Gbit/s" if t.efa_gbit_s else
                                     f"network {t.ena_gbit_s:g} Gbit/s (no EFA)"))


def total_devices(topology: str | InstanceTopology, nodes: int = 1) -> int:
    return math.prod(physical_axes(topology, nodes).values())
