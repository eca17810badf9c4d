"""Which accelerator this machine has, found before JAX starts, and what each backend needs.

Detection order: the Neuron PJRT plugin (with a Neuron device present), then CUDA, then the
CPU; XTRAIN_BACKEND (or JAX_PLATFORMS) overrides. Nothing here starts a JAX backend: the
launcher (`xtrain run`) must count devices without taking them, and the Neuron variables
must be in place before the plugin initialises.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from neuron_support import topology
from neuron_support.env import neuron_env
from xtrain.errors import LaunchError
from xtrain.runtime.cache import cache_root
from xtrain.runtime.launch import ProcessEnv

log = logging.getLogger(__name__)

BACKEND_ORDER = ("neuron", "cuda", "cpu")
NEURON_PLUGIN_MODULES = ("libneuronxla", "jax_neuronx")
CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13", "jax_cuda12_plugin",
                       "jax_cuda13_plugin")
_PLATFORM_NAMES = {"neuron": "neuron", "cuda": "cuda", "gpu": "cuda", "cpu": "cpu"}
# On Nitro instances the DMI product name is the instance type ("trn1.32xlarge").
DMI_PRODUCT_NAME = "/sys/devices/virtual/dmi/id/product_name"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _choose(value: str, source: str) -> str:
    name = _PLATFORM_NAMES.get(value.strip().lower())
    if name is None:
        raise LaunchError(f"{source}={value!r} names no backend xtrain runs on; use one of {', '.join(BACKEND_ORDER)}")
    return name


def detect_backend(env: Mapping[str, str] | None = None, *, has_module: Callable[[str], bool] = _has_module,
                   exists: Callable[[str], bool] = os.path.exists) -> str:
    """'neuron', 'cuda' or 'cpu', without starting JAX.

    Args:
        env: environment (os.environ by default): XTRAIN_BACKEND, else the first entry of
            JAX_PLATFORMS, overrides detection.
        has_module, exists: probes for installed plugins and device files (tests replace them).
    """
    env = os.environ if env is None else env
    if env.get("XTRAIN_BACKEND"):
        return _choose(env["XTRAIN_BACKEND"], "XTRAIN_BACKEND")
    if env.get("JAX_PLATFORMS"):
        return _choose(env["JAX_PLATFORMS"].split(",")[0], "JAX_PLATFORMS")
    if any(map(has_module, NEURON_PLUGIN_MODULES)) and exists("/dev/neuron0"):
        return "neuron"
    if any(map(has_module, CUDA_PLUGIN_MODULES)) and exists("/dev/nvidia0"):
        return "cuda"
    return "cpu"


def cpu_platforms(*, has_module: Callable[[str], bool] = _has_module) -> dict[str, str]:
    """{"JAX_PLATFORMS": "cpu"} where a CUDA plugin is installed but this host runs on CPU (the
    gpu-compile extra, for deviceless compiles): JAX would otherwise try the plugin first, whose
    start-up calls cuInit, fails and logs an error on every start. {} without a CUDA plugin."""
    return {"JAX_PLATFORMS": "cpu"} if any(map(has_module, CUDA_PLUGIN_MODULES)) else {}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def instance_type(env: Mapping[str, str] | None = None, *,
                  read: Callable[[str], str | None] = _read) -> str | None:
    """The EC2 instance type: XTRAIN_INSTANCE_TYPE, SageMaker's SM_CURRENT_INSTANCE_TYPE, or the
    DMI product name when it is an instance type xtrain knows."""
    env = os.environ if env is None else env
    for name in ("XTRAIN_INSTANCE_TYPE", "SM_CURRENT_INSTANCE_TYPE"):
        if env.get(name):
            value = env[name]
            return value[3:] if value.startswith("ml.") else value
    product = read(DMI_PRODUCT_NAME)
    return product if product in topology.INSTANCES else None


def _count_list(value: str) -> int:
    """'0,1,3' -> 3; '0-31' -> 32 (CUDA_VISIBLE_DEVICES, NEURON_RT_VISIBLE_CORES)."""
    total = 0
    for item in filter(None, value.split(",")):
        lo, _, hi = item.partition("-")
        total += int(hi) - int(lo) + 1 if hi else 1
    return total


def local_device_count(backend: str, env: Mapping[str, str] | None = None, *,
                       devices: Callable[[str], list[str]] = glob.glob) -> int | None:
    """Accelerators on this node without starting JAX (None when it cannot tell)."""
    env = os.environ if env is None else env
    if backend == "cuda":
        if "CUDA_VISIBLE_DEVICES" in env:
            return _count_list(env["CUDA_VISIBLE_DEVICES"])
        return len([p for p in devices("/dev/nvidia*") if re.fullmatch(r"/dev/nvidia\d+", p)]) or None
    if backend == "neuron":
        if env.get("NEURON_RT_VISIBLE_CORES"):
            return _count_list(env["NEURON_RT_VISIBLE_CORES"])
        kind = instance_type(env)
        if kind:
            return topology.instance(kind).devices
        return None
    return 1


def default_nproc_per_node(backend: str, *, layout: str = "process-per-node",
                           local_devices: int | None = None) -> int:
    """One process per GPU; on Trainium one per node or one per NeuronCore; else one."""
    if backend == "cuda":
        if not local_devices:
            raise LaunchError("no GPUs counted on this node (CUDA_VISIBLE_DEVICES, /dev/nvidia*); "
                              "pass --nproc-per-node")
        return local_devices
    if backend == "neuron" and layout == "process-per-core":
        if not local_devices:
            raise LaunchError("cannot count the NeuronCores of this node; set XTRAIN_INSTANCE_TYPE "
                              "(e.g. trn1.32xlarge) or pass --nproc-per-node")
        return local_devices
    return 1


# XLA's CPU runtime runs independent ops of a device's program concurrently. With the
# concurrency-optimised scheduler, two independent collectives (e.g. ZeRO-3's re-gather of a
# layer's weights in the backward scan next to a gradient reduce-scatter) can start in a
# different order on different emulated devices, and the rendezvous then deadlocks (XLA
# aborts after 40 s). The default scheduler keeps one order on every device. A loop holding
# collectives (a layer scan) still runs asynchronously beside what follows it: the explicit
# lowering orders those by dataflow (xtrain/lowering/ordering.py).
# Emulated devices time-share the host's cores: on a loaded 2-core machine one device's thread
# can reach a collective more than 40 s after the others, and XLA then aborts the process
# although nothing is wrong. Wait up to 10 minutes before calling a rendezvous stuck.
CPU_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",
                 "--xla_cpu_collective_call_terminate_timeout_seconds=600")


# xtrain buckets gradients itself (GradSync.bucket_bytes, 25 MiB by default) so that the
# latency-hiding scheduler can overlap each bucket's all-reduce with the rest of the backward
# pass. XLA's combiners may merge smaller collectives up to one bucket, not beyond: a larger
# threshold would fuse the buckets back into a few big transfers that overlap nothing.
GPU_COMBINE_THRESHOLD_BYTES = 25 * 2**20


def cuda_xla_flags(combine_threshold_bytes: int = GPU_COMBINE_THRESHOLD_BYTES) -> tuple[str, ...]:
    """The XLA flags xtrain wants on CUDA: overlap collectives with compute (XLA's latency-hiding
    scheduler, off by default), combine collectives up to one gradient bucket, and pipeline the
    all-gathers of a loop (off by default): in ZeRO-3's layer scan the next layer's weights are
    gathered while this layer computes, at the memory of one more layer's gathered weights (the
    reduce-scatters of its backward scan are pipelined by default)."""
    return ("--xla_gpu_enable_latency_hiding_scheduler=true",
            *(f"--xla_gpu_{kind}_combine_threshold_bytes={combine_threshold_bytes}"
              for kind in ("all_reduce", "all_gather", "reduce_scatter")),
            "--xla_gpu_enable_pipelined_all_gather=true")


def default_xla_flags(backend: str) -> tuple[str, ...]:
    """xtrain's XLA flags for a backend, before checking them against the installed XLA."""
    return {"cpu": CPU_XLA_FLAGS, "cuda": cuda_xla_flags()}.get(backend, ())


