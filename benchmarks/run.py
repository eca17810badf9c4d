"""The benchmark suite, one command: xtrain side by side with PyTorch and JAX, and the cost model
checked against measurement. Writes benchmarks/results/benchmarks.md and benchmarks.png.

    python benchmarks/run.py                     # ~13 minutes on a quiet 2-core host
    python benchmarks/run.py --rounds 3 --steps 20 --models gpt-small

Per model (the example GPT at two sizes, HF Llama tiny), interleaved over --rounds rounds
(order rotated; ddp_vs_xtrain.py's launcher and pinning: one core and one compute thread per
process), median over every timed step:
  xtrain explicit   torchrun, 2 processes x 1 CPU device, data parallel
  xtrain plan=auto  the same, the plan chosen by the cost model
  xtrain xla        the same plan through XLA's SPMD partitioner (JAX's own partitioning)
  DDP               torch DistributedDataParallel, gloo, torchrun 2 processes
  FSDP2             torch fully_shard per block + root, gloo, torchrun 2 processes
  eager             plain torch, 1 process
Also: compile time (xtrain's first step), peak RSS per process, xtrain's per-device memory
(XLA's memory analysis) and wire bytes per step (step.report()), DDP's and FSDP2's wire bytes
from their algorithms (ring all-reduce of the gradients; all-gather twice + reduce-scatter).
Then benchmarks/cost_check.py: 13 candidate plans (3 pipelines) on 8 emulated devices, predicted vs measured
(Spearman), predicted FLOPs vs XLA's cost analysis. On a GPU or Trainium host the suite runs
benchmarks/accelerator_step.py instead (tokens/s and MFU there).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ddp_vs_xtrain as dvx  # noqa: E402  (launcher, pinning, machine and version lines)

RESULTS = HERE / "results"
MODELS = {  # name -> worker model arguments
    "gpt-small": ("--model", "gpt", "--layers", "2", "--d-model", "128", "--heads", "4"),
    "gpt-medium": ("--model", "gpt", "--layers", "4", "--d-model", "256", "--heads", "8"),
    "llama-tiny": ("--model", "llama", "--layers", "2", "--d-model", "128", "--heads", "4"),
}


@dataclasses.dataclass(frozen=True)
class Config:
    key: str
    label: str
    run: dvx.Run


def configs(nproc: int) -> list[Config]:
    x = lambda lw, plan="ddp": ("--lowering", lw, "--plan", plan)  # noqa: E731
    launch = f"torchrun, {nproc} processes x 1 CPU device"
    return [Config("xtrain", "xtrain explicit", dvx.Run(key="xtrain", label="xtrain explicit", launch=launch,
                                                          worker="bench_xtrain.py", processes=nproc,
                                                          extra=x("explicit"))),
            Config("auto", "xtrain plan=auto", dvx.Run(key="auto", label="xtrain plan=auto", launch=launch,
                                                       worker="bench_xtrain.py", processes=nproc,
                                                       extra=x("explicit", "auto"))),
            Config("xla", "JAX/XLA partitioner", dvx.Run(key="xla", label="xtrain lowering=xla", launch=launch,
                                                         worker="bench_xtrain.py", processes=nproc, extra=x("xla"))),
            Config("ddp", "PyTorch DDP", dvx.Run(key="ddp", label="PyTorch DDP (gloo)", launch=f"torchrun, {nproc} processes",
                                                 worker="bench_ddp.py", processes=nproc)),
            Config("fsdp2", "PyTorch FSDP2", dvx.Run(key="fsdp2", label="PyTorch FSDP2 (gloo)",
                                                     launch=f"torchrun, {nproc} processes", worker="bench_fsdp.py",
                                                     processes=nproc)),
            Config("eager", "torch eager", dvx.Run(key="eager", label="torch eager", launch="1 process",
                                                   worker="bench_eager.py", processes=1))]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median then outlasts one disturbed round")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--skip-cost-check", action="store_true")
    p.add_argument("--cost-steps", type=int, default=12, help="timed steps per plan in the cost check")
    p.add_argument("--cost-check-only", action="store_true",
                   help="rerun only the cost check; the side-by-side part comes from results/benchmarks.json")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    return p.parse_args(argv)


def worker_args(args, model: str, extra=()) -> argparse.Namespace:
    """What dvx.command reads, with this model's arguments appended to the worker's."""
    ns = argparse.Namespace(steps=args.steps, warmup=args.warmup, batch=args.batch, seq=args.seq,
                            layers=0, d_model=0)
    ns.model_args = MODELS[model] + tuple(extra)
    return ns


def launch(config: Config, args, model: str, report: bool) -> dict:
    extra = ("--report",) if report and config.run.worker == "bench_xtrain.py" else ()
    ns = worker_args(args, model, extra)
    cmd = dvx.command(config.run, ns)
    env = dvx.child_env(xla=config.run.worker in ("bench_xtrain.py", "bench_jit.py"))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def measure(args) -> dict[str, dict[str, list[dict]]]:
    """model -> config key -> one record per round."""
    runs = configs(args.nproc)
    out = {m: {c.key: [] for c in runs} for m in args.models}
    for r in range(args.rounds):
        for m in args.models:
            shift = r % len(runs)
            for c in runs[shift:] + runs[:shift]:
                rec = launch(c, args, m, report=(r == 0))
                out[m][c.key].append(rec)
                ms = f"{1e3 * statistics.median(rec['step_s']):.1f} ms" if "step_s" in rec else rec["error"][:200]
                print(f"round {r + 1}/{args.rounds} {m:11s} {c.label:22s} {ms}", flush=True)
    return out


def cost_check(args) -> dict:
    cmd = [sys.executable, str(HERE / "cost_check.py"), *MODELS["gpt-small"], "--batch", str(args.batch),
           "--seq", str(args.seq), "--steps", str(args.cost_steps), "--warmup", "1"]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    proc = subprocess.run(cmd, env={**env, "PYTHONPATH": str(HERE.parent)}, capture_output=True, text=True,
                          timeout=1200)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1][len("RESULT "):])


# -- analytic wire bytes of the torch baselines ------------------------------------------------
def param_bytes(model: str, args) -> int:
    import bench_common

    ns = bench_common.parse_args(list(MODELS[model]) + ["--seq", str(args.seq)])
    return 4 * sum(p.numel() for p in bench_common.build_model(ns).parameters())


def torch_wire_bytes(key: str, params: int, n: int) -> float | None:
    ring = (n - 1) / n
    return {"ddp": 2 * ring * params, "fsdp2": 3 * ring * params}.get(key)


# -- report ------------------------------------------------------------------------------------
def _median_ms(recs: list[dict]) -> float | None:
    steps = [s for r in recs if "step_s" in r for s in r["step_s"]]
    return 1e3 * statistics.median(steps) if steps else None


def _mib(n) -> str:
    return f"{n / 2**20:.1f}" if n else "-"


def model_table(model: str, recs: dict[str, list[dict]], args) -> list[str]:
    tokens = args.batch * args.seq
    params = param_bytes(model, args)
    eager = _median_ms(recs["eager"])
    lines = [f"### {model} ({' '.join(MODELS[model])}; {params / 4 / 1e6:.2f}M parameters)", "",
             "| run | median step (ms) | / eager | / DDP | tokens/s | first step (s) | peak RSS/process (MiB) "
             "| device memory (MiB) | wire bytes/step/device | note |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    ddp = _median_ms(recs["ddp"])
    for c in configs(args.nproc):
        rs = recs[c.key]
        ms = _median_ms(rs)
        if ms is None:
            lines.append(f"| {c.label} | failed | | | | | | | | {rs[0].get('error', '')[:150]} |")
            continue
        first = rs[0]
        wire = first.get("wire_bytes", torch_wire_bytes(c.key, params, args.nproc))
        wire_s = "-" if wire is None else f"{wire:,.0f}" + ("" if "wire_bytes" in first else " (algorithm)")
        note = f"pick: {first['pick']}" if "pick" in first else ""
        lines.append(f"| {c.label} | {ms:.1f} | {ms / eager:.2f} | {ms / ddp:.2f} | {tokens / ms * 1e3:,.0f} | "
                     f"{first.get('first_step_s') or 0:.1f} | {_mib(max(r.get('peak_rss_bytes', 0) for r in rs))} | "
                     f"{_mib(first.get('device_memory'))} | {wire_s} | {note} |")
    return lines + [""]


def cost_table(check: dict) -> list[str]:
    if "error" in check:
        return ["cost check failed: " + check["error"]]
    lines = [f"Profile: {check['profile']}", "",
             "| plan | predicted (ms) | measured (ms) | predicted compute / comm (ms) | predicted memory (MiB) "
             "| compile + first step (s) |", "|---|---:|---:|---|---:|---:|"]
    for r in check["rows"]:
        lines.append(f"| {r['plan']} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | {r['compute_ms']:.1f} / "
                     f"{r['comm_ms']:.1f} | {_mib(r['predicted_memory'])} | {r['compile_s']:.1f} |")
    ratio = check["flops_ours"] / check["flops_xla"]
    return lines + ["", f"- Spearman rank correlation, predicted vs measured step time over {len(check['rows'])} "
                        f"plans: **{check['spearman']:.2f}** (target >= 0.7); the model's pick: {check['pick']}",
                    f"- FLOPs per device per step (dp8, layers unrolled): cost model {check['flops_ours']:,.0f} "
                    f"(matmul {check['flops_ours_matmul']:,.0f}), XLA cost analysis {check['flops_xla']:,.0f}: "
                    f"ratio {ratio:.3f}"]


def chart(results: dict, check: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    keys = [c for c in configs(2) if c.key != "eager"]
    width = 0.8 / len(keys)
    for i, c in enumerate(keys):
        values = [(_median_ms(recs[c.key]) or 0) / _median_ms(recs["eager"]) for recs in results.values()]
        left.bar([j + i * width for j in range(len(results))], values, width, label=c.label)
    left.axhline(1.0, color="k", lw=0.8)
    left.set_xticks([j + 0.4 - width / 2 for j in range(len(results))], list(results))
    left.set_ylabel("median step time / torch eager (1 process)")
    left.set_title("2 processes x 1 core, data parallel")
    left.legend(fontsize=8)
    if "rows" in check:
        xs = [r["predicted_ms"] for r in check["rows"]]
        ys = [r["measured_ms"] for r in check["rows"]]
        right.scatter(xs, ys)
        for r in check["rows"]:
            right.annotate(r["plan"], (r["predicted_ms"], r["measured_ms"]), fontsize=7)
        right.set_xlabel("predicted step (ms)")
        right.set_ylabel("measured step (ms)")
        right.set_title(f"cost model, 8 emulated devices (Spearman {check['spearman']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results, check, args, load) -> str:
    head = ["# xtrain benchmark suite", "",
            f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
            f"- machine: {dvx.machine()}; 1-min load average {load[0]:.2f} before, {load[1]:.2f} after "
            "(a shared, slow host: other jobs ran during the measurement, so treat ratios as rough)",
            f"- software: {dvx.versions()}",
            f"- threads: {dvx.PINNING}",
            "- allocator, as each process read it back: " + "; ".join(
                f"{key}: {dvx.allocator_line(recs)}" for key, recs in next(iter(results.values())).items()
                if all("error" not in r for r in recs)),
            f"- method: {args.rounds} interleaved rounds (order rotated), {args.warmup} untimed warm-up steps per "
            f"run, {args.steps} timed steps; global batch {args.batch} x {args.seq} tokens; AdamW; fp32",
            "- columns: '/ eager' and '/ DDP' are ratios of median step times; 'first step' includes "
            "compilation for xtrain; 'device memory' is XLA's memory analysis (arguments + temporaries) of "
            "xtrain's step; wire bytes per device per step: xtrain from step.report() (explicit: counted "
            "on the emitted program; xla: read from XLA's HLO), torch from its algorithm",
            f"- command: python benchmarks/run.py {' '.join(sys.argv[1:])}".rstrip(), "", "## Side by side", ""]
    body = [line for m, recs in results.items() for line in model_table(m, recs, args)]
    cost = ["## Cost model on this machine's profile", ""] + cost_table(check)
    return "\n".join(head + body + cost) + "\n"


def accelerator(args) -> None:
    """On a GPU/Trainium host: accelerator_step.py's tokens/s and MFU (peaks: xtrain.cost.hardware)."""
    out = args.out / "accelerator_step.json"
    subprocess.run([sys.executable, str(HERE / "accelerator_step.py"), "--json", str(out)], check=True)
    print(f"written to {out}")


def main(argv=None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from xtrain.runtime import backends

    if backends.detect_backend() != "cpu":
        accelerator(args)
        return
    dvx.check_xla_flags()
    load = os.getloadavg()[0]
    raw = args.out / "benchmarks.json"
    if args.cost_check_only:
        saved = json.loads(raw.read_text())
        results, load = saved["side_by_side"], saved["load_before"]
        args = argparse.Namespace(**{**saved["args"], **{k: v for k, v in vars(args).items() if k.startswith("cost")},
                                     "out": args.out})
    else:
        results = measure(args)
    check = {"error": "skipped (--skip-cost-check)"} if args.skip_cost_check else cost_check(args)
    raw.write_text(json.dumps({"side_by_side": results, "cost_check": check, "load_before": load,
                               "args": {k: v for k, v in vars(args).items() if k != "out"}}, indent=1))
    text = report(results, check, args, (load, os.getloadavg()[0]))
    print("\n" + text)
    (args.out / "benchmarks.md").write_text(text)
    chart(results, check, args.out / "benchmarks.png")
    print(f"written to {args.out / 'benchmarks.md'} and {args.out / 'benchmarks.png'}")


if __name__ == "__main__":
    main()
