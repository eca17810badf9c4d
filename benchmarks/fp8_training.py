"""Does an FP8 plan train like bf16? The example GPT, 300 steps, under Plan(precision="bf16") and "fp8".

    python benchmarks/fp8_training.py                 # 8 emulated CPU devices, ~4 min on 2 cores
    python benchmarks/fp8_training.py --steps 5       # a smoke run (writes nothing)

Trains the example's GPT (examples/gpt_model.py) on the example's corpus and batch stream from the
same weights under each plan (data=8). FP8 (xtrain.lowering.fp8: e4m3 operands, e5m2 gradients,
current per-tensor scaling) is computed on CPU by upcasting the FP8 values, so these are the
recipe's numerics, not an FP8 GEMM's speed (benchmarks/results/gpu_step_h200.md has that).
Reports the mean loss of the last 20 steps and the eval loss on held-out text, their relative
difference (the bar: within 2%), and writes benchmarks/results/fp8_training.md (and .json with
every step's loss) for runs of 100 steps or more.
"""
from __future__ import annotations

import bench_common  # noqa: E402 - benchmarks/ (it puts examples/ on the path)
import xtrain  # noqa: E402
from gpt_model import default_corpus, split_corpus  # noqa: E402

BAR = 0.02


def run(args, precision: str, train_tokens, val_tokens) -> dict:
    result, _ = bench_common.long_run(args, train_tokens, val_tokens, plan=xtrain.Plan(precision=precision))
    return {"precision": precision, **result}


def table(runs: dict, args) -> str:
    lines = [f"# FP8 vs bf16 plans: example GPT (d_model {args.d_model}, {args.layers} layers), {args.steps} steps, "
             f"batch {args.batch} x {args.seq}, 8 emulated CPU devices, data=8", "",
             "| precision | loss, last 20 steps | eval loss | wall s |", "|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['tail_loss']:.4f} | {r['eval_loss']:.4f} | {r['seconds']:.0f} |"
              for r in runs.values()]
    lines += ["", *bench_common.verdict_lines("fp8 / bf16", (runs["bf16"], runs["fp8"]), BAR)]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = bench_common.long_run_args(__doc__.splitlines()[0])
    args = p.parse_args()
    xtrain.init(cpu_devices=8)
    train_tokens, val_tokens = split_corpus(default_corpus())
    runs = {precision: run(args, precision, train_tokens, val_tokens) for precision in ("fp32", "bf16", "fp8")}
    bench_common.save_long_run("fp8_training", table(runs, args), args, runs)


if __name__ == "__main__":
    main()
