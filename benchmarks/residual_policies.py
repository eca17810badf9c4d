"""The layer scan's residual policies on CPU: what the backward pass keeps from the forward.

    python benchmarks/residual_policies.py                      # 12 layers, 5 rounds, ~4 min
    python benchmarks/residual_policies.py --layers 24 --rounds 3

The example GPT trained by xtrain (explicit lowering, layer scan) on 1 process x 1 CPU device,
pinned to one core with ddp_vs_xtrain.py's allocator settings, once per `Plan(remat=...)`:
  off            everything the backward reads is kept (stacked per layer by the scan)
  dots           xtrain's "dots": matmul outputs kept, the rest recomputed
  dots_saveable  jax.checkpoint_policies.dots_saveable
  dots_no_batch  jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  full           only each layer's input kept, the layer recomputed in the backward pass
All steps are compiled first, then timed in interleaved rounds (median step per round, median of
the rounds). Writes benchmarks/results/residual_policies.md.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import statistics
import sys
import time

import ddp_vs_xtrain as dvx

RESULTS = dvx.HERE / "results" / "residual_policies.md"
POLICIES = ("off", "dots", "dots_saveable", "dots_no_batch", "full")


def _setting(name: str):
    import jax

    return {"dots_saveable": jax.checkpoint_policies.dots_saveable,
            "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}.get(name, name)


def _compile(args, name: str):
    import torch

    import bench_common
    import xtrain

    torch.manual_seed(args.seed)
    model = bench_common.build_model(args)
    return xtrain.compile(model, xtrain.Mesh(data=-1), optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr),
                          plan=xtrain.Plan(remat=_setting(name)), scan_layers=True)


def _timed(step, batches) -> float:
    times = []
    for x, y in batches:
        start = time.perf_counter()
        float(step(x, y)["loss"])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(args, rounds: int) -> tuple[dict, dict]:
    import bench_common
    import xtrain

    xtrain.init(cpu_devices=1)
    batches = bench_common.batches(args)
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    steps, first = {}, {}
    for name in POLICIES:
        steps[name] = _compile(args, name)
        start = time.perf_counter()
        for x, y in warm:
            float(steps[name](x, y)["loss"])
        first[name] = time.perf_counter() - start
    medians = {name: [] for name in POLICIES}
    for _ in range(rounds):
        for name, step in steps.items():
            medians[name].append(_timed(step, timed))
    return medians, first


def report(args, rounds: int, medians: dict, first: dict) -> str:
    base = statistics.median(medians["off"])
    lines = [f"# Layer-scan residual policies (example GPT, {args.layers} layers, d_model {args.d_model}, "
             f"batch {args.batch} x {args.seq}, AdamW, fp32, 1 process x 1 CPU device)", "",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; machine: {dvx.machine()}; "
             f"1-min load average {os.getloadavg()[0]:.2f} at the end",
             f"- software: {dvx.versions()}", "- allocator: what xtrain.init sets on CPU (xtrain.runtime.allocator)",
             f"- method: all steps compiled first, then {rounds} interleaved rounds of {args.steps} timed steps; "
             f"median of the round medians",
             f"- command: python benchmarks/residual_policies.py {' '.join(sys.argv[1:])}".rstrip(), "",
             "| remat | median step (ms) | round medians (ms) | / off | warm-up steps (s) |",
             "|---|---:|---|---:|---:|"]
    for name in POLICIES:
        med = statistics.median(medians[name])
        rounds_ms = ", ".join(f"{m:.0f}" for m in medians[name])
        lines.append(f"| {name} | {med:.1f} | {rounds_ms} | {med / base:.2f} | {first[name]:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if dvx.XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
        env = {**os.environ, "XLA_FLAGS": dvx.XLA_FLAGS}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)  # XLA reads its flags at start
    import bench_common

    argv = sys.argv[1:]
    rounds = 5
    if "--rounds" in argv:
        at = argv.index("--rounds")
        rounds = int(argv[at + 1])
        del argv[at:at + 2]
    args = bench_common.parse_args(["--layers", "12", "--steps", "6", "--warmup", "3", *argv])
    bench_common.pin_to_core()
    medians, first = measure(args, rounds)
    text = report(args, rounds, medians, first)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    main()
