"""`xtrain run`: the torchrun command line for this node (`launch_command`, a pure function), and
the launch that execs it.

Defaults: one process per GPU; on Trainium one process per node (`--layout process-per-core`:
one per NeuronCore); on CPU one. Under SageMaker (one entry point per host) or an srun with
one task per node, the node count, node rank and master come from that environment.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys

from xtrain.errors import LaunchError, OptionsError
from xtrain.runtime import backends
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
        verbose: on CPU, also pass on the collective library's per-rank connection lines.
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
    verbose: bool = False


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
    if backend == "cpu" and not opts.verbose:
        return _run_filtered(cmd, {**os.environ, **extra})
    os.execve(cmd[0], cmd, {**os.environ, **extra})


# JAX's CPU collectives (Gloo) print one line per rank when their connections are up, to the
# process's stdout, unconditionally: 64 lines for an emulated trn1.32xlarge:2. Several workers
# share one pipe and write from several threads, so a notice may arrive cut at any character,
# its pieces on lines of their own or glued to another worker's record.
_GLOO_NOTICE = "[Gloo] Rank 0 is connected to 0 peer ranks. Expected number of connected peer ranks is : 0"
_SHORTEST_PIECE = 5  # pieces glued to other output; shorter ones ("63", ": 7") stay
_SHORTEST_LINE = 12  # a line that is only a piece: "Rank 0" or "Expected" alone could be the user's


def _digits_free(text: str) -> str:
    return re.sub(r"\d+", "0", text)


def _pattern(text: str) -> str:
    return "".join(r"\d*" if c == "0" else re.escape(c) for c in text)


_WHOLE = re.compile(r"(?:\[Gloo\] Rank )?\d* ?" + _pattern(_GLOO_NOTICE.removeprefix("[Gloo] Rank 0 ")))
_HEAD_AT_END = re.compile("(?:" + "|".join(_pattern(_GLOO_NOTICE[:i]) for i in range(
    len(_GLOO_NOTICE) - 1, _SHORTEST_PIECE - 1, -1)) + r")$")
_TAIL_AT_START = re.compile("^(?:" + "|".join(_pattern(_GLOO_NOTICE[i:]) for i in range(
    1, len(_GLOO_NOTICE) - _SHORTEST_PIECE + 1)) + ")")


def without_gloo_lines(line: str) -> str | None:
    """`line` without Gloo's connection notices or pieces of them; None when nothing else was on it."""
    end = "\n" if line.endswith("\n") else ""
    body = _WHOLE.sub("", line[:len(line) - len(end)])
    if len(body.strip()) >= _SHORTEST_LINE and _digits_free(body.strip()) in _GLOO_NOTICE:
        return None
    body = _TAIL_AT_START.sub("", _HEAD_AT_END.sub("", body))
    if body == line[:len(line) - len(end)]:
        return line
    return body + end if body.strip() else None


def _run_filtered(cmd: list[str], env: dict[str, str]) -> int:
    """Runs torchrun as a child (not exec'd) so that the workers' stdout passes through
    `without_gloo_lines`; SIGTERM and SIGINT go on to torchrun, which stops its workers."""
    child = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1")},
                             stdout=subprocess.PIPE, text=True, errors="replace")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda number, _frame: child.send_signal(number))
    for line in child.stdout:
        kept = without_gloo_lines(line)
        if kept is not None:
            sys.stdout.write(kept)
            sys.stdout.flush()
    return child.wait()
