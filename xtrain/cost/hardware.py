"""Hardware profiles: what one device computes, holds and moves, per instance type.

Capacities and HBM bandwidth come from `neuron_support.topology` (one home, cited there); this
file adds peak FLOP/s per dtype and the link bandwidths, each cited. Bandwidths are per device
and per direction (what a ring collective's step can send), in bytes/s.

`emulated()` is this machine: N XLA CPU devices time-sharing the host's cores, collectives done
as memory copies between buffers of one process. It is calibrated by a short measurement
(a matmul, an elementwise chain, a psum of a large and a tiny buffer over the emulated mesh),
so predictions on it are in this host's seconds.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Mapping

from neuron_support import topology

from xtrain.errors import OptionsError, UnsupportedError

GB = 1e9
TFLOPS = 1e12

# Dense (no sparsity) peak FLOP/s per device, by dtype.
_PEAKS: dict[str, dict[str, float]] = {
    # NVIDIA A100 SXM datasheet: 312 BF16/FP16 tensor, 156 TF32 tensor, 19.5 FP32 TFLOP/s.
    "A100": {"bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS, "tf32": 156 * TFLOPS, "fp32": 19.5 * TFLOPS},
    # NVIDIA H100 SXM datasheet: 1979 FP8, 989 BF16/FP16, 494 TF32 tensor, 67 FP32 TFLOP/s (dense:
    # half the datasheet's with-sparsity figures).
    "H100": {"fp8": 1979 * TFLOPS, "bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "tf32": 494 * TFLOPS,
             "fp32": 67 * TFLOPS},
    # NVIDIA H100 datasheet, PCIe column: 1513 FP8, 756 BF16/FP16, 378 TF32, 51 FP32 TFLOP/s (dense).
    "H100 PCIe": {"fp8": 1513 * TFLOPS, "bf16": 756 * TFLOPS, "fp16": 756 * TFLOPS, "tf32": 378 * TFLOPS,
                  "fp32": 51 * TFLOPS},
    # NVIDIA H100 NVL / H200 NVL datasheets: 1671 FP8, 835 BF16/FP16, 418 TF32, 60 FP32 TFLOP/s (dense).
    "NVL": {"fp8": 1671 * TFLOPS, "bf16": 835 * TFLOPS, "fp16": 835 * TFLOPS, "tf32": 418 * TFLOPS,
            "fp32": 60 * TFLOPS},
    # NVIDIA V100 datasheet, SXM2 column (the P3 instances' GPU): 125 FP16 tensor, 15.7 FP32
    # TFLOP/s. Volta has neither bfloat16 nor TF32 arithmetic: no bf16 key (plans use fp16).
    "V100": {"fp16": 125 * TFLOPS, "fp32": 15.7 * TFLOPS},
    # NVIDIA H200 datasheet: the H100 SXM's compute (1979 FP8, 989 BF16, 494 TF32, 67 FP32 dense).
    "H200": {"fp8": 1979 * TFLOPS, "bf16": 989 * TFLOPS, "fp16": 989 * TFLOPS, "tf32": 494 * TFLOPS,
             "fp32": 67 * TFLOPS},
    # Neuron docs, Trainium architecture: one chip (2 NeuronCore-v2) = 190 FP16/BF16/TF32 and
    # 47.5 FP32 TFLOP/s; a device is one NeuronCore, half of that.
    "trn1": {"bf16": 95 * TFLOPS, "fp16": 95 * TFLOPS, "tf32": 95 * TFLOPS, "fp32": 23.75 * TFLOPS},
    # Neuron docs, Trainium2 architecture: one chip (8 NeuronCore-v3) = 1299 FP8, 667 BF16/FP16/TF32
    # and 181 FP32 TFLOP/s dense; a device is one logical core (LNC=2, the default), a quarter of the chip.
    "trn2": {"fp8": 324.75 * TFLOPS, "bf16": 166.75 * TFLOPS, "fp16": 166.75 * TFLOPS, "tf32": 166.75 * TFLOPS,
             "fp32": 45.25 * TFLOPS},
    # ... or one physical NeuronCore-v3 under LNC=1: an eighth of the chip.
    "trn2 core": {"fp8": 162.375 * TFLOPS, "bf16": 83.375 * TFLOPS, "fp16": 83.375 * TFLOPS, "tf32": 83.375 * TFLOPS,
                  "fp32": 22.625 * TFLOPS},
}
# JAX device_kind strings -> the rows above, most specific first (GPUs: "Tesla V100-SXM2-16GB", "NVIDIA A100-SXM4-40GB",
# "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H200"; the Neuron plugin names NeuronCores
# by generation: NC_v2 = trn1, NC_v3d = a trn2 logical core of two, NC_v3 = one trn2 core).
_KIND_KEYS = (("H100 PCIe", "H100 PCIe"), ("H100 NVL", "NVL"), ("H200 NVL", "NVL"), ("H200", "H200"),
              ("H100", "H100"), ("A100", "A100"), ("V100", "V100"), ("trn2", "trn2"), ("nc_v3d", "trn2"),
              ("nc_v3", "trn2 core"), ("trainium2", "trn2"), ("trn1", "trn1"), ("nc_v2", "trn1"), ("trainium", "trn1"))
_DTYPES = {"bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16", "f16": "fp16",
           "float32": "fp32", "fp32": "fp32", "f32": "fp32", "tf32": "tf32", "tfloat32": "tf32",
           "fp8": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "f8e4m3fn": "fp8", "f8e5m2": "fp8"}


def _dtype_key(dtype: str) -> str | None:
    return _DTYPES.get(str(dtype).lower())


def check_device_precision(device_kind: str, compute: str, emulated: topology.InstanceTopology | None = None) -> None:
    """Fails for bf16 on a device kind with fp16 but no bf16 arithmetic (V100), or on CPU
    devices emulating such an instance type (`emulated`), naming fp16."""
    if compute == "bf16" and peak_flops(device_kind, "bf16") is None and peak_flops(device_kind, "fp16"):
        raise UnsupportedError(f"{device_kind} has no bfloat16 arithmetic; use Plan(precision='fp16'), which adds "
                               "dynamic loss scaling, or 'fp32'")
    if compute == "fp8" and peak_flops(device_kind, "bf16") and not peak_flops(device_kind, "fp8"):
        raise UnsupportedError(f"{device_kind} has no FP8 arithmetic (H100, H200 and Trainium2 have); use "
                               "Plan(precision='bf16')")
    if emulated is not None and emulated.name in PROFILES:
        PROFILES[emulated.name].check_precision(compute)


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of one device of `device_kind` (jax's `Device.device_kind`) for
    `dtype` ("bf16", "bfloat16", "fp32", "tf32", ...); None when unknown (CPUs included)."""
    kind = device_kind.lower()
    row = next((_PEAKS[key] for needle, key in _KIND_KEYS if needle.lower() in kind), None)
    key = _dtype_key(dtype)
    return None if row is None or key is None else row.get(key)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One device of a cluster, and the links between devices.

    Attributes:
        name: instance type ("trn1.32xlarge") or "emulated-cpu:N".
        devices_per_node: devices JAX shows per instance.
        peak_flops: dense matmul FLOP/s per device by dtype key (bf16, fp16, tf32, fp32).
        float32_matmul: which peak an fp32 matmul runs at: "tf32" where the backend's default
            precision uses it (XLA on NVIDIA GPUs, neuronx-cc's default matmul auto-cast), else "fp32".
        hbm_bytes: device memory per device.
        hbm_bytes_per_s: device memory bandwidth per device (elementwise ops are bound by it).
        intra_node_bytes_per_s: link bandwidth per device inside one instance, one direction.
        inter_node_bytes_per_s: network bandwidth per device between instances, one direction.
        intra_node_latency_s, inter_node_latency_s: fixed cost of one ring step.
        overlap: fraction of data-parallel gradient communication that can run under the backward
            pass (asynchronous collectives); 0 where collectives block the compute.
        host_bytes_per_s: device <-> host memory bandwidth per device, one direction (what an
            offloaded optimizer state moves over each step); None: offload is not planned here.
        notes: what the profile is, in words.
    """

    name: str
    devices_per_node: int
    peak_flops: Mapping[str, float]
    float32_matmul: str = "fp32"
    hbm_bytes: int
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    overlap: float = 0.0
    host_bytes_per_s: float | None = None
    notes: str = ""

    @property
    def has_bf16(self) -> bool:
        return "bf16" in self.peak_flops

    @property
    def plan_precision(self) -> str:
        """The compute precision of the plans searched for this hardware: "fp16" (with loss
        scaling) where the device has fp16 but no bf16 arithmetic (V100: its fp32 matmuls run at
        1/8 of its fp16 tensor cores, and it has no TF32), else "fp32" (the script's own; TF32
        or the compiler's auto-cast speeds up its matmuls where the hardware has them)."""
        return "fp16" if not self.has_bf16 and "fp16" in self.peak_flops else "fp32"

    @property
    def fused_attention(self) -> str:
        """"cuda" on the GPU instances whose GPUs run cuDNN's fused attention (Ampere and later:
        p4d, p4de, p5, p5e, p5en), where sdpa hands it attention; "" elsewhere."""
        return "cuda" if self.name.split("[")[0] in _FUSED_ATTENTION else ""

    def check_precision(self, compute: str) -> None:
        """Fails for a compute dtype the device has no arithmetic for (bf16 on V100)."""
        if compute == "bf16" and not self.has_bf16:
            raise UnsupportedError(f"{self.name} has no bfloat16 arithmetic (NVIDIA V100); use Plan(precision='fp16'), "
                                   "which adds dynamic loss scaling, or 'fp32'")
        if compute == "fp8" and "fp8" not in self.peak_flops and not self.name.startswith("emulated"):
            raise UnsupportedError(f"{self.name} has no FP8 arithmetic (FP8 matmuls need H100 / H200, p5, or "
                                   "Trainium2, trn2); use Plan(precision='bf16')")

    def matmul_flops_per_s(self, dtype: str) -> float:
        key = _dtype_key(dtype) or "fp32"
        key = self.float32_matmul if key == "fp32" else key
        return self.peak_flops.get(key) or self.peak_flops["fp32"]

    def with_memory(self, hbm_bytes: int) -> "HardwareProfile":
        """The same device with `hbm_bytes` of memory (what-if and tests)."""
        return dataclasses.replace(self, hbm_bytes=int(hbm_bytes), name=f"{self.name}[{hbm_bytes}B]")


def _from_topology(name: str, peaks: str, *, float32_matmul: str, intra: float, inter_latency: float,
                   overlap: float, hbm_bytes_per_s_chip: float | None = None,
                   host: float | None = None) -> HardwareProfile:
    t = topology.instance(name)
    chip_bw = (t.hbm_gib_s_per_chip * 2**30) if t.hbm_gib_s_per_chip else hbm_bytes_per_s_chip
    return HardwareProfile(
        name=name, devices_per_node=t.devices, peak_flops=_PEAKS[peaks], float32_matmul=float32_matmul,
        hbm_bytes=t.hbm_bytes_per_device, hbm_bytes_per_s=chip_bw / t.devices_per_chip,
        intra_node_bytes_per_s=intra, inter_node_bytes_per_s=t.network_gbit_s / 8 * GB / t.devices,
        intra_node_latency_s=10e-6, inter_node_latency_s=inter_latency, overlap=overlap, host_bytes_per_s=host,
        notes=topology.describe(t))


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    # AWS P4d page: NVLink 3 through NVSwitch, 600 GB/s per GPU (both directions) -> 300 GB/s
    # each way; EFA 400 Gbps per instance shared by 8 GPUs (neuron_support/topology.py).
    # Host link: NVIDIA A100 datasheet, PCIe Gen4 64 GB/s (both directions) -> 32 GB/s each way.
    _from_topology("p4d.24xlarge", "A100", float32_matmul="tf32", intra=300 * GB, inter_latency=30e-6, overlap=0.8,
                   host=32 * GB),
    # AWS P4 page: p4de is p4d with A100 80GB (more and faster HBM, same links and host link).
    _from_topology("p4de.24xlarge", "A100", float32_matmul="tf32", intra=300 * GB, inter_latency=30e-6, overlap=0.8,
                   host=32 * GB),
    # AWS P5 page: NVLink 4, 900 GB/s per GPU (both directions) -> 450 GB/s; EFA 3200 Gbps.
    # Host link: NVIDIA H100 / H200 datasheets, PCIe Gen5 128 GB/s (both directions) -> 64 GB/s.
    _from_topology("p5.48xlarge", "H100", float32_matmul="tf32", intra=450 * GB, inter_latency=30e-6, overlap=0.8,
                   host=64 * GB),
    # AWS P5 page: p5e / p5en, 8 x H200 on the same NVLink 4 fabric, EFA 3200 Gbps.
    _from_topology("p5e.48xlarge", "H200", float32_matmul="tf32", intra=450 * GB, inter_latency=30e-6, overlap=0.8,
                   host=64 * GB),
    _from_topology("p5en.48xlarge", "H200", float32_matmul="tf32", intra=450 * GB, inter_latency=30e-6, overlap=0.8,
                   host=64 * GB),
    # NVIDIA V100 datasheet: NVLink 2, 300 GB/s per GPU (both directions) -> 150 GB/s each way;
    # host link PCIe Gen3 32 GB/s (both directions) -> 16 GB/s.
    # Network: AWS P3 page (neuron_support/topology.py), ENA through TCP except p3dn's EFA; assumption: 50 us
    # per ring step over TCP. p3.2xlarge has one GPU (its intra-node rate is never used).
    _from_topology("p3.2xlarge", "V100", float32_matmul="fp32", intra=150 * GB, inter_latency=50e-6, overlap=0.8,
                   host=16 * GB),
    _from_topology("p3.8xlarge", "V100", float32_matmul="fp32", intra=150 * GB, inter_latency=50e-6, overlap=0.8,
                   host=16 * GB),
    _from_topology("p3.16xlarge", "V100", float32_matmul="fp32", intra=150 * GB, inter_latency=50e-6, overlap=0.8,
                   host=16 * GB),
    _from_topology("p3dn.24xlarge", "V100", float32_matmul="fp32", intra=150 * GB, inter_latency=30e-6, overlap=0.8,
                   host=16 * GB),
    # Assumption (not in the cited Neuron pages, which give no per-link rate): NeuronLink-v2 at
    # ~192 GB/s per Trainium chip (4 links), shared by its 2 cores -> 96 GB/s per core.
    # neuronx-cc auto-casts fp32 matmuls to bf16 by default (--auto-cast matmult).
    _from_topology("trn1.2xlarge", "trn1", float32_matmul="tf32", intra=96 * GB, inter_latency=30e-6, overlap=0.5),
    _from_topology("trn1.32xlarge", "trn1", float32_matmul="tf32", intra=96 * GB, inter_latency=30e-6, overlap=0.5),
    _from_topology("trn1n.32xlarge", "trn1", float32_matmul="tf32", intra=96 * GB, inter_latency=30e-6, overlap=0.5),
    # HBM: Neuron docs, Trainium2 NKI guide: 96 GiB at 2.9 TB/s per chip (neuron_support/topology.py has no
    # bandwidth for trn2). Assumption: NeuronLink-v3 ~1 TB/s per chip (AWS Trn2 page), 4 logical cores.
    _from_topology("trn2.48xlarge", "trn2", float32_matmul="tf32", intra=250 * GB, inter_latency=30e-6,
                   overlap=0.5, hbm_bytes_per_s_chip=2.9e12),
)}


