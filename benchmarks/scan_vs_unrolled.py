"""Layer scan vs unrolled blocks against depth: the measurement behind `scan_layers="auto"`.

    python benchmarks/scan_vs_unrolled.py                   # 4, 8, 12 layers, 3 rounds, ~15 min
    python benchmarks/scan_vs_unrolled.py --layers 8 12 24 --rounds 5

The example GPT trained by xtrain (explicit lowering) with compile(scan_layers=True) and
(scan_layers=False), on 1 process x 1 CPU device and on torchrun 2 processes x 1 device, with
ddp_vs_xtrain.py's pinning and allocator settings, interleaved rounds, median step time. Also
reports the first step (tracing and compilation). Writes benchmarks/results/scan_vs_unrolled.md.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import statistics
import sys

import ddp_vs_xtrain as dvx

RESULTS = dvx.HERE / "results" / "scan_vs_unrolled.md"


def runs(n: int) -> list[dvx.Run]:
    out = []
    for layout in ("scan", "unrolled"):
        for processes in (1, n):
            launch = "1 process x 1 CPU device" if processes == 1 else f"torchrun, {n} processes x 1 CPU device"
            out.append(dvx.Run(key=f"{layout}-{processes}", label=f"xtrain {layout}", launch=launch,
                               worker="bench_xtrain.py", processes=processes,
                               extra=("--lowering", "explicit", "--scan-layers", layout)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args()
    dvx.check_xla_flags()
    lines = ["| layers | launch | scan ms | unrolled ms | unrolled / scan | scan first step s | unrolled first step s |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for layers in args.layers:
        worker = argparse.Namespace(steps=args.steps, warmup=args.warmup, batch=32, seq=64, layers=layers,
                                    d_model=128, model_args=())
        all_runs = runs(args.nproc)
        records = dvx.measure(all_runs, argparse.Namespace(**vars(worker), rounds=args.rounds))
        for processes in (1, args.nproc):
            scan, unrolled = records[f"scan-{processes}"], records[f"unrolled-{processes}"]
            ms = [dvx.median_ms(scan), dvx.median_ms(unrolled)]
            first = [statistics.median(r["first_step_s"] for r in recs) for recs in (scan, unrolled)]
            lines.append(f"| {layers} | {all_runs[0 if processes == 1 else 1].launch} | {ms[0]:.1f} | {ms[1]:.1f} | "
                         f"{ms[1] / ms[0]:.2f} | {first[0]:.1f} | {first[1]:.1f} |")
    head = ["# Layer scan vs unrolled blocks (example GPT, d_model 128, batch 32 x 64, AdamW, fp32)", "",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; machine: {dvx.machine()}; "
            f"1-min load average {os.getloadavg()[0]:.2f} at the end",
            f"- software: {dvx.versions()}",
            f"- threads: {dvx.PINNING}", f"- allocator: {dvx.ALLOCATOR}",
            f"- method: {args.rounds} interleaved rounds, {args.warmup} warm-up + {args.steps} timed steps per run; "
            "median step; first step = tracing + compilation + one step",
            f"- command: python benchmarks/scan_vs_unrolled.py {' '.join(sys.argv[1:])}".rstrip(), ""]
    args.out.write_text("\n".join(head + lines) + "\n")
    print("\n".join(lines))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
