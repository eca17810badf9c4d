"""Benchmark worker: the GPT trained with xtrain, one CPU device per process (under torchrun).

    torchrun --nproc_per_node=2 benchmarks/bench_xtrain.py --steps 30
"""
import os

import bench_common

CORE = bench_common.pin_to_core()  # before jax starts its thread pools

import torch  # noqa: E402

import xtrain  # noqa: E402


def main() -> None:
    args = bench_common.parse_args()
    env = xtrain.init(cpu_devices=int(os.environ.get("WORLD_SIZE", "1")))  # one device per process
    import jax

    model = bench_common.build_model(args)
    step = xtrain.compile(model, xtrain.Mesh(data=-1), lowering=args.lowering,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01),
                          plan={"auto": "auto", "fsdp": xtrain.Plan(zero=3)}.get(args.plan),
                          detect_nan=not args.no_guards, check_inputs=not args.no_guards,
                          scan_layers={"auto": "auto", "scan": True, "unrolled": False}[args.scan_layers])
    losses, seconds = bench_common.timed_loop(lambda x, y: step(x, y)["loss"], bench_common.batches(args),
                                              args.warmup)
    extra = {}
    if args.report:  # every process compiles it (one multi-process program); rank 0 reports
        rep = step.report()
        extra = dict(wire_bytes=sum(c.wire_bytes for c in rep.collectives), collectives=len(rep.collectives),
                     device_memory=rep.memory.get("arguments", 0) + rep.memory.get("temporaries", 0))
    if args.profile_split:  # rank 0's thunks, 3 more steps on the last batches
        import profile_split

        tail = bench_common.batches(args)[-3:]

        def run(n):
            for x, y in tail[:n]:
                float(step(x, y)["loss"])

        extra["split_ms"] = profile_split.split(run, step.compiled(*tail[0]).as_text(), len(tail))
    if args.plan == "auto":
        extra["pick"] = step.search.best.candidate.name
    if env.process_id == 0:
        bench_common.emit("xtrain", losses, seconds, processes=env.num_processes, devices=jax.device_count(),
                          core=CORE, lowering=args.lowering, guards=not args.no_guards, **extra)


if __name__ == "__main__":
    main()
