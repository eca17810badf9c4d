"""Backend detection and device setup, including CPU emulation of a cluster.

Emulated CPU devices must be requested before JAX initialises its backends, so `init` is
the first xtrain call a script makes (`xtrain.compile` calls it with defaults otherwise).
"""
from __future__ import annotations

import logging
import os

from xtrain.runtime.launch import ProcessEnv, process_env

log = logging.getLogger(__name__)

# Preference order: Trainium's PJRT plugin, then CUDA, then the host CPU.
BACKEND_ORDER = ("neuron", "cuda", "cpu")

_state: dict = {"initialized": False, "process_env": None}


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def _request_cpu_devices(per_process: int) -> None:
    if _backends_started():
        import jax

        have = jax.local_device_count("cpu") if backend() == "cpu" else per_process
        if have != per_process:
            raise RuntimeError(
                f"asked for {per_process} emulated CPU devices per process but JAX already "
                f"started with {have}; call xtrain.init(cpu_devices=...) before any other JAX use, "
                f"or set JAX_NUM_CPU_DEVICES={per_process} in the environment")
        return
    os.environ["JAX_NUM_CPU_DEVICES"] = str(per_process)
    import jax

    jax.config.update("jax_num_cpu_devices", per_process)


def init(cpu_devices: int | None = None, env: ProcessEnv | None = None) -> ProcessEnv:
    """Sets up devices and, under a multi-process launcher, jax.distributed. Idempotent.

    Args:
        cpu_devices: total number of emulated CPU devices in the job (split evenly over the
            processes). Only used when the job runs on CPU; ignored on GPU and Trainium.
        env: the process environment; read from the launcher's variables by default.

    Returns:
        The ProcessEnv this process runs in.
    """
    if _state["initialized"]:
        return _state["process_env"]
    env = process_env() if env is None else env
    if cpu_devices is not None:
        if cpu_devices % env.num_processes:
            raise ValueError(
                f"cpu_devices={cpu_devices} cannot be split over {env.num_processes} processes; "
                f"use a multiple of {env.num_processes}")
        _request_cpu_devices(cpu_devices // env.num_processes)
    if env.is_multi_process:
        _init_distributed(env)
    _state.update(initialized=True, process_env=env)
    return env


def _init_distributed(env: ProcessEnv) -> None:
    import jax

    if _backends_started():
        raise RuntimeError(
            "JAX was used before xtrain.init() in a multi-process job; call xtrain.init() "
            "first so jax.distributed can be initialised")
    log.info("jax.distributed.initialize(%s, %d, %d)", env.coordinator, env.num_processes, env.process_id)
    jax.distributed.initialize(
        coordinator_address=env.coordinator,
        num_processes=env.num_processes,
        process_id=env.process_id,
        initialization_timeout=120,
    )


def backend() -> str:
    """The platform xtrain runs on: 'neuron', 'cuda' or 'cpu' (first available in that order)."""
    import jax

    platform = jax.devices()[0].platform
    return "cuda" if platform == "gpu" else platform


def job_devices() -> list:
    """All devices of the job (every process), in process-major order."""
    import jax

    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
