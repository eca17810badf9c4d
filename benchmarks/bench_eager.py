"""Benchmark worker: the GPT trained with plain torch eager in one process on one core.

    OMP_NUM_THREADS=1 python benchmarks/bench_eager.py --steps 30
"""
import bench_common

CORE = bench_common.pin_to_core()

import torch  # noqa: E402


def main() -> None:
    args = bench_common.parse_args()
    model = bench_common.build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    def step(x, y) -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        opt.step()
        return loss.item()

    losses, seconds = bench_common.timed_loop(step, bench_common.batches(args), args.warmup)
    bench_common.emit("eager", losses, seconds, processes=1, core=CORE, torch_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
