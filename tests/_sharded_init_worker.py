"""One torchrun process of test_sharded_init.py: builds a large model on the meta device, loads
its weights from a safetensors file straight into ZeRO-3 shards, and reports (rank 0, JSON)
the host memory each process gained while loading and the eval loss.

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/_sharded_init_worker.py FILE OUT.json
"""
import json
import resource
import sys

import jax
import numpy as np
import torch

import xtrain
from models import Stack, stack_batch


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main(file: str, out: str) -> None:
    xtrain.init(cpu_devices=8)
    # Compile something small first: the imports and caches of the first compile are not the
    # model's memory.
    torch.manual_seed(0)  # the same weights in every process
    warm = Stack(d=64, layers=2)
    xtrain.compile(warm, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(warm.parameters(), lr=0.1))
    with torch.device("meta"):
        model = Stack()
    mesh = xtrain.Mesh(data=8)
    plan = xtrain.plans.fsdp(model, mesh)
    before = rss_bytes()
    step = xtrain.compile(model, mesh, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan,
                          init_from=file)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    gained = np.asarray(jax.experimental.multihost_utils.process_allgather(np.int64(peak - before)))
    loss = step.eval(*stack_batch())["loss"]
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump(dict(gained=[int(g) for g in gained.reshape(-1)], loss=loss, processes=jax.process_count(),
                           sharded=sorted(n for n, s in step.param_specs.items() if any(s)),
                           whole=sorted(n for n, s in step.param_specs.items() if not any(s))), f)


if __name__ == "__main__":
    main(*sys.argv[1:])
