"""Pipeline schedules on the emulated CPU mesh: step time and memory beside each schedule's
bubble, and pipeline vs pure data parallel on the same model. One command, one process,
8 emulated CPU devices.

    python benchmarks/pipeline.py                          # ~5-10 minutes on 2 busy cores
    python benchmarks/pipeline.py --steps 5 --layers 8 --microbatches 8

Per configuration:
  ticks, bubble   from the schedule table (idle share of (tick, stage) slots)
  step            median wall time of step(x, y) after --warmup untimed steps; configurations
                  take turns step by step (rounds), so a busy machine slows all alike
  per tick        step / ticks: what one lockstep tick really costs. A GPipe tick runs a
                  forward or a backward; a 1F1B / interleaved tick runs a forward and a
                  backward (one vjp) on every stage, masked where the table says idle or the
                  other kind, so it costs about F + B (plus the recompute of the forward); a
                  zbh1 tick runs one F, B or W per stage (lax.switch), nothing masked; a zbv
                  tick the same on half a stage (two chunks per stage, laid out as a V)
  matmul GFLOP    per device and step, from the traced program (the busiest stage's ticks for
                  zbh1, whose branches run one at a time), masked and recomputed work included
  temporaries     XLA's compiled memory analysis, per device
Emulated devices share the host's cores, so step times add up the work of all 8 devices:
they measure total work (bubble ticks included, as every device executes them), not the
overlap a real pipeline would get. Writes benchmarks/results/pipeline.md.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import datetime  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
sys.path.insert(0, str(HERE.parent))
RESULTS = HERE / "results" / "pipeline.md"


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--only", default="", help="comma-separated configuration labels to run (default: all)")
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


def configs(m: int):
    """(label, mesh, pipeline kwargs or None for pure data parallel)."""
    out = [("data parallel", dict(data=8), None)]
    for pipe in (2, 4):
        for schedule in ("gpipe", "1f1b", "interleaved", "zbh1", "zbv"):
            kwargs = dict(stages=pipe, microbatches=m, schedule=schedule)
            if schedule == "interleaved":
                kwargs["virtual_stages"] = 2
            out.append((f"pipe={pipe} {schedule}", dict(pipe=pipe, data=8 // pipe), kwargs))
    return out


def build(args, mesh, pipeline, batches):
    """(step, first-step seconds incl. compilation, per-device memory analysis)."""
    import torch

    import xtrain
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq=args.seq, layers=args.layers, d_model=args.d_model, heads=4))
    plan = xtrain.Plan() if pipeline is None else xtrain.Plan().with_pipeline(**pipeline)
    step = xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          plan=plan)
    start = time.perf_counter()
    step(*batches[0])
    return step, time.perf_counter() - start, step.compiled(*batches[0]).memory_analysis()


def matmul_flops(step, pipeline) -> float:
    """Matmul FLOPs one device runs per step (the busiest stage for a zero-bubble schedule)."""
    from xtrain.ir.analysis import flops
    from xtrain.lowering.pipeline import zero_bubble

    if pipeline is not None and step.built.table.split_backward:
        return max(zero_bubble.stage_matmul_flops(step.program(), step.built.table))
    return flops.count(step.program()).matmul


def main(argv=None):
    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    import numpy as np

    import xtrain
    from gpt_model import default_corpus, sample_batch, split_corpus

    xtrain.init(cpu_devices=8)
    tokens, _ = split_corpus(default_corpus())
    rng = np.random.default_rng(0)
    batches = [sample_batch(tokens, rng, args.batch, args.seq) for _ in range(1 + args.warmup + args.steps)]
    only = [x.strip() for x in args.only.split(",") if x.strip()]
    chosen = [c for c in configs(args.microbatches) if not only or c[0] in only]
    built = [(label, pipeline, *build(args, mesh, pipeline, batches)) for label, mesh, pipeline in chosen]
    # rounds: every configuration steps once per round, so load from other processes on a
    # shared machine falls on all of them alike
    seconds = {label: [] for label, *_ in built}
    losses = {}
    for r, b in enumerate(batches[1:]):
        for label, _, step, _, _ in built:
            start = time.perf_counter()
            losses[label] = step(*b)["loss"]
            if r >= args.warmup:
                seconds[label].append(time.perf_counter() - start)
    rows = []
    for label, pipeline, step, compile_s, memory in built:
        table = None if pipeline is None else step.built.table
        r = dict(step_ms=1e3 * statistics.median(seconds[label]), compile_s=compile_s, temp=memory.temp_size_in_bytes,
                 args=memory.argument_size_in_bytes, ticks=1 if table is None else len(table.ticks),
                 bubble=0.0 if table is None else table.bubble(), loss=losses[label],
                 gflop=matmul_flops(step, pipeline) / 1e9)
        rows.append((label, r))
        print(f"{label:24s} step {r['step_ms']:8.1f} ms  ticks {r['ticks']:3d}  bubble {r['bubble']:6.1%}  "
              f"per tick {r['step_ms'] / r['ticks']:7.1f} ms  temporaries {r['temp'] / 2**20:7.2f} MiB  "
              f"arguments {r['args'] / 2**20:6.2f} MiB  matmul {r['gflop']:.3f} GFLOP  loss {r['loss']:.4f}  "
              f"(first step {r['compile_s']:.0f} s)",
              flush=True)
    write(args, rows)


def write(args, rows):
    lines = [f"# Pipeline schedules on 8 emulated CPU devices ({datetime.date.today()})", "",
             f"`python benchmarks/pipeline.py {' '.join(args.argv)}`".replace(" `", "`"), "",
             f"GPT (examples/gpt_model.py): {args.layers} layers, d_model {args.d_model}, seq {args.seq}, "
             f"global batch {args.batch}, {args.microbatches} microbatches, SGD; median of {args.steps} steps.",
             "Emulated devices share the host's cores: a step's time is the work of all 8 devices (bubble "
             "ticks included), not a real pipeline's overlap. Configurations take turns step by step.", "",
             "| configuration | step ms | ticks | bubble | ms per tick | matmul GFLOP per device | temporaries MiB | "
             "arguments MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for label, r in rows:
        lines.append(f"| {label} | {r['step_ms']:.1f} | {r['ticks']} | {r['bubble']:.1%} | "
                     f"{r['step_ms'] / r['ticks']:.1f} | {r['gflop']:.3f} | {r['temp'] / 2**20:.2f} | "
                     f"{r['args'] / 2**20:.2f} |")
    by = dict(rows)
    for pipe in (2, 4):
        for name in ("zbh1", "zbv"):
            zero, gpipe = by.get(f"pipe={pipe} {name}"), by.get(f"pipe={pipe} gpipe")
            if zero and gpipe:
                lines.append(f"\npipe={pipe}: {name} / GPipe step time {zero['step_ms'] / gpipe['step_ms']:.2f}, matmul "
                             f"FLOPs {zero['gflop'] / gpipe['gflop']:.2f}, temporaries {zero['temp'] / gpipe['temp']:.2f}")
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
