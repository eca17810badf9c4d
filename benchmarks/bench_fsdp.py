"""Benchmark worker: the model trained with PyTorch FSDP2 (`fully_shard`) over gloo (torchrun).

    torchrun --nproc_per_node=2 benchmarks/bench_fsdp.py --steps 30

Each block and then the root are sharded (parameters split over the ranks, gathered per use,
gradients reduce-scattered); each rank trains on its slice of the global batch.
"""
import bench_common

CORE = bench_common.pin_to_core()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def blocks(model) -> list[torch.nn.Module]:
    """The transformer blocks: the GPT's `blocks`, or Llama's decoder layers."""
    stack = getattr(model, "blocks", None) or model.lm.model.layers
    return list(stack)


def main() -> None:
    args = bench_common.parse_args()
    rank, world, local = bench_common.gloo_rank_slice(args)
    model = bench_common.build_model(args)
    for block in blocks(model):
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def step(x, y) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(torch.from_numpy(x[local]), torch.from_numpy(y[local]))
        loss.backward()  # FSDP2 reduce-scatters the gradients here
        opt.step()
        return loss.item()

    losses, seconds = bench_common.timed_loop(step, bench_common.batches(args), args.warmup)
    if rank == 0:
        bench_common.emit("fsdp2", losses, seconds, processes=world, core=CORE, torch_threads=torch.get_num_threads())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
