"""Does an FP8 plan train like bf16? The example GPT, 300 steps, under Plan(precision="bf16") and "fp8".

    python benchmarks/fp8_training.py                 # 8 emulated CPU devices, ~4 min on 2 cores
    python benchmarks/fp8_training.py --steps 5       # a smoke run (writes nothing)
    python benchmarks/fp8_training.py --zero3         # ZeRO-3: bf16 vs FP8 gathers + int8 gradients
    python benchmarks/fp8_training.py --seeds 0,1,2   # each plan from 3 seeds: the run-to-run spread

Trains the example's GPT (examples/gpt_model.py) on the example's corpus and batch stream from the
same weights under each plan (data=8). FP8 (xtrain.lowering.fp8: e4m3 operands, e5m2 gradients,
per-tensor scaling, current and delayed: Precision(compute="fp8", scaling="delayed"), the scales
from a 16-step amax history; and rowwise, a scale per row) is computed on CPU by upcasting the FP8 values, so these are the
recipe's numerics, not an FP8 GEMM's speed (benchmarks/results/gpu_step_h200.md has that).
Reports the mean loss of the last 20 steps and the eval loss on held-out text, their relative
difference (the bar: within 2%), and writes benchmarks/results/fp8_training.md (and .json with
every step's loss) for runs of 100 steps or more.

--zero3 compares Plan(zero=3, precision="bf16") with Plan(zero=3, precision="fp8") and
GradSync(comm_dtype="int8"): weights gathered as e4m3 and gradients reduce-scattered in int8 with
error feedback (xtrain.lowering.zero3_int8), beside the bytes each step gathers and reduces per
device (the report's collectives); writes benchmarks/results/fp8_training_zero3.md.
"""
from __future__ import annotations

import bench_common  # noqa: E402 - benchmarks/ (it puts examples/ on the path)
import xtrain  # noqa: E402
from gpt_model import default_corpus, split_corpus  # noqa: E402

BAR = 0.02


PRECISIONS = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8",
              "fp8 delayed": xtrain.Precision(compute="fp8", scaling="delayed"),
              "fp8 rowwise": xtrain.Precision(compute="fp8", scaling="rowwise")}


def run(args, precision: str, train_tokens, val_tokens) -> dict:
    result, _ = bench_common.long_run(args, train_tokens, val_tokens, plan=xtrain.Plan(precision=PRECISIONS[precision]))
    return {"precision": precision, **result}


def table(runs: dict, args) -> str:
    lines = [f"# FP8 vs bf16 plans: example GPT (d_model {args.d_model}, {args.layers} layers), {args.steps} steps, "
             f"batch {args.batch} x {args.seq}, 8 emulated CPU devices, data=8", "",
             "| precision | loss, last 20 steps | eval loss | wall s |", "|---|---|---|---|"]
    lines += [f"| {r['precision']} | {r['tail_loss']:.4f} | {r['eval_loss']:.4f} | {r['seconds']:.0f} |"
              for r in runs.values()]
    lines += ["", *bench_common.verdict_lines("fp8 / bf16", (runs["bf16"], runs["fp8"]), BAR),
              *bench_common.verdict_lines("fp8 delayed / bf16", (runs["bf16"], runs["fp8 delayed"]), BAR),
              *bench_common.verdict_lines("fp8 rowwise / bf16", (runs["bf16"], runs["fp8 rowwise"]), BAR)]
    return "\n".join(lines) + "\n"


ZERO3 = {"bf16": dict(plan=xtrain.Plan(zero=3, precision="bf16")),
         "fp8 + int8": dict(plan=xtrain.Plan(zero=3, precision="fp8"), grad_sync=xtrain.GradSync(comm_dtype="int8"))}


def run_zero3(args, name: str, train_tokens, val_tokens) -> dict:
    result, step = bench_common.long_run(args, train_tokens, val_tokens, **ZERO3[name])
    moved = {}
    for c in step.report().collectives:
        kind = "gathered" if c.kind == "all-gather" else "reduced"
        moved[kind] = moved.get(kind, 0) + c.payload_bytes
    return {"plan": name, **result, **moved}


