"""Device setup: backend variables, emulated CPU clusters, jax.distributed, compilation cache.

Emulated CPU devices and Neuron's variables must be in place before JAX initialises its
backends, so `init` is the first xtrain call a script makes (`xtrain.compile` calls it with
defaults otherwise). The order inside `init` is fixed:
  1. read the launcher's environment (launch.process_env)
  2. detect the backend without starting it (backends.detect_backend)
  3. on Trainium, set the Neuron runtime variables the launcher implies
  4. size the CPU device pool (explicit, or the emulated cluster's)
  5. turn on the persistent compilation cache
  6. start jax.distributed for multi-process jobs

When a process of a multi-process job dies, the others end instead of waiting forever in a
collective whose peer is gone: a launcher that watches its children (torchrun, mpirun) stops
them with SIGTERM at once, and otherwise (srun without --kill-on-bad-exit, a node whose peer
node failed) jax.distributed's coordinator misses the dead process's heartbeats and aborts every
process with "Terminating process because the JAX distributed service detected fatal errors.
This most likely indicates that another task died" after `heartbeat_timeout_s` (20 s by
default, so a survivor ends within 30 s; the heartbeats come from a thread of their own, so a
long compile or step does not miss them). Gloo's own timeout (XLA's xla_cpu_collective_timeout_seconds, 30
min) is no bound worth having, and cannot be shortened safely: a peer still compiling its step
legitimately keeps the others waiting in their first collective for minutes.
"""
from __future__ import annotations

import inspect
import logging
import os

from neuron_support import emulate as emulation
from xtrain.errors import LaunchError, OptionsError
from xtrain.runtime import allocator, backends, cache
from xtrain.runtime.launch import ProcessEnv, process_env

log = logging.getLogger(__name__)

# Preference order: Trainium's PJRT plugin, then CUDA, then the host CPU.
BACKEND_ORDER = backends.BACKEND_ORDER
EMULATE_ENV = "XTRAIN_EMULATE"
# Seconds without a heartbeat after which jax.distributed declares a process dead and aborts
# the others (JAX's own default is 100: a survivor would wait that long).
HEARTBEAT_TIMEOUT_S = 20

_state: dict = {"initialized": False, "process_env": None, "cluster": None, "backend_env": {}, "precision": "fp32",
                "allocator": {}}
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")


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


def _emulated_cluster(spec: str | None, platform: str, cpu_devices: int | None):
    if not spec:
        return None
    if platform != "cpu":
        log.warning("emulate=%r ignored: this machine runs %s, not CPU", spec, platform)
        return None
    return emulation.virtual_cluster(spec, devices=cpu_devices)


def _unset(wanted: dict[str, str]) -> dict[str, str]:
    """Sets the variables of `wanted` that the user has not set; returns those."""
    applied = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(applied)
    return applied


def _apply_backend_env(platform: str, env: ProcessEnv, precision: str = "fp32") -> dict[str, str]:
    """Sets the backend's variables that the user has not set; returns what it set."""
    if platform == "cpu" and not _backends_started():
        flags = backends.with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = flags
        # before XLA's threads start: their arenas are made under these settings
        _state["allocator"] = allocator.retain_freed_memory()
        platforms = _unset(backends.cpu_platforms())
        if platforms:  # jax reads the variable when imported, which may have happened already
            import jax

            jax.config.update("jax_platforms", platforms["JAX_PLATFORMS"])
        return {"XLA_FLAGS": flags, **platforms}
    if platform == "cuda" and not _backends_started():
        # Only flags this XLA knows: an unknown one would abort the process (probed in a child).
        wanted = backends.supported_xla_flags(backends.default_xla_flags("cuda"))
        flags = backends.merge_xla_flags(os.environ.get("XLA_FLAGS", ""), wanted)
        os.environ["XLA_FLAGS"] = flags
        return {"XLA_FLAGS": flags, **_unset(backends.cuda_env(env, efa=backends.efa_present()))}
    if platform != "neuron":
        return {}
    applied = _unset(backends.backend_env(platform, env, instance=backends.instance_type() or env.instance_type,
                                          compile_cache=cache.neuron_cache_url(), precision=precision))
    import jax

    # JAX NeuronX known issues: threefry is only partly supported on Neuron; rbg is. The
    # variable alone is read when jax is imported, which may have happened already.
    jax.config.update("jax_default_prng_impl", os.environ["JAX_DEFAULT_PRNG_IMPL"])
    return applied