def profile(name: str) -> HardwareProfile:
    """A profile by instance type ("trn1.32xlarge"; SageMaker's "ml." prefix allowed)."""
    key = name[3:] if name.startswith("ml.") else name
    if key not in PROFILES:
        raise OptionsError(f"no hardware profile for {name!r}; known: {', '.join(PROFILES)} "
                           "(or 'emulated' for this machine's CPU devices)")
    return PROFILES[key]


# -- this machine ---------------------------------------------------------------------------
def _best_time(fn, *args, repeats: int = 5) -> float:
    fn(*args).block_until_ready()  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def _host_rates() -> tuple[float, float]:
    """(matmul FLOP/s, elementwise bytes/s) of one emulated device running alone."""
    import jax
    import jax.numpy as jnp

    device = jax.local_devices()[0]
    a = jax.device_put(jnp.ones((384, 384), jnp.float32), device)
    matmul = _best_time(jax.jit(lambda x: x @ x @ x @ x), a)
    v = jax.device_put(jnp.ones((1 << 21,), jnp.float32), device)
    chain = _best_time(jax.jit(lambda x: jnp.tanh(x * 1.5 + 0.5) * x), v)
    return 3 * 2 * 384**3 / matmul, 4 * v.size * 4 / chain  # four elementwise ops, 4 bytes each


