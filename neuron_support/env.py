"""Environment a Neuron process needs, from its launcher's view of it. Pure functions -> dicts.

Variables per the AWS Neuron documentation (awsdocs-neuron.readthedocs-hosted.com): "Reference:
Neuron Runtime environment variables" (NEURON_RT_*), the JAX NeuronX setup guide
(NEURON_PJRT_*), "neuronx-cc" (NEURON_CC_FLAGS) and the EFA setup for Trn1 (FI_*).
Two layouts:
  process-per-node  the JAX recipe: one process owns every NeuronCore of its instance; the
                    Neuron runtime's collectives root and jax.distributed's coordinator listen
                    on two different ports of the master.
  process-per-core  the torch-neuronx/torchrun recipe: one process per NeuronCore,
                    NEURON_RT_VISIBLE_CORES=LOCAL_RANK, NEURON_PJRT_PROCESS_INDEX=RANK.

Nothing here touches os.environ; `xtrain.runtime.devices.init` applies the result (without
overriding variables the user already set) before the Neuron PJRT plugin starts.
"""
from __future__ import annotations

import enum

from typing import Protocol

from neuron_support.topology import InstanceTopology, instance
from xtrain.errors import LaunchError, OptionsError


class ProcessEnv(Protocol):
    """What neuron_env reads of a process's launch environment (xtrain.runtime.launch.ProcessEnv)."""

    num_processes: int
    process_id: int
    num_nodes: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    coordinator_host: str | None

# The port torch-neuronx puts NEURON_RT_ROOT_COMM_ID on (MASTER_ADDR:62182, its initializer's
# set_rt_root_comm_id); away from torchrun's MASTER_PORT and jax's coordinator (MASTER_PORT+17).
ROOT_COMM_PORT = 62182
# The Neuron compiler's own default cache (Neuron docs: NEURON_COMPILE_CACHE_URL).
DEFAULT_COMPILE_CACHE = "/var/tmp/neuron-compile-cache"


class Layout(str, enum.Enum):
    PROCESS_PER_NODE = "process-per-node"
    PROCESS_PER_CORE = "process-per-core"