def init(cpu_devices: int | None = None, env: ProcessEnv | None = None, *,
         emulate: str | None = None, heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S,
         precision: str = "fp32") -> ProcessEnv:
    """Sets up devices and, under a multi-process launcher, jax.distributed. Idempotent.

    Args:
        cpu_devices: total number of emulated CPU devices in the job (split evenly over the
            processes). Only used when the job runs on CPU; ignored on GPU and Trainium.
        env: the process environment; read from the launcher's variables by default.
        emulate: a cluster to fly on CPU, e.g. "trn1.32xlarge:2": as many CPU devices as the
            real cluster has, or `cpu_devices` of them scaled down (see neuron_support.emulate).
            Without it, XTRAIN_EMULATE (what `xtrain run --emulate` sets) names the cluster and
            wins over `cpu_devices`. Ignored off CPU.
        heartbeat_timeout_s: in a multi-process job, how long a process may go silent before
            jax.distributed declares it dead and ends every other process with an error (20 s:
            the survivors of a dead process end within 30 s when no launcher stops them).
        precision: the compute precision of the plans this process will run ("fp32", "bf16",
            "fp16", "fp8"): on Trainium it sets the Neuron compiler's flags and stochastic
            rounding, which the plugin reads once, when it starts (fp8: Trainium2 only). A plan
            of another precision is then an error at `xtrain.compile` (`check_plan_precision`).

    Returns:
        The ProcessEnv this process runs in.
    """
    if precision not in PRECISIONS:
        raise OptionsError(f"xtrain.init(precision={precision!r}): use one of {', '.join(PRECISIONS)} "
                           "(the compute precision of the plans this job runs)")
    if _state["initialized"]:
        return _state["process_env"]
    env = process_env() if env is None else env
    platform = backends.detect_backend()
    applied = _apply_backend_env(platform, env, precision)
    launched = os.environ.get(EMULATE_ENV)
    if emulate is None and launched and cpu_devices is not None and platform == "cpu":
        # `xtrain run --emulate` names the cluster for the whole job: it wins over the script's
        # own device count (which would shrink the cluster to a scaled-down copy).
        log.info("%s=%s: emulating the whole cluster, not the script's cpu_devices=%d", EMULATE_ENV, launched,
                 cpu_devices)
        cpu_devices = None
    cluster = _emulated_cluster(emulate or launched, platform, cpu_devices)
    if cluster is not None and cpu_devices is None:
        cpu_devices = cluster.num_devices
    if cpu_devices is not None:
        if cpu_devices % env.num_processes:
            raise LaunchError(
                f"cpu_devices={cpu_devices} cannot be split over {env.num_processes} processes; "
                f"use a multiple of {env.num_processes}")
        _request_cpu_devices(cpu_devices // env.num_processes)
    _enable_cache()
    if env.is_multi_process:
        _init_distributed(env, platform, heartbeat_timeout_s)
    emulation.use(cluster)
    _state.update(initialized=True, process_env=env, cluster=cluster, backend_env=applied, precision=precision)
    return env


def check_plan_precision(precision: str) -> None:
    """Raises when a plan's compute precision ("fp32", "bf16", "fp16") is not the one `init`
    set the backend's variables for (Neuron's compiler flags and rounding; see init)."""
    backends.check_precision(precision, _state["precision"], _state["backend_env"])


def _enable_cache() -> None:
    path = cache.jax_cache_dir()
    if path is not None:
        cache.enable_jax_cache(path)


def local_device_ids(env: ProcessEnv, platform: str) -> list[int] | None:
    """The GPUs this process owns when several processes share a node: `devices_per_process`
    of them (one by default) from LOCAL_RANK on. None: every visible device (one process per
    node, or a backend whose visibility is set through the environment, as Neuron's is)."""
    if platform != "cuda" or env.local_world_size == 1:
        return None
    per = env.devices_per_process or 1
    return list(range(env.local_rank * per, (env.local_rank + 1) * per))


def _disable_preemption_service() -> None:
    """JAX's preemption service catches SIGTERM so that a job can checkpoint at a sync point
    (multihost_utils.reached_preemption_sync_point, which xtrain does not use). But SIGTERM is
    how launchers stop the survivors of a failed process (torchrun, then SIGKILL 30 s later;
    Slurm's scancel): caught, they stay blocked in a collective whose peer is gone. Off unless
    the user turned it on (JAX_ENABLE_PREEMPTION_SERVICE)."""
    import jax

    if "JAX_ENABLE_PREEMPTION_SERVICE" not in os.environ and "jax_enable_preemption_service" in jax.config.values:
        jax.config.update("jax_enable_preemption_service", False)


def _init_distributed(env: ProcessEnv, platform: str, heartbeat_timeout_s: int) -> None:
    import jax

    if _backends_started():
        raise RuntimeError(
            "JAX was used before xtrain.init() in a multi-process job; call xtrain.init() "
            "first so jax.distributed can be initialised")
    ids = local_device_ids(env, platform)
    kwargs = {"local_device_ids": ids} if ids is not None else {}
    if ids is None and "cluster_detection_method" in inspect.signature(jax.distributed.initialize).parameters:
        # Without this, jax re-reads Slurm/Open MPI variables and pins each process to the GPU
        # of SLURM_LOCALID, which is 0 for every torchrun child of a one-task-per-node srun.
        kwargs["cluster_detection_method"] = "deactivate"
    if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
        kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout_s
    _disable_preemption_service()
    log.info("jax.distributed.initialize(%s, %d, %d, %s)", env.coordinator, env.num_processes, env.process_id, kwargs)
    jax.distributed.initialize(
        coordinator_address=env.coordinator,
        num_processes=env.num_processes,
        process_id=env.process_id,
        initialization_timeout=120,
        **kwargs,
    )


def backend() -> str:
    """The platform xtrain runs on: 'neuron', 'cuda' or 'cpu' (first available in that order)."""
    import jax

    platform = jax.devices()[0].platform
    return "cuda" if platform == "gpu" else platform


def allocator_settings() -> dict[str, int]:
    """The malloc settings `init` made on CPU (xtrain.runtime.allocator): variable name -> value,
    empty when it made none (not CPU, XTRAIN_CPU_MALLOC=default, or the user's own MALLOC_*)."""
    return dict(_state["allocator"])


def emulated_cluster():
    """The cluster `init(emulate=...)` flies on CPU (a neuron_support VirtualCluster), or None."""
    return _state["cluster"]
