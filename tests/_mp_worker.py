"""One torchrun process of test_multiprocess.py: trains the tests' GPT on a mesh spread over
every process and, on rank 0, writes the losses and the device layout as JSON.

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/_mp_worker.py OUT.json STEPS
           [--plan ddp|megatron] [--mesh data=4,tensor=2 ...] [--die-rank R --die-after S]
           [--heartbeat-timeout SECONDS]

Each --mesh is trained in turn (default: data=8) with the same plan preset. --die-rank R makes
rank R leave abruptly (os._exit(1), no clean-up) after its step S: the others must not hang.
"""
import argparse
import json
import os
import sys

import jax
import numpy as np
import torch

import xtrain
import xtrain.runtime.devices
from models import GPT, token_batches  # tests/ is this script's directory

PLANS = {"ddp": lambda model, mesh: None, "megatron": xtrain.plans.megatron}


def parse_mesh(text: str) -> dict[str, int]:
    """'data=4,tensor=2' -> {'data': 4, 'tensor': 2} (order kept: it is the mesh's axis order)."""
    return {name: int(size) for name, size in (item.split("=") for item in text.split(","))}


def train(steps: int, plan: str, axes: dict[str, int], die: tuple[int, int] | None) -> dict:
    torch.manual_seed(0)  # every process builds the same initial weights
    model = GPT()
    mesh = xtrain.Mesh(**axes)
    step = xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          plan=PLANS[plan](model, mesh))
    losses = []
    for i, batch in enumerate(token_batches(n=steps)):
        losses.append(step(*batch)["loss"])
        print(f"rank {jax.process_index()} step {i} loss {losses[-1]}", flush=True)
        if die is not None and die == (jax.process_index(), i):
            print(f"rank {jax.process_index()} exits abruptly after step {i}", flush=True)
            os._exit(1)
    return dict(plan=plan, mesh=axes, losses=losses, cross_process_axes=cross_process_axes(step.mesh),
                mesh_processes=sorted({d.process_index for d in step.mesh.devices.flat}))


def cross_process_axes(mesh) -> list[str]:
    """The mesh axes along which some group of devices spans more than one process."""
    out = []
    for k, name in enumerate(mesh.axis_names):
        groups = np.moveaxis(mesh.devices, k, -1).reshape(-1, mesh.devices.shape[k])
        if any(len({d.process_index for d in group}) > 1 for group in groups):
            out.append(name)
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("--plan", choices=sorted(PLANS), default="ddp")
    p.add_argument("--mesh", type=parse_mesh, action="append")
    p.add_argument("--die-rank", type=int)
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--heartbeat-timeout", type=int, default=xtrain.runtime.devices.HEARTBEAT_TIMEOUT_S)
    args = p.parse_args(argv)
    # Before any other JAX use: 8 emulated CPU devices in the job, split over the processes.
    xtrain.init(cpu_devices=8, heartbeat_timeout_s=args.heartbeat_timeout)
    die = None if args.die_rank is None else (args.die_rank, args.die_after)
    runs = [train(args.steps, args.plan, axes, die) for axes in args.mesh or [{"data": 8}]]
    if jax.process_index() == 0:
        layout = dict(device_count=jax.device_count(), local_device_count=jax.local_device_count(),
                      process_count=jax.process_count())
        with open(args.out, "w") as f:
            json.dump(dict(runs=runs, **layout), f)


if __name__ == "__main__":
    main(sys.argv[1:])
