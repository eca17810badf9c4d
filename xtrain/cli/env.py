"""`xtrain env`: what xtrain detects on this host (backend, devices, processes, mesh) and the
environment and XLA flags it sets, here or on a real node of an emulated cluster."""
from __future__ import annotations

import os

from xtrain.runtime import backends, cache
from xtrain.runtime.launch import COORDINATOR_PORT_OFFSET, DEFAULT_MASTER_PORT, ProcessEnv, process_env


def _process_lines(process: ProcessEnv) -> list[str]:
    lines = [f"process: {process.launcher.value} (cluster {process.cluster.value}), rank {process.process_id} of "
             f"{process.num_processes}, local rank {process.local_rank} of {process.local_world_size}, "
             f"node {process.node_rank} of {process.num_nodes}"]
    if process.coordinator:
        lines.append(f"coordinator: {process.coordinator} (jax.distributed)")
    if process.hosts:
        lines.append(f"hosts: {', '.join(process.hosts)}")
    if process.devices_per_process:
        lines.append(f"devices per process: {process.devices_per_process}")
    return lines


def _device_lines(emulate: str | None, precision: str) -> tuple[list[str], int]:
    import jax

    from xtrain.runtime import devices

    devices.init(env=ProcessEnv(), emulate=emulate, precision=precision)  # local devices only; no jax.distributed
    kinds = sorted({d.device_kind for d in jax.devices()})
    count = jax.device_count()
    lines = [f"devices: {count} x {jax.devices()[0].platform} ({', '.join(kinds)})", f"jax: {jax.__version__}"]
    cluster = devices.emulated_cluster()
    if cluster is not None:
        lines.append(f"emulating: {cluster}")
    return lines, count


def _mesh_lines(instance: str | None, emulate: str | None, count: int) -> list[str]:
    from neuron_support import topology

    lines = [f"mesh (default, data parallel): Mesh(data={count})"]
    if emulate or instance:
        kind, nodes = topology.parse_cluster(emulate) if emulate else (topology.instance(instance), 1)
        physical = " x ".join(f"{k}={v}" for k, v in topology.physical_axes(kind, nodes).items())
        lines += [f"instance: {topology.describe(kind)}", f"physical mesh: {physical}"]
    return lines


def _target_lines(kind: str, backend: str, process: ProcessEnv, target, precision: str, note: str) -> list[str]:
    """The variables xtrain sets on a `kind` ("neuron" or "cuda") host of `target` (an instance
    topology, or None: this host) for a plan of `precision`."""
    efa = target.efa_gbit_s > 0 if target is not None and (note or backend != kind) else backends.efa_present()
    wanted = backends.backend_env(kind, process, instance=target.name if target else None,
                                  compile_cache=cache.neuron_cache_url(), precision=precision, efa=efa)
    lines = _xla_flag_lines("cuda") if kind == "cuda" and backend != "cuda" else []
    lines.append(f"environment xtrain sets{note} (precision {precision}; variables you set win):")
    lines += [f"  {k}={v}" for k, v in wanted.items()] or ["  (none: one node, or no EFA)"]
    return lines


def _env_lines(backend: str, process: ProcessEnv, instance: str | None, emulate: str | None,
               precision: str = "fp32") -> list[str]:
    from neuron_support.topology import instance as topology_instance, parse_cluster

    target = parse_cluster(emulate)[0] if emulate else topology_instance(instance) if instance else None
    if emulate:  # what node 0 of the real cluster would get, one process per node
        nodes = parse_cluster(emulate)[1]
        process = ProcessEnv(num_processes=nodes, num_nodes=nodes, master_addr="<node-0>",
                             coordinator=f"<node-0>:{DEFAULT_MASTER_PORT + COORDINATOR_PORT_OFFSET}")
    root = cache.jax_cache_dir()
    lines = [f"JAX compilation cache: {root if root else 'off (XTRAIN_CACHE_DIR=off)'}"] + _xla_flag_lines(backend)
    kind = target.backend.value if target is not None else backend
    if kind in ("neuron", "cuda") and (backend == kind or target is not None):
        note = "" if backend == kind and not emulate else f" (on a real {emulate or target.name}, node 0)"
        lines += _target_lines(kind, backend, process, target, precision, note)
    return lines


def _xla_flag_lines(backend: str) -> list[str]:
    """The XLA flags xtrain adds on this backend; on CUDA only those the installed XLA accepts."""
    wanted = backends.default_xla_flags(backend)
    if not wanted:
        return []
    usable = backends.supported_xla_flags(wanted) if backend == "cuda" else wanted
    # After devices.init, XLA_FLAGS holds xtrain's own flags too: only a different value is the user's.
    user = {f.split("=")[0]: f for f in os.environ.get("XLA_FLAGS", "").split()}
    lines = [f"XLA flags xtrain adds on {backend} (jaxlib {backends.jaxlib_version()}; your XLA_FLAGS win):"]
    for flag in wanted:
        mine = user.get(flag.split("=")[0], flag)
        note = f"  (not added: XLA_FLAGS has {mine})" if mine != flag else \
            "" if flag in usable else "  (left out: unknown to this XLA)"
        lines.append(f"  {flag}{note}")
    return lines


def env_report(*, emulate: str | None = None, instance: str | None = None, start: bool = True,
               precision: str = "fp32") -> str:
    """The text `xtrain env` prints: for `precision`, the plan's compute precision, which a
    script passes to `xtrain.init(precision=...)` (Neuron reads the flags it implies at start)."""
    backend = backends.detect_backend()
    process = process_env()
    instance = instance or backends.instance_type() or process.instance_type
    lines = [f"backend: {backend}"]
    count = backends.local_device_count(backend) or 1
    if start:
        device_lines, count = _device_lines(emulate, precision)
        lines += device_lines
    lines += _process_lines(process) + _mesh_lines(instance, emulate, count)
    return "\n".join(lines + _env_lines(backend, process, instance, emulate, precision))
