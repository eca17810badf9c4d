"""Benchmark worker: the GPT trained with PyTorch DDP over gloo (under torchrun).

    torchrun --nproc_per_node=2 benchmarks/bench_ddp.py --steps 30

Each rank trains on its contiguous slice of the same global batch, as xtrain does.
"""
import bench_common

CORE = bench_common.pin_to_core()  # same pinning as the xtrain worker

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def main() -> None:
    args = bench_common.parse_args()
    rank, world, local = bench_common.gloo_rank_slice(args)
    model = DistributedDataParallel(bench_common.build_model(args))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def step(x, y) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(torch.from_numpy(x[local]), torch.from_numpy(y[local]))
        loss.backward()  # DDP all-reduces (averages) the gradients here
        opt.step()
        return loss.item()  # rank 0's half of the batch

    losses, seconds = bench_common.timed_loop(step, bench_common.batches(args), args.warmup)
    if rank == 0:
        bench_common.emit("ddp", losses, seconds, processes=world, core=CORE,
                          torch_threads=torch.get_num_threads())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
