"""One torchrun process of test_loader.py: per-process loading over 2 processes x 4 CPU devices.

Each process reads only its devices' samples; rank 0 writes, per batch, the indices every
process read and the global array gathered from both, plus each process's rows, as JSON.
Usage: python -m torch.distributed.run --nproc_per_node=2 tests/_loader_worker.py OUT.json
"""
import json
import sys

import numpy as np

import xtrain


class Samples:
    def __init__(self, n=50):
        self.n, self.read = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.read.append(int(i))
        return np.full(3, i, dtype=np.float32), np.int64(i)


def main(out: str) -> None:
    xtrain.init(cpu_devices=8)  # 4 devices in each of the 2 processes
    import jax
    from jax.experimental import multihost_utils

    dataset = Samples()
    loader = xtrain.ShardedLoader(dataset, batch_size=16, mesh=xtrain.Mesh(data=8), seed=5)
    batches = []
    for _, (x, y) in zip(range(3), loader):
        read = sorted(dataset.read[:8])
        del dataset.read[:8]
        gathered = multihost_utils.process_allgather(y, tiled=True)
        everyone = multihost_utils.process_allgather(np.asarray(read), tiled=False)
        assert np.array_equal(np.asarray(multihost_utils.process_allgather(x, tiled=True))[:, 0], gathered)
        batches.append({"gathered": np.asarray(gathered).tolist(), "read": np.asarray(everyone).tolist()})
    rows = multihost_utils.process_allgather(np.asarray(loader.rows), tiled=False)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump({"batches": batches, "rows": np.asarray(rows).tolist()}, f)


if __name__ == "__main__":
    main(sys.argv[1])
