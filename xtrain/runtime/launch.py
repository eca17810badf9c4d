"""What the launcher told this process: rank, world size, node, coordinator, devices.

Understands torchrun, SageMaker (alone or around torchrun / mpirun), Slurm's srun, MPI
(Open MPI, MPICH / Intel MPI through PMI) and a plain single process. Only the environment is
read here (a mapping, so recorded environments test it); `devices.init` acts on the result.

Precedence when several launchers left variables: torchrun, then MPI, then Slurm, then
SageMaker's one-process-per-host launch. The outer ones are cross-checked against the inner
one (a torchrun job under srun must agree with Slurm on its size), and a disagreement is an
error naming both sides' variables, never a guess.

Why this is long: five launchers, each read in about 60 lines (Slurm's host lists included),
and the checks that compare them read each other's variables; kept in one module so the
precedence and every cross-check read top to bottom in one place, as one pure function of the
environment mapping.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
from typing import Mapping

from xtrain.errors import LaunchError

# jax.distributed's coordinator must not share torchrun's store port (MASTER_PORT).
COORDINATOR_PORT_OFFSET = 17
# torchrun's default --master_port; the base port when no launcher names one.
DEFAULT_MASTER_PORT = 29500


class Launcher(str, enum.Enum):
    """The program that started this process."""

    SINGLE = "single"          # `python train.py`
    TORCHRUN = "torchrun"      # torchrun / torch.distributed.run (also under SageMaker, Slurm)
    SLURM = "slurm"            # srun, one task per process
    MPI = "mpi"                # mpirun / mpiexec (Open MPI, MPICH, Intel MPI)
    SAGEMAKER = "sagemaker"    # SageMaker without `distribution`: one process per host


class Cluster(str, enum.Enum):
    """The job system the process runs inside (it may differ from the launcher)."""

    LOCAL = "local"
    SAGEMAKER = "sagemaker"
    SLURM = "slurm"


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessEnv:
    """One process's place in a multi-process job.

    Attributes:
        process_id: global rank of this process.
        num_processes: number of processes in the job.
        local_rank: rank of this process on its node.
        local_world_size: processes on this node.
        node_rank: index of this node in the job.
        num_nodes: nodes (hosts) in the job.
        coordinator: "host:port" of the jax.distributed coordinator (rank 0's host); None for
            a single process.
        master_addr: rank 0's host as the launcher names it (torchrun's MASTER_ADDR, the first
            SageMaker or Slurm host); Neuron's collectives root (NEURON_RT_ROOT_COMM_ID) lives there.
        launcher: the program that started this process.
        cluster: the job system around it (SageMaker, Slurm, or none).
        hosts: every host of the job, rank 0's first, when the cluster lists them.
        devices_per_process: accelerators this process owns, when the environment says
            (SageMaker's SM_NUM_GPUS / SM_NUM_NEURONS split over the node's processes);
            None means "every device the backend shows this process".
        instance_type: EC2 instance type without SageMaker's "ml." prefix, when known.
        restart_count: how often torchrun restarted the job (TORCHELASTIC_RESTART_COUNT).
        model_dir: where SageMaker uploads the model from (SM_MODEL_DIR).
        data_channels: SageMaker input channels as (name, local path) pairs (SM_CHANNEL_*).
    """

    process_id: int = 0
    num_processes: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    coordinator: str | None = None
    master_addr: str | None = None
    launcher: Launcher = Launcher.SINGLE
    cluster: Cluster = Cluster.LOCAL
    hosts: tuple[str, ...] = ()
    devices_per_process: int | None = None
    instance_type: str | None = None
    restart_count: int = 0
    model_dir: str | None = None
    data_channels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        for name, index, count in (("process_id", self.process_id, self.num_processes),
                                   ("local_rank", self.local_rank, self.local_world_size),
                                   ("node_rank", self.node_rank, self.num_nodes)):
            if not 0 <= index < count:
                raise LaunchError(f"ProcessEnv.{name}={index} is outside 0..{count - 1} "
                                  f"(launcher {self.launcher.value})")
        if self.is_multi_process and not self.coordinator:
            raise LaunchError(f"ProcessEnv with num_processes={self.num_processes} needs a coordinator "
                              "'host:port'; set XTRAIN_COORDINATOR or MASTER_ADDR")
        if self.devices_per_process is not None and self.devices_per_process < 1:
            raise LaunchError(f"ProcessEnv.devices_per_process={self.devices_per_process} must be >= 1 or None")

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1

    @property
    def coordinator_host(self) -> str | None:
        return self.coordinator.rsplit(":", 1)[0] if self.coordinator else None


# -- reading variables ------------------------------------------------------------------------

def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"environment variable {name}={value!r} is not an integer") from None


def _int_or(env: Mapping[str, str], name: str, default: int) -> int:
    return _int(env, name) if name in env else default


def _require(env: Mapping[str, str], names: tuple[str, ...], launcher: str, fix: str) -> None:
    missing = [n for n in names if n not in env]
    if missing:
        have = [n for n in names if n in env]
        raise LaunchError(f"incomplete {launcher} environment: {', '.join(missing)} not set "
                          f"(have {', '.join(have) or 'none of them'}); {fix}")


def _port(env: Mapping[str, str], default: int) -> int:
    """The coordinator's port: XTRAIN_COORDINATOR_PORT, else the launcher's port + offset."""
    if "XTRAIN_COORDINATOR_PORT" in env:
        return _int(env, "XTRAIN_COORDINATOR_PORT")
    base = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else default
    return base + COORDINATOR_PORT_OFFSET


def _coordinator(env: Mapping[str, str], host: str | None, default_port: int) -> str | None:
    """XTRAIN_COORDINATOR ("host:port") wins; otherwise `host` with the derived port."""
    if "XTRAIN_COORDINATOR" in env:
        value = env["XTRAIN_COORDINATOR"]
        if not re.fullmatch(r".+:\d+", value):
            raise LaunchError(f"XTRAIN_COORDINATOR={value!r} must be 'host:port', e.g. '10.0.0.1:29517'")
        return value
    return f"{host}:{_port(env, default_port)}" if host else None


def _split_evenly(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise LaunchError(f"{what} cannot be split evenly over {parts} processes per node; "
                          f"use a process count per node that divides {total}")
    return total // parts


# -- torchrun ---------------------------------------------------------------------------------

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _torchrun_local(env: Mapping[str, str]) -> tuple[int, int]:
    if "LOCAL_RANK" in env and "LOCAL_WORLD_SIZE" not in env:
        raise LaunchError("LOCAL_RANK is set but LOCAL_WORLD_SIZE is not; launch with torchrun, or set "
                          "LOCAL_WORLD_SIZE to the number of processes on this node")
    local_rank, local_world = _int_or(env, "LOCAL_RANK", 0), _int_or(env, "LOCAL_WORLD_SIZE", 1)
    if not 0 <= local_rank < local_world:
        raise LaunchError(f"LOCAL_RANK={local_rank} is outside LOCAL_WORLD_SIZE={local_world}")
    return local_rank, local_world


def _torchrun_nodes(env: Mapping[str, str], world: int, local_world: int) -> int:
    if world % local_world:
        raise LaunchError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}; "
                          "every node must run the same number of processes")
    nodes = world // local_world
    if "GROUP_WORLD_SIZE" in env and _int(env, "GROUP_WORLD_SIZE") != nodes:
        raise LaunchError(f"GROUP_WORLD_SIZE={env['GROUP_WORLD_SIZE']} disagrees with WORLD_SIZE={world} / "
                          f"LOCAL_WORLD_SIZE={local_world} = {nodes} nodes")
    return nodes


def _torchrun(env: Mapping[str, str]) -> ProcessEnv:
    _require(env, ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"), "torchrun",
             "launch with torchrun, or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
    local_rank, local_world = _torchrun_local(env)
    nodes = _torchrun_nodes(env, world, local_world)
    node_rank = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // local_world
    return ProcessEnv(
        process_id=rank, num_processes=world, local_rank=local_rank, local_world_size=local_world,
        node_rank=node_rank, num_nodes=nodes,
        coordinator=_coordinator(env, env["MASTER_ADDR"], DEFAULT_MASTER_PORT),
        master_addr=env["MASTER_ADDR"], launcher=Launcher.TORCHRUN,
        restart_count=_int_or(env, "TORCHELASTIC_RESTART_COUNT", 0))


# -- Slurm ------------------------------------------------------------------------------------

_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
# Steps that are not an srun launch: the batch script, the extern step, salloc's shell.
_SLURM_NON_LAUNCH_STEPS = {"batch", "extern", "interactive"}


def _split_top_level(text: str) -> list[str]:
    """'a[1-2,4],b' -> ['a[1-2,4]', 'b']: commas outside brackets separate hosts."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(spec: str) -> list[str]:
    """'01-03,07' -> ['01', '02', '03', '07'] (zero padding kept)."""
    out = []
    for item in spec.split(","):
        lo, _, hi = item.partition("-")
        if not hi:
            out.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise LaunchError(f"Slurm host range '{item}' is not 'low-high' with low <= high")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def _expand_host(pattern: str) -> list[str]:
    """'rack[1-2]-n[01-02]' -> every combination, in Slurm's order."""
    match = re.search(r"\[([^\]]*)\]", pattern)
    if not match:
        if "[" in pattern or "]" in pattern:
            raise LaunchError(f"Slurm host list entry '{pattern}' has an unbalanced bracket")
        return [pattern]
    head, tail = pattern[:match.start()], pattern[match.end():]
    return [head + mid + rest for mid in _expand_range(match.group(1)) for rest in _expand_host(tail)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, e.g. 'node[01-03,07],login1' -> ['node01', ..., 'login1']."""
    return [host for part in _split_top_level(text.strip()) for host in _expand_host(part)]


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's SLURM_TASKS_PER_NODE, e.g. '2(x3),1' -> [2, 2, 2, 1]."""
    out = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise LaunchError(f"SLURM_TASKS_PER_NODE entry {item!r} is not 'N' or 'N(xK)'")
        out += [int(match.group(1))] * int(match.group(2) or 1)
    return out


def _slurm_step_launched(env: Mapping[str, str]) -> bool:
    """True inside an srun step. The batch script, salloc's shell or an ssh session into an
    allocation carry the job's SLURM_* variables too, but describe the allocation, not this
    process: treating those as a launch makes one process wait for N-1 that never start."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is None and env.get("SLURM_PROCID", "0") != "0":
        raise LaunchError(f"SLURM_PROCID={env['SLURM_PROCID']} but SLURM_STEP_ID is unset: only srun starts "
                          "ranks other than 0; launch with srun, or unset the copied SLURM_* variables")
    if step is None or ("SLURM_PROCID" not in env and "SLURM_NTASKS" not in env):
        return False
    return step not in _SLURM_NON_LAUNCH_STEPS and not (step.isdigit() and int(step) >= 0xFFFFFFF0)


def _slurm_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    name = next((n for n in _SLURM_NODELISTS if n in env), None)
    return tuple(expand_hostlist(env[name])) if name else ()


def _slurm_world(env: Mapping[str, str]) -> int:
    for name in ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "SLURM_NPROCS"):
        if name in env:
            return _int(env, name)
    raise LaunchError("incomplete Slurm environment: SLURM_PROCID is set but SLURM_NTASKS is not; "
                      "launch the script with srun (srun --ntasks=N python train.py)")


def _slurm_local_world(env: Mapping[str, str], node_rank: int) -> int:
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            counts = expand_tasks_per_node(env[name])
            if node_rank >= len(counts):
                raise LaunchError(f"{name}={env[name]!r} lists {len(counts)} nodes but SLURM_NODEID={node_rank}")
            return counts[node_rank]
    return 1


def _slurm_port(env: Mapping[str, str]) -> int:
    """jax's rule (clusters/slurm_cluster.py): a port from the job id in [61440, 65535], so
    two jobs sharing a node do not collide; MASTER_PORT or XTRAIN_COORDINATOR_PORT override."""
    if "SLURM_JOB_ID" in env and "MASTER_PORT" not in env:
        return _int(env, "SLURM_JOB_ID") % 2**12 + (65535 - 2**12 + 1) - COORDINATOR_PORT_OFFSET
    return DEFAULT_MASTER_PORT


def _slurm(env: Mapping[str, str]) -> ProcessEnv:
    _require(env, ("SLURM_PROCID", "SLURM_LOCALID"), "Slurm",
             "launch the script with srun, which sets both")
    world, hosts = _slurm_world(env), _slurm_hosts(env)
    node_rank = _int_or(env, "SLURM_NODEID", 0)
    num_nodes = _int(env, "SLURM_STEP_NUM_NODES") if "SLURM_STEP_NUM_NODES" in env else (
        _int_or(env, "SLURM_NNODES", len(hosts) or 1))
    master = env.get("MASTER_ADDR") or (hosts[0] if hosts else None)
    if world > 1 and master is None and "XTRAIN_COORDINATOR" not in env:
        raise LaunchError("Slurm environment names no host for rank 0: SLURM_STEP_NODELIST, "
                          "SLURM_JOB_NODELIST and SLURM_NODELIST are all unset; set MASTER_ADDR or "
                          "XTRAIN_COORDINATOR='host:port'")
    return ProcessEnv(
        process_id=_int(env, "SLURM_PROCID"), num_processes=world,
        local_rank=_int(env, "SLURM_LOCALID"), local_world_size=_slurm_local_world(env, node_rank),
        node_rank=node_rank, num_nodes=num_nodes,
        coordinator=_coordinator(env, master, _slurm_port(env)) if world > 1 else None,
        master_addr=master, launcher=Launcher.SLURM, cluster=Cluster.SLURM, hosts=hosts)


# -- MPI --------------------------------------------------------------------------------------

# (rank, size, local rank, local size) as Open MPI and as PMI (MPICH, Intel MPI) name them.
_MPI_FLAVOURS = (
    ("Open MPI", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                  "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("PMI", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
)


def _mpi_flavour(env: Mapping[str, str]) -> tuple[str, tuple[str, ...]] | None:
    return next(((n, names) for n, names in _MPI_FLAVOURS if names[0] in env or names[1] in env), None)


def _mpi_launcher_host(env: Mapping[str, str]) -> str | None:
    """mpirun's own host from Open MPI's OMPI_MCA_orte_hnp_uri ('<jobid>;tcp://ip,...:port'),
    the fallback jax uses (clusters/ompi_cluster.py); rank 0 usually runs there."""
    match = re.search(r"tcp://([^,:;]+)", env.get("OMPI_MCA_orte_hnp_uri", ""))
    return match.group(1) if match else None


def _mpi_master(env: Mapping[str, str], sagemaker_hosts: tuple[str, ...]) -> str | None:
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if sagemaker_hosts:
        return sagemaker_hosts[0]
    slurm_hosts = _slurm_hosts(env)
    return slurm_hosts[0] if slurm_hosts else _mpi_launcher_host(env)


def _mpi(env: Mapping[str, str], flavour: str, names: tuple[str, ...]) -> ProcessEnv:
    rank_var, size_var, local_var, local_size_var = names
    _require(env, (rank_var, size_var), flavour, f"launch with mpirun, which sets both {rank_var} and {size_var}")
    rank, world = _int(env, rank_var), _int(env, size_var)
    local_rank, local_world = _int_or(env, local_var, 0), _int_or(env, local_size_var, 1)
    master = _mpi_master(env, _sagemaker_hosts(env))
    if world > 1 and master is None and "XTRAIN_COORDINATOR" not in env:
        raise LaunchError(f"MPI job ({rank_var}={rank}, {size_var}={world}) names no coordinator: set "
                          "XTRAIN_COORDINATOR='host:port' (rank 0's host) or MASTER_ADDR, e.g. "
                          "mpirun -x MASTER_ADDR=$(hostname) ...")
    # Open MPI may place unequal counts per node; jax does not mind, so nodes are only counted.
    node_rank = _int_or(env, "OMPI_COMM_WORLD_NODE_RANK", rank // local_world)
    num_nodes = max(-(-world // local_world), node_rank + 1)
    return ProcessEnv(
        process_id=rank, num_processes=world, local_rank=local_rank, local_world_size=local_world,
        node_rank=node_rank, num_nodes=num_nodes,
        coordinator=_coordinator(env, master, DEFAULT_MASTER_PORT) if world > 1 else None,
        master_addr=master, launcher=Launcher.MPI)


# -- SageMaker --------------------------------------------------------------------------------

def _sagemaker_hosts(env: Mapping[str, str]) -> tuple[str, ...]:
    if "SM_HOSTS" not in env:
        return ()
    try:
        hosts = json.loads(env["SM_HOSTS"])
    except json.JSONDecodeError:
        hosts = None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) for h in hosts):
        raise LaunchError(f"SM_HOSTS={env['SM_HOSTS']!r} is not a JSON list of host names, "
                          "e.g. '[\"algo-1\", \"algo-2\"]'")
    return tuple(hosts)


def _sagemaker_node(env: Mapping[str, str], hosts: tuple[str, ...]) -> int:
    _require(env, ("SM_CURRENT_HOST",), "SageMaker", "SageMaker sets SM_CURRENT_HOST next to SM_HOSTS")
    if env["SM_CURRENT_HOST"] not in hosts:
        raise LaunchError(f"SM_CURRENT_HOST={env['SM_CURRENT_HOST']!r} is not in SM_HOSTS={list(hosts)}")
    return hosts.index(env["SM_CURRENT_HOST"])


def _sagemaker_devices(env: Mapping[str, str], local_world: int) -> int | None:
    """SM_NUM_GPUS, else SM_NUM_NEURONS (NeuronCores: the SageMaker training toolkit sums
    `nc_count` from `neuron-ls -j`, environment.py num_neurons()), split over the node's processes."""
    for name in ("SM_NUM_GPUS", "SM_NUM_NEURONS"):
        count = _int_or(env, name, 0)
        if count > 0:
            return _split_evenly(count, local_world, f"{name}={count}")
    return None


def _sagemaker_extras(env: Mapping[str, str]) -> dict:
    channels = tuple(sorted((k[len("SM_CHANNEL_"):].lower(), v) for k, v in env.items()
                            if k.startswith("SM_CHANNEL_")))
    instance = env.get("SM_CURRENT_INSTANCE_TYPE")
    return dict(model_dir=env.get("SM_MODEL_DIR"), data_channels=channels,
                instance_type=instance[3:] if instance and instance.startswith("ml.") else instance)


def _sagemaker_alone(env: Mapping[str, str], hosts: tuple[str, ...]) -> ProcessEnv:
    """SageMaker without `distribution`: the entry point runs once per host."""
    node = _sagemaker_node(env, hosts)
    return ProcessEnv(
        process_id=node, num_processes=len(hosts), node_rank=node, num_nodes=len(hosts),
        coordinator=_coordinator(env, hosts[0], DEFAULT_MASTER_PORT) if len(hosts) > 1 else None,
        master_addr=hosts[0], launcher=Launcher.SAGEMAKER)


def _with_sagemaker(inner: ProcessEnv, env: Mapping[str, str], hosts: tuple[str, ...]) -> ProcessEnv:
    """A torchrun or mpirun job that SageMaker started: hosts must match the job's nodes."""
    node = _sagemaker_node(env, hosts)
    _check_sagemaker_node(inner, env, node)
    if len(hosts) != inner.num_nodes:
        raise LaunchError(
            f"SageMaker and {inner.launcher.value} disagree on the number of nodes: SM_HOSTS lists "
            f"{len(hosts)} hosts but the job has {inner.num_processes} processes x "
            f"{inner.local_world_size} per node = {inner.num_nodes} nodes; launch one process group "
            f"per host (torchrun --nnodes {len(hosts)})")
    return dataclasses.replace(
        inner, cluster=Cluster.SAGEMAKER, hosts=hosts,
        node_rank=inner.node_rank if inner.launcher is Launcher.TORCHRUN else node,
        devices_per_process=_sagemaker_devices(env, inner.local_world_size), **_sagemaker_extras(env))


# -- cross-checks between launchers ----------------------------------------------------------

def _check_sagemaker_node(job: ProcessEnv, env: Mapping[str, str], host_index: int) -> None:
    """SageMaker passes --node_rank <index of SM_CURRENT_HOST in SM_HOSTS> to torchrun."""
    if job.launcher is Launcher.TORCHRUN and "GROUP_RANK" in env and job.node_rank != host_index:
        raise LaunchError(
            f"SM_CURRENT_HOST={env['SM_CURRENT_HOST']!r} is host {host_index} of SM_HOSTS but torchrun's "
            f"GROUP_RANK={job.node_rank}; start torchrun with --node_rank {host_index} on this host")


def _check_torchrun_vs_slurm(job: ProcessEnv, env: Mapping[str, str]) -> None:
    """srun may start one torchrun per node (SLURM_NTASKS = nodes) or every rank itself
    (SLURM_NTASKS = WORLD_SIZE); any other count means the two describe different jobs."""
    tasks = _slurm_world(env)
    if tasks not in (job.num_processes, job.num_nodes):
        raise LaunchError(
            f"torchrun and Slurm disagree on the job size: WORLD_SIZE={job.num_processes} "
            f"({job.num_nodes} nodes x LOCAL_WORLD_SIZE={job.local_world_size}) but "
            f"SLURM_NTASKS={tasks}; start one torchrun per node (srun --ntasks-per-node=1 "
            f"torchrun --nnodes {tasks} ...) or let srun start every rank without torchrun")


def _check_torchrun_vs_mpi(job: ProcessEnv, env: Mapping[str, str], names: tuple[str, ...]) -> None:
    rank, world = _int_or(env, names[0], -1), _int_or(env, names[1], -1)
    if (rank, world) != (job.process_id, job.num_processes):
        raise LaunchError(
            f"torchrun (RANK={job.process_id}, WORLD_SIZE={job.num_processes}) and MPI "
            f"({names[0]}={env.get(names[0])}, {names[1]}={env.get(names[1])}) both describe this "
            "process and disagree; launch with one of them, or unset the other's variables")


def _inner_launch(env: Mapping[str, str]) -> ProcessEnv | None:
    """The process's own launcher (torchrun, MPI or srun) with its cross-checks."""
    flavour = _mpi_flavour(env)
    if any(v in env for v in TORCHRUN_VARS):
        job = _torchrun(env)
        if flavour:
            _check_torchrun_vs_mpi(job, env, flavour[1])
        if not _slurm_step_launched(env):
            return job
        _check_torchrun_vs_slurm(job, env)
        return dataclasses.replace(job, cluster=Cluster.SLURM, hosts=_slurm_hosts(env))
    if flavour:
        return _mpi(env, *flavour)
    if _slurm_step_launched(env):
        return _slurm(env)
    return None


def process_env(env: Mapping[str, str] | None = None) -> ProcessEnv:
    """Reads the launcher's variables into a ProcessEnv.

    Args:
        env: the environment to read; `os.environ` by default.

    Returns:
        This process's rank, job size, node, coordinator and devices.

    Raises:
        ValueError: naming the variables, when the environment is partial or two launchers
            disagree.
    """
    env = os.environ if env is None else env
    hosts = _sagemaker_hosts(env)
    inner = _inner_launch(env)
    if inner is not None:
        return _with_sagemaker(inner, env, hosts) if hosts else inner
    if hosts:
        job = _sagemaker_alone(env, hosts)
        return dataclasses.replace(job, cluster=Cluster.SAGEMAKER, hosts=hosts,
                                   devices_per_process=_sagemaker_devices(env, 1), **_sagemaker_extras(env))
    return ProcessEnv()
