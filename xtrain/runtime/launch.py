"""What the launcher told this process: rank, world size, coordinator.

Only the environment is read here; `devices.init` acts on it.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

# jax.distributed's coordinator must not share torchrun's store port (MASTER_PORT).
COORDINATOR_PORT_OFFSET = 17


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProcessEnv:
    """One process's place in a multi-process job.

    Attributes:
        process_id: global rank of this process.
        num_processes: number of processes in the job.
        local_rank: rank of this process on its host.
        local_world_size: processes on this host.
        coordinator: "host:port" of the jax.distributed coordinator (rank 0's host).
        launcher: which launcher set the environment ("torchrun" or "single").
    """

    process_id: int = 0
    num_processes: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    coordinator: str | None = None
    launcher: str = "single"

    @property
    def is_multi_process(self) -> bool:
        return self.num_processes > 1


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _torchrun(env: Mapping[str, str]) -> ProcessEnv:
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ValueError(
            f"incomplete torchrun environment: {', '.join(missing)} not set (have "
            f"{', '.join(k for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT') if k in env)}); "
            "launch with torchrun, or set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT")
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    port = int(env.get("XTRAIN_COORDINATOR_PORT", _int(env, "MASTER_PORT") + COORDINATOR_PORT_OFFSET))
    return ProcessEnv(
        process_id=rank,
        num_processes=world,
        local_rank=int(env.get("LOCAL_RANK", "0")),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        coordinator=f"{env['MASTER_ADDR']}:{port}",
        launcher="torchrun",
    )


def process_env(env: Mapping[str, str] | None = None) -> ProcessEnv:
    """Reads the launcher's variables (torchrun or none) into a ProcessEnv."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "RANK" in env:
        return _torchrun(env)
    return ProcessEnv()