def _flag_name(flag: str) -> str:
    return flag.split("=")[0]


def merge_xla_flags(xla_flags: str, defaults: Iterable[str]) -> str:
    """XLA_FLAGS with `defaults` added; a flag the user already set keeps the user's value."""
    flags = xla_flags.split()
    names = {_flag_name(f) for f in flags}
    return " ".join(flags + [f for f in defaults if _flag_name(f) not in names])


def with_cpu_xla_flags(xla_flags: str) -> str:
    """XLA_FLAGS with xtrain's CPU flags added (a flag the user already set is left alone)."""
    return merge_xla_flags(xla_flags, CPU_XLA_FLAGS)


# XLA parses every flag of XLA_FLAGS (GPU ones too) when the first backend starts, and aborts the
# process on one it does not know or cannot parse. So a CPU start in a child process tells
# whether this XLA accepts a set of flags, on any machine and without taking an accelerator.
_PROBE = "import jax; jax.devices('cpu')"
PROBE_TIMEOUT_S = 120


def probe_xla_flags(flags: Sequence[str], *, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the installed XLA starts with `flags` in XLA_FLAGS (checked in a subprocess)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def jaxlib_version() -> str:
    from importlib.metadata import version

    return version("jaxlib")


def _read_probe_cache(path: Path | None, key: str) -> dict[str, bool]:
    try:
        return json.loads(path.read_text()).get(key, {}) if path else {}
    except (OSError, ValueError):
        return {}


def _write_probe_cache(path: Path | None, key: str, known: dict[str, bool]) -> None:
    if path is None:
        return
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        data[key] = known
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True))
    except (OSError, ValueError) as err:  # a read-only cache costs a probe next time, nothing else
        log.warning("could not record XLA flag probes in %s: %s", path, err)