class Precision(str, enum.Enum):
    """The compute precision of the training plan (xtrain's Plan(precision=...))."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"


# compiler targets with FP8 arithmetic (AWS Trainium2 docs: FP8 matmuls); Trainium1 has none
FP8_TARGETS = ("trn2",)


def _choice(enum_type: type[enum.Enum], name: str, value) -> enum.Enum:
    try:
        return enum_type(value)
    except ValueError:
        valid = ", ".join(repr(m.value) for m in enum_type)
        raise OptionsError(f"{name}={value!r} is not one of {valid}") from None


def cores_per_process(topology: str | InstanceTopology, layout: Layout) -> int:
    """Devices (NeuronCores, logical cores on trn2) one process owns."""
    return instance(topology).devices if _choice(Layout, "layout", layout) is Layout.PROCESS_PER_NODE else 1


def _check_fits(process: ProcessEnv, t: InstanceTopology, layout: Layout, per_process: int) -> None:
    if process.local_world_size * per_process > t.devices:
        fix = ("launch one process per node (torchrun --nproc_per_node 1)" if layout is Layout.PROCESS_PER_NODE
               else f"launch at most {t.devices} processes per node")
        raise LaunchError(f"layout {layout.value} on {t.name}: LOCAL_WORLD_SIZE={process.local_world_size} "
                          f"processes x {per_process} cores exceed the {t.devices} cores of the instance; {fix}")


def _core_range(first: int, count: int) -> str:
    return str(first) if count == 1 else f"{first}-{first + count - 1}"


def runtime_env(process: ProcessEnv, topology: str | InstanceTopology, layout: Layout | str, *,
                root_comm_port: int = ROOT_COMM_PORT) -> dict[str, str]:
    """NEURON_RT_ROOT_COMM_ID, NEURON_PJRT_PROCESSES_NUM_DEVICES / _PROCESS_INDEX and
    NEURON_RT_VISIBLE_CORES (a contiguous range) for one process."""
    t, layout = instance(topology), _choice(Layout, "layout", layout)
    per_process = cores_per_process(t, layout)
    _check_fits(process, t, layout, per_process)
    root = process.master_addr or process.coordinator_host or "localhost"
    out = {
        "NEURON_RT_ROOT_COMM_ID": f"{root}:{root_comm_port}",
        "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join([str(per_process)] * process.num_processes),
        "NEURON_PJRT_PROCESS_INDEX": str(process.process_id),
        "NEURON_RT_VISIBLE_CORES": _core_range(process.local_rank * per_process, per_process),
    }
    if t.logical_core_size > 1:
        out["NEURON_LOGICAL_NC_CONFIG"] = str(t.logical_core_size)
    return out


def efa_env(topology: str | InstanceTopology, num_nodes: int) -> dict[str, str]:
    """Libfabric over EFA for collectives between instances (none needed inside one)."""
    if num_nodes < 2 or instance(topology).efa_gbit_s == 0:
        return {}
    return {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}


def compiler_flags(topology: str | InstanceTopology, *, optimization: int = 1,
                   precision: Precision | str = Precision.FP32, model_type: str = "transformer") -> list[str]:
    """neuronx-cc flags for the plan's precision (Neuron docs, "Mixed Precision and
    Performance-accuracy Tuning (neuronx-cc)" and the neuronx-cc reference).

    `--auto-cast none` under every precision: by default neuronx-cc casts fp32 matrix
    multiplications to bf16, which would break fp32 parity with every other backend, and under
    bf16 / fp16 the program xtrain emits is already cast by the plan's precision policy
    (matmuls in bf16, the modules the policy keeps in fp32 left in fp32), which the compiler
    must not override. bf16, fp16 and fp8 (bf16 with FP8 matmuls) add
    `--enable-mixed-precision-accumulation`: their matmuls accumulate in fp32, as they do on GPUs and
    in torch.autocast. fp8 is refused on Trainium1, which has no FP8 arithmetic."""
    t = instance(topology)
    if optimization not in (1, 2, 3):
        raise OptionsError(f"optimization={optimization} is not a neuronx-cc level; use 1, 2 or 3 (-O1/-O2/-O3)")
    if _choice(Precision, "precision", precision) is Precision.FP8 and t.compiler_target not in FP8_TARGETS:
        raise OptionsError(f"precision='fp8': {t.name} has no FP8 arithmetic (Trainium1); use 'bf16', or a "
                           f"Trainium2 instance (trn2.48xlarge)")
    flags = ["--model-type", model_type, f"-O{optimization}", "--target", t.compiler_target or "", "--auto-cast", "none"]
    if _choice(Precision, "precision", precision) is not Precision.FP32:
        flags.append("--enable-mixed-precision-accumulation")
    return flags


def precision_env(precision: Precision | str) -> dict[str, str]:
    """bf16 training (and fp8's, bf16 but for its matmuls) rounds stochastically (Neuron docs,
    "Rounding modes"; the old XLA_USE_BF16 is deprecated)."""
    chosen = _choice(Precision, "precision", precision)
    return {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"} if chosen in (Precision.BF16, Precision.FP8) else {}


def neuron_env(process: ProcessEnv, topology: str | InstanceTopology,
               layout: Layout | str = Layout.PROCESS_PER_NODE, *,
               precision: Precision | str = Precision.FP32, optimization: int = 1,
               compile_cache: str | None = None, root_comm_port: int = ROOT_COMM_PORT) -> dict[str, str]:
    """Every variable a Neuron process of this job needs.

    Args:
        process: the launcher's view of this process (`xtrain.runtime.process_env()`).
        topology: the instance type, e.g. "trn1.32xlarge".
        layout: "process-per-node" (JAX recipe) or "process-per-core" (torchrun per core).
        precision: the plan's compute precision, "fp32", "bf16", "fp16" or "fp8" (compiler flags;
            bf16 also enables stochastic rounding).
        optimization: neuronx-cc optimisation level (-O1, -O2, -O3).
        compile_cache: NEURON_COMPILE_CACHE_URL (a directory or s3://...); Neuron's default
            /var/tmp/neuron-compile-cache when None.
        root_comm_port: port of NEURON_RT_ROOT_COMM_ID on rank 0's host.

    Returns:
        Variable name -> value.
    """
    t = instance(topology)
    if t.compiler_target is None:
        raise OptionsError(f"{t.name} has no NeuronCores ({t.backend.value}); neuron_env is for trn1/trn1n/trn2")
    return {
        **runtime_env(process, t, layout, root_comm_port=root_comm_port),
        **efa_env(t, process.num_nodes),
        **precision_env(precision),
        "NEURON_CC_FLAGS": " ".join(compiler_flags(t, optimization=optimization, precision=precision)),
        "NEURON_COMPILE_CACHE_URL": compile_cache or DEFAULT_COMPILE_CACHE,
        # JAX NeuronX known issues: threefry RNG is only partly supported on Neuron; rbg is.
        "JAX_DEFAULT_PRNG_IMPL": "rbg",
    }
