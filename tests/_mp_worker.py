"""One torchrun process of test_multiprocess.py: trains the tests' GPT on Mesh(data=8) spread
over every process and, on rank 0, writes the losses and the device layout as JSON.

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/_mp_worker.py OUT.json STEPS
"""
import json
import sys

import xtrain

# Before any other JAX use: 8 emulated CPU devices in the job, split over the processes.
xtrain.init(cpu_devices=8)

import jax  # noqa: E402
import torch  # noqa: E402

from models import GPT, token_batches  # noqa: E402  (tests/ is this script's directory)


def train(steps: int) -> tuple[list[float], list[int]]:
    torch.manual_seed(0)  # every process builds the same initial weights
    model = GPT()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = [step(*batch)["loss"] for batch in token_batches(n=steps)]
    mesh_processes = sorted({d.process_index for d in step.mesh.devices.flat})
    return losses, mesh_processes


def main(out_path: str, steps: int) -> None:
    losses, mesh_processes = train(steps)
    if jax.process_index() == 0:
        layout = dict(device_count=jax.device_count(), local_device_count=jax.local_device_count(),
                      process_count=jax.process_count(), mesh_processes=mesh_processes)
        with open(out_path, "w") as f:
            json.dump(dict(losses=losses, **layout), f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