def supported_xla_flags(flags: Sequence[str], *, probe: Callable[[Sequence[str]], bool] = probe_xla_flags,
                        cache_file: Path | None = None, version: str | None = None) -> tuple[str, ...]:
    """The flags of `flags` that the installed XLA accepts, in order.

    One probe for the whole set, then one per flag only when the set fails. Results are kept
    in `cache_file` (xtrain's cache, `xla_flags.json`, by default) per jaxlib version.
    """
    if cache_file is None:
        root = cache_root()
        cache_file = root / "xla_flags.json" if root else None
    key = f"jaxlib {version or jaxlib_version()}"
    known = _read_probe_cache(cache_file, key)
    todo = [f for f in flags if f not in known]
    if todo:
        known.update(dict.fromkeys(todo, True) if probe(todo) else {f: probe([f]) for f in todo})
        _write_probe_cache(cache_file, key, known)
    for flag in flags:
        if not known[flag]:
            log.warning("XLA flag %s is not accepted by the installed XLA (%s); xtrain leaves it out", flag, key)
    return tuple(f for f in flags if known[f])


def neuron_layout(process: ProcessEnv) -> str:
    """One process on the node: it owns every core; several: one core each."""
    return "process-per-node" if process.local_world_size == 1 else "process-per-core"


# EFA devices appear as RDMA devices bound to the `efa` kernel driver (AWS EFA user guide).
EFA_SYSFS = "/sys/class/infiniband"


def efa_present(*, devices: Callable[[str], list[str]] = glob.glob,
                driver: Callable[[str], str] = os.path.realpath) -> bool:
    """Whether this instance has an Elastic Fabric Adapter (p4d, p4de, p5, p5e, p5en, trn1...)."""
    return any(os.path.basename(driver(f"{d}/device/driver")) == "efa" for d in devices(f"{EFA_SYSFS}/*"))


def cuda_env(process: ProcessEnv, *, efa: bool) -> dict[str, str]:
    """NCCL's variables between GPU instances: over EFA, libfabric's EFA provider with GPUDirect
    RDMA (AWS EFA user guide, "Get started with EFA and NCCL"; p4d, p4de and the p5 family
    support it) and fork safety for data-loader workers. NCCL reaches EFA through the
    aws-ofi-nccl plugin, which picks its own protocol per platform. {} on one node (NVLink
    only) or without EFA."""
    if not efa or process.num_nodes < 2:
        return {}
    return {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}


def backend_env(backend: str, process: ProcessEnv, *, instance: str | None, compile_cache: str | None = None,
                precision: str = "fp32", efa: bool = False) -> dict[str, str]:
    """Variables a backend needs before it starts (XLA_FLAGS apart: `default_xla_flags`).

    Args:
        backend: "neuron", "cuda" or "cpu".
        process: the launcher's view of this process.
        instance: the instance type (needed on Trainium to map processes onto NeuronCores).
        compile_cache: Neuron's compile cache (NEURON_COMPILE_CACHE_URL).
        precision: the plan's compute precision, "fp32", "bf16", "fp16" or "fp8" (Neuron's compiler
            flags and stochastic rounding).
        efa: whether the instance has EFA (`efa_present()`); CUDA's NCCL variables need it.
    """
    if backend == "cuda":
        return cuda_env(process, efa=efa)
    if backend != "neuron":
        return {}
    if instance is None:
        raise LaunchError("on Trainium xtrain needs the instance type to map processes onto NeuronCores; "
                          "set XTRAIN_INSTANCE_TYPE=trn1.32xlarge (or trn1.2xlarge, trn1n.32xlarge, trn2.48xlarge)")
    return neuron_env(process, instance, neuron_layout(process), precision=precision, compile_cache=compile_cache)


# Variables whose value follows the plan's precision (on Neuron): a plan whose precision differs
# from the one these were set for compiles with the wrong flags.
PRECISION_VARIABLES = ("NEURON_CC_FLAGS", "NEURON_RT_STOCHASTIC_ROUNDING_EN")


def check_precision(plan_precision: str, started: str, applied: Mapping[str, str]) -> None:
    """Raises when a plan's compute precision differs from the one the backend's variables were
    set for (`started`), if xtrain set any of them (`applied`); the user's own values are theirs."""
    mine = [k for k in PRECISION_VARIABLES if k in applied]
    if plan_precision != started and mine:
        raise LaunchError(
            f"the plan's precision is {plan_precision!r} but xtrain.init() started the Neuron runtime for "
            f"{started!r} ({', '.join(f'{k}={applied[k]}' for k in mine)}), and these are read once, when the "
            f"plugin starts. Call xtrain.init(precision={plan_precision!r}) first thing in the script (or "
            f"`xtrain env --precision {plan_precision}` to see the variables), or set them yourself")