def table_zero3(runs: dict, args) -> str:
    lines = [f"# ZeRO-3: FP8 gathers and int8 gradients vs bf16: example GPT (d_model {args.d_model}, {args.layers} "
             f"layers), {args.steps} steps, batch {args.batch} x {args.seq}, 8 emulated CPU devices, data=8", "",
             "| plan | loss, last 20 steps | eval loss | gathered B/step | reduced B/step | wall s |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['plan']} | {r['tail_loss']:.4f} | {r['eval_loss']:.4f} | {r['gathered']:,} | {r['reduced']:,} "
              f"| {r['seconds']:.0f} |" for r in runs.values()]
    bf16, low = runs["bf16"], runs["fp8 + int8"]
    lines += ["", f"bytes per device per step, fp8 + int8 / bf16: gathered {low['gathered'] / bf16['gathered']:.2f}x, "
                  f"reduced {low['reduced'] / bf16['reduced']:.2f}x (the embeddings and norms stay float32)",
              *bench_common.verdict_lines("fp8 + int8 / bf16", (bf16, low), BAR)]
    return "\n".join(lines) + "\n"


def table_seeds(runs: dict, args) -> str:
    """Per plan and seed, the relative difference from bf16 of the same seed (+: higher loss), and
    their mean: one seed's difference is within the spread of the runs (fp32 vs bf16 shows it)."""
    seeds = sorted({seed for _, seed in runs})
    lines = [f"# FP8 vs bf16 over seeds {seeds}: example GPT (d_model {args.d_model}, {args.layers} layers), "
             f"{args.steps} steps, batch {args.batch} x {args.seq}, 8 emulated CPU devices, data=8", "",
             "Relative difference of the last 20 steps' loss / the eval loss from bf16's of the same seed "
             "(+: higher than bf16).", "",
             "| precision | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    rel = lambda name, seed, k: runs[(name, seed)][k] / runs[("bf16", seed)][k] - 1
    verdicts = []
    for name in (n for n in PRECISIONS if n != "bf16"):
        cells = [f"{rel(name, s, 'tail_loss'):+.2%} / {rel(name, s, 'eval_loss'):+.2%}" for s in seeds]
        means = [sum(rel(name, s, k) for s in seeds) / len(seeds) for k in ("tail_loss", "eval_loss")]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {means[0]:+.2%} / {means[1]:+.2%} |")
        if name != "fp32":
            verdicts.append(f"{name}: mean {means[0]:+.2%} / {means[1]:+.2%} from bf16: "
                            f"{'PASS' if max(map(abs, means)) <= BAR else 'FAIL'} (bar: {BAR:.0%})")
    return "\n".join(lines + [""] + verdicts) + "\n"


def main() -> None:
    p = bench_common.long_run_args(__doc__.splitlines()[0])
    p.add_argument("--zero3", action="store_true", help="ZeRO-3: bf16 vs FP8 gathers with int8 gradient sync")
    p.add_argument("--seeds", help="comma-separated seeds: every plan from each (writes fp8_training_seeds.md)")
    args = p.parse_args()
    xtrain.init(cpu_devices=8)
    train_tokens, val_tokens = split_corpus(default_corpus())
    if args.seeds:
        runs = {}
        for seed in (int(s) for s in args.seeds.split(",")):
            args.seed = seed
            runs.update({(name, seed): run(args, name, train_tokens, val_tokens) for name in PRECISIONS})
        args.seed = None
        bench_common.save_long_run("fp8_training_seeds", table_seeds(runs, args), args,
                                   {f"{name} seed {seed}": r for (name, seed), r in runs.items()})
        return
    if args.zero3:
        runs = {name: run_zero3(args, name, train_tokens, val_tokens) for name in ZERO3}
        bench_common.save_long_run("fp8_training_zero3", table_zero3(runs, args), args, runs)
        return
    runs = {precision: run(args, precision, train_tokens, val_tokens) for precision in PRECISIONS}
    bench_common.save_long_run("fp8_training", table(runs, args), args, runs)


if __name__ == "__main__":
    main()
