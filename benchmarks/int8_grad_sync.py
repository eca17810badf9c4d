"""Does int8 gradient sync train like fp32? The example GPT, 300 steps, both ways.

    python benchmarks/int8_grad_sync.py                 # 8 emulated CPU devices, ~5 min on 2 cores
    python benchmarks/int8_grad_sync.py --steps 5       # a smoke run (writes nothing)

Trains the example's GPT (examples/gpt_model.py, its default size) on the example's corpus
and batch stream twice from the same weights: gradients all-reduced in fp32, and with
`GradSync(comm_dtype="int8")` (int8 all-to-all + fp32 sums + int8 all-gather, error feedback).
Reports the losses (mean of the last 20 steps, and the eval loss on held-out text), their
relative difference (the acceptance bar: within 2%) and the gradient-sync wire bytes per
device per step from `step.report()`. Writes benchmarks/results/int8_grad_sync.md (and .json
with every step's loss) for runs of 100 steps or more.
"""
from __future__ import annotations

import bench_common  # noqa: E402 - benchmarks/ (it puts examples/ on the path)
import xtrain  # noqa: E402
from gpt_model import default_corpus, split_corpus  # noqa: E402

BAR = 0.02  # the int8 run's loss within 2% of fp32's


def run(args, comm_dtype: str | None, train_tokens, val_tokens) -> dict:
    result, step = bench_common.long_run(args, train_tokens, val_tokens, grad_sync=xtrain.GradSync(comm_dtype=comm_dtype))
    wire = sum(c.wire_bytes for c in step.report().collectives if "xtrain.grad_sync" in c.source)
    return {"comm_dtype": comm_dtype or "float32", **result, "grad_wire_bytes": wire}


def table(runs: list[dict], args) -> str:
    fp32, int8 = runs
    rel = lambda k: abs(int8[k] - fp32[k]) / fp32[k]
    lines = [f"# int8 gradient sync vs fp32: example GPT (d_model {args.d_model}, {args.layers} layers), "
             f"{args.steps} steps, batch {args.batch} x {args.seq}, 8 emulated CPU devices, data=8", "",
             "| sync | loss, last 20 steps | eval loss | grad-sync wire B/device/step | wall s |", "|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['comm_dtype']} | {r['tail_loss']:.4f} | {r['eval_loss']:.4f} | {r['grad_wire_bytes']:.0f} "
                     f"| {r['seconds']:.0f} |")
    lines += ["", f"int8 / fp32: loss {rel('tail_loss'):.2%} apart, eval loss {rel('eval_loss'):.2%} apart "
              f"(bar: {BAR:.0%}); wire bytes {int8['grad_wire_bytes'] / fp32['grad_wire_bytes']:.3f}x",
              f"verdict: {'PASS' if max(rel('tail_loss'), rel('eval_loss')) <= BAR else 'FAIL'}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = bench_common.long_run_args(__doc__.splitlines()[0])
    args = p.parse_args()
    xtrain.init(cpu_devices=8)
    train_tokens, val_tokens = split_corpus(default_corpus())
    runs = [run(args, dtype, train_tokens, val_tokens) for dtype in (None, "int8")]
    bench_common.save_long_run("int8_grad_sync", table(runs, args), args, runs)


if __name__ == "__main__":
    main()
