"""The `xtrain` command.

    xtrain env [--emulate trn1.32xlarge:2] [--instance-type T] [--precision bf16]   what xtrain detects and sets
    xtrain run [--nproc-per-node N] [--nnodes N] ... train.py [args]   torchrun with backend defaults
    xtrain report train.py [args]                                  the step's report, no training
    xtrain plan --target trn1.32xlarge:4 train.py [args]           candidate plans for a cluster, no training

`xtrain run` builds a torchrun command line (`launch_command`, a pure function) and execs it.
Defaults: one process per GPU; on Trainium one process per node (`--layout process-per-core`:
one per NeuronCore); on CPU one. Under SageMaker (one entry point per host) or an srun with
one task per node, the node count, node rank and master come from that environment.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import shlex
import socket
import sys
from typing import Sequence

from xtrain.errors import LaunchError, OptionsError
from xtrain.runtime import backends, cache
from xtrain.runtime.launch import (COORDINATOR_PORT_OFFSET, DEFAULT_MASTER_PORT, Launcher, ProcessEnv,
                                   process_env)

LAYOUTS = ("process-per-node", "process-per-core")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunOptions:
    """What the user asked `xtrain run` for (None: xtrain's default).

    Attributes:
        script: the training script; args: its arguments.
        nproc_per_node, nnodes, node_rank, master_addr, master_port: as torchrun's flags.
        layout: on Trainium, one process per node or per NeuronCore.
        emulate: a cluster to fly on CPU ("trn1.32xlarge:2"): one process per emulated node.
    """

    script: str
    args: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    layout: str = "process-per-node"
    emulate: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Nodes:
    """The node-level shape of a launch."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


def _nodes_from_outer(outer: ProcessEnv) -> tuple[int, int, str | None]:
    """Nodes as the environment around `xtrain run` sees them: SageMaker's one process per host,
    or srun's one task per node; else one node."""
    if outer.launcher is Launcher.SAGEMAKER:
        return outer.num_nodes, outer.node_rank, outer.master_addr
    if outer.launcher is Launcher.SLURM and outer.local_world_size == 1:
        return outer.num_processes, outer.process_id, outer.master_addr
    return 1, 0, None


def resolve_nodes(opts: RunOptions, outer: ProcessEnv, *, free_port: int | None = None) -> Nodes:
    """The launch's nodes: flags first, then the surrounding environment."""
    # Emulation runs every emulated node as a local process of one torchrun.
    nnodes, rank, master = (1, 0, None) if opts.emulate else _nodes_from_outer(outer)
    nnodes = opts.nnodes if opts.nnodes is not None else nnodes
    rank = opts.node_rank if opts.node_rank is not None else rank
    master = opts.master_addr or master
    if nnodes > 1 and master is None:
        raise LaunchError(f"--nnodes {nnodes} needs --master-addr (the host of node 0) outside SageMaker and srun")
    if not 0 <= rank < nnodes:
        raise LaunchError(f"--node-rank {rank} is outside --nnodes {nnodes}")
    port = opts.master_port or (free_port if nnodes == 1 and free_port else DEFAULT_MASTER_PORT)
    return Nodes(nnodes=nnodes, node_rank=rank, master_addr=master or "127.0.0.1", master_port=port)


def processes_per_node(opts: RunOptions, backend: str, local_devices: int | None) -> int:
    """--nproc-per-node, else one per emulated node, else the backend's default."""
    if opts.nproc_per_node is not None:
        if opts.nproc_per_node < 1:
            raise OptionsError(f"--nproc-per-node {opts.nproc_per_node} must be >= 1")
        return opts.nproc_per_node
    if opts.emulate:
        from neuron_support.topology import parse_cluster

        return parse_cluster(opts.emulate)[1]  # one process per emulated node, on this machine
    return backends.default_nproc_per_node(backend, layout=opts.layout, local_devices=local_devices)


def launch_command(opts: RunOptions, *, backend: str, local_devices: int | None, outer: ProcessEnv,
                   python: str = sys.executable, free_port: int | None = None) -> list[str]:
    """The torchrun command line for `opts` on this node (pure: no process is started).

    Args:
        opts: the user's flags.
        backend: "neuron", "cuda" or "cpu" (backends.detect_backend()).
        local_devices: accelerators on this node (backends.local_device_count()).
        outer: the environment around `xtrain run` (process_env()): SageMaker hosts, srun tasks.
        python: the interpreter torchrun runs under.
        free_port: a port to use on a single node when none is given.
    """
    if opts.layout not in LAYOUTS:
        raise OptionsError(f"--layout {opts.layout!r} is not one of {', '.join(LAYOUTS)}")
    nodes = resolve_nodes(opts, outer, free_port=free_port)
    nproc = processes_per_node(opts, backend, local_devices)
    return [python, "-m", "torch.distributed.run", "--nnodes", str(nodes.nnodes), "--nproc_per_node", str(nproc),
            "--node_rank", str(nodes.node_rank), "--master_addr", nodes.master_addr,
            "--master_port", str(nodes.master_port), opts.script, *opts.args]


def launch_env(opts: RunOptions) -> dict[str, str]:
    """Variables `xtrain run` adds for its children."""
    return {"XTRAIN_EMULATE": opts.emulate} if opts.emulate else {}


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pair() -> int:
    """A free port whose jax.distributed coordinator port (+17) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + COORDINATOR_PORT_OFFSET < 65536 and _port_free(port + COORDINATOR_PORT_OFFSET):
            return port


def run(opts: RunOptions, *, dry_run: bool = False) -> int:
    backend = backends.detect_backend()
    cmd = launch_command(opts, backend=backend, local_devices=backends.local_device_count(backend),
                         outer=process_env(), free_port=free_port_pair())
    extra = launch_env(opts)
    print(" ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items()), shlex.join(cmd), file=sys.stderr)
    if dry_run:
        return 0
    os.execve(cmd[0], cmd, {**os.environ, **extra})


# -- xtrain env ----------------------------------------------------------------------------------

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


# -- argument parsing ----------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xtrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the backend, devices, processes, mesh and environment xtrain uses")
    env.add_argument("--emulate", help="fly a cluster on CPU devices, e.g. trn1.32xlarge:2")
    env.add_argument("--instance-type", help="instance type when it cannot be detected, e.g. trn1.32xlarge")
    env.add_argument("--no-start", action="store_true", help="do not start JAX (no device list)")
    env.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                     help="the plan's compute precision, as the script passes it to xtrain.init(precision=...)")
    r = sub.add_parser("run", help="launch a script with torchrun and this backend's defaults")
    r.add_argument("--nproc-per-node", type=int, help="processes per node (default: per backend)")
    r.add_argument("--nnodes", type=int, help="nodes (default: from SageMaker/srun, else 1)")
    r.add_argument("--node-rank", type=int, help="this node's rank (default: from SageMaker/srun, else 0)")
    r.add_argument("--master-addr", help="host of node 0 (default: from SageMaker/srun, else 127.0.0.1)")
    r.add_argument("--master-port", type=int, help=f"torchrun's store port (default {DEFAULT_MASTER_PORT}, "
                   "or a free one on a single node); jax.distributed uses it + 17")
    r.add_argument("--layout", default="process-per-node", choices=LAYOUTS, help="Trainium: processes per node")
    r.add_argument("--emulate", help="fly a cluster on CPU: one process per emulated node, e.g. trn1.32xlarge:2")
    r.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report", help="print the compiled step's report (collectives, memory) for a script "
                         "without training: its first step(...) call prints step.report() and exits")
    rep.add_argument("script")
    rep.add_argument("args", nargs=argparse.REMAINDER)
    pl = sub.add_parser("plan", help="predict memory, step time, tokens/s and MFU of candidate plans for a "
                        "target cluster and pick one; lowers for an abstract mesh (no devices of that kind needed)")
    pl.add_argument("--target", required=True, help="INSTANCE[:NODES] (e.g. trn1.32xlarge:4) or emulated[:N]")
    pl.add_argument("--global-batch", type=int, help="global batch for the target (default: the script's)")
    pl.add_argument("script")
    pl.add_argument("args", nargs=argparse.REMAINDER)
    return p


class _Stop(Exception):
    """Raised by the first-step hooks below to end the user's script once they have printed."""


def _run_script(script: str, args: Sequence[str]) -> None:
    """Runs `script` in this process as `python script args` would (its __main__ block included)."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path


def _intercepted(script: str, args: Sequence[str], run, *, build: bool, what: str) -> int:
    """Runs `script` with its first training step taken over by `run`; 0 once `run` has
    printed, an error when the script never calls a training step."""
    from xtrain.step.hooks import intercept_first_step

    def stop_after(step, batch):
        run(step, batch)
        raise _Stop

    with intercept_first_step(stop_after, build=build):
        try:
            _run_script(script, args)
        except _Stop:
            return 0
    raise LaunchError(f"{script} finished without calling a compiled training step, so there is no {what}: "
                      "`xtrain.compile(...)` then `step(*batch)` must run")


def report(script: str, args: Sequence[str]) -> int:
    """Runs `script`; its first training step prints the step's report instead of training."""
    def show(step, batch):
        text = str(step.report(*batch))
        import jax

        if jax.process_index() == 0:
            print(text, flush=True)

    return _intercepted(script, args, show, build=True, what="report")


def plan(script: str, args: Sequence[str], target: str, global_batch: int | None = None) -> int:
    """Runs `script`; its first training step prints the plan search for `target` (lowered for
    an abstract mesh: no devices of that kind needed) instead of training."""
    from xtrain.cost import hardware

    hardware.check_target(target)  # a bad target fails here, before the script runs
    if global_batch is not None and global_batch < 1:
        raise OptionsError(f"--global-batch {global_batch} must be >= 1")

    def show(step, batch):
        from xtrain.cost import hardware, search
        from xtrain.step import host_batch

        profile, devices = hardware.target(target)
        shapes = _scaled(host_batch(batch), global_batch) if global_batch else host_batch(batch)
        t = step.trainable
        print(search.search(t.model, t.tx, shapes, profile, devices, structure=t.structure,
                            target=f"{target} ({devices} devices)", experts=sorted(t.experts)), flush=True)

    return _intercepted(script, args, show, build=False, what="plan")


def _scaled(batch: tuple, global_batch: int) -> tuple:
    """The batch with its leading dimension set to `global_batch` (shapes only matter)."""
    import jax
    import numpy as np

    return tuple(jax.ShapeDtypeStruct((global_batch,) + tuple(x.shape[1:]), x.dtype)
                 if isinstance(x, np.ndarray) and x.ndim else x for x in batch)


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        if ns.command == "env":
            print(env_report(emulate=ns.emulate, instance=ns.instance_type, start=not ns.no_start,
                             precision=ns.precision))
            return 0
        if ns.command == "report":
            return report(ns.script, ns.args)
        if ns.command == "plan":
            return plan(ns.script, ns.args, ns.target, ns.global_batch)
        opts = RunOptions(script=ns.script, args=tuple(ns.args), nproc_per_node=ns.nproc_per_node,
                          nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                          master_port=ns.master_port, layout=ns.layout, emulate=ns.emulate)
        return run(opts, dry_run=ns.dry_run)
    except ValueError as err:
        print(f"xtrain {ns.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