def _collective_rates(n: int) -> tuple[float, float]:
    """(bytes/s per device, seconds per step) of a psum over all `n` emulated devices."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec

    mesh = Mesh(jax.local_devices()[:n], ("x",))
    psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "x"), mesh=mesh, in_specs=PartitionSpec("x"),
                                 out_specs=PartitionSpec("x")))
    tiny = _best_time(psum, jnp.ones((n, 8), jnp.float32))
    big = jnp.ones((n, 1 << 18), jnp.float32)
    large = _best_time(psum, big)
    wire = 2 * (n - 1) / n * big.nbytes / n     # ring all-reduce bytes per device
    steps = 2 * (n - 1)
    latency = tiny / steps
    return wire / max(large - tiny, 1e-9), latency


@functools.lru_cache(maxsize=None)
def emulated(devices: int | None = None) -> HardwareProfile:
    """This machine's emulated mesh, calibrated now (about a second; cached per process).

    The devices of one process share its cores, so one device's share is 1/L of what it
    measures alone (L: devices per process): peak and bandwidth are divided by L. Collectives
    are memory copies inside a process; their rate and per-step latency are measured on a psum
    over the process's devices (with one device per process, gloo between processes is not
    measured: the memory-copy rate stands in, and the notes say so)."""
    import os

    import jax

    n = devices or jax.device_count()
    if jax.devices()[0].platform != "cpu":
        raise OptionsError(f"emulated(): the devices are {jax.devices()[0].platform}, not CPU; use "
                           "profile('<instance type>') for real accelerators")
    local = min(n, len(jax.local_devices()))
    matmul, elementwise = _host_rates()
    matmul, elementwise = matmul * n / local, elementwise * n / local  # divided by n below
    link, latency = _collective_rates(local) if local > 1 else (elementwise / n, 0.0)

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return HardwareProfile(
        name=f"emulated-cpu:{n}", devices_per_node=n,
        peak_flops={"fp32": matmul / n, "bf16": matmul / n},
        hbm_bytes=memory // n, hbm_bytes_per_s=elementwise / n,
        intra_node_bytes_per_s=link, inter_node_bytes_per_s=link,
        intra_node_latency_s=latency, inter_node_latency_s=latency, overlap=0.0,
        host_bytes_per_s=elementwise / n,  # "host" memory is the same RAM: a copy's rate
        notes=(f"{n} XLA CPU devices, {local} per process time-sharing {len(os.sched_getaffinity(0))} host "
               f"cores; collectives are memory copies ({'measured' if local > 1 else 'NOT measured, assumed'} "
               f"{link / GB:.2f} GB/s per device, {latency * 1e6:.0f} us per ring step); matmul "
               f"{matmul * local / n / 1e9:.1f} GFLOP/s per process"))


# -- which profile --------------------------------------------------------------------------------
# GPU kinds JAX reports ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3",
# "NVIDIA H200") -> the instance whose profile describes them, most specific first
_FUSED_ATTENTION = frozenset({"p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge"})
_GPU_INSTANCES = (("A100-SXM4-80GB", "p4de.24xlarge"), ("A100 80GB", "p4de.24xlarge"), ("A100", "p4d.24xlarge"),
                  ("H200", "p5e.48xlarge"), ("H100", "p5.48xlarge"))
_NEURON_INSTANCES = (("trn2", "trn2.48xlarge"), ("nc_v3", "trn2.48xlarge"), ("trn1", "trn1.32xlarge"),
                     ("nc_v2", "trn1.32xlarge"))


def check_target(spec: str) -> None:
    """Validates a target ('INSTANCE[:NODES]' or 'emulated[:DEVICES]') without starting JAX."""
    name, colon, count = spec.partition(":")
    if name != "emulated":
        topology.parse_cluster(spec)
    elif colon and not (count.isdigit() and int(count) > 0):
        raise OptionsError(f"target {spec!r}: after 'emulated:' comes a number of devices, a positive integer "
                           "(e.g. emulated:8); or write 'emulated' for this machine's devices")


def target(spec: str) -> tuple[HardwareProfile, int]:
    """'trn1.32xlarge:4' -> (its profile, 128 devices); 'emulated' or 'emulated:8' -> this
    machine's CPU devices (calibrated)."""
    check_target(spec)
    name, _, count = spec.partition(":")
    if name == "emulated":
        import jax

        n = int(count) if count else jax.device_count()
        return emulated(n), n
    instance, nodes = topology.parse_cluster(spec)
    return profile(instance.name), nodes * instance.devices


def profile_for_device(platform: str, device_kind: str) -> HardwareProfile:
    """The profile of an accelerator as JAX names it (`Device.platform`, `Device.device_kind`)."""
    table = _GPU_INSTANCES if platform in ("gpu", "cuda") else _NEURON_INSTANCES
    kind = device_kind.lower()
    name = next((inst for needle, inst in table if needle.lower() in kind), None)
    if name is None:
        raise UnsupportedError(f"plan='auto' has no hardware profile for device kind {device_kind!r}; known "
                               f"profiles: {', '.join(PROFILES)}. Pass an explicit plan instead")
    return profile(name)


def current_profile() -> HardwareProfile:
    """The profile of the devices this process runs on."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return emulated(jax.device_count())
    return profile_for_device(device.platform, device.device_kind)
