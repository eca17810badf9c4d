"""xtrain vs PyTorch DDP vs single-process torch eager: step time of the example GPT, one command.

    python benchmarks/ddp_vs_xtrain.py                 # ~4-5 minutes on 2 cores
    python benchmarks/ddp_vs_xtrain.py --rounds 5 --steps 50
    python benchmarks/ddp_vs_xtrain.py --lowerings explicit --guards-cost   # + the step without its guards

Runs, on the same model (examples/gpt_model.py), initial weights and global batches:
  xtrain  torchrun, 2 processes x 1 CPU device, data parallel (each xtrain lowering asked for)
  xtrain  1 process x 1 CPU device (compute alone: compare with eager)
  xtrain  with --guards-cost: the first lowering again without detect_nan and the input checks
  DDP     torchrun, 2 processes, gloo
  eager   1 process, plain torch
Every process is pinned to one core (the hardware each gets, not a framework setting): torch's
OpenMP pool and XLA's thread pools are sized by the schedulable CPUs, so each computes on one
thread (the only thread flag this XLA knows, --xla_cpu_multi_thread_eigen=false, is set for the
xtrain and jax.jit processes too: the affinity alone still left four busy XLA threads).

Each framework runs as its users run it. torch gets no environment of ours: glibc's malloc at its
defaults (torchrun sets OMP_NUM_THREADS=1 itself for its workers). xtrain gets only what xtrain sets
itself: on CPU, `xtrain.init` keeps freed memory for reuse through mallopt (xtrain.runtime.allocator).
`--allocator own,defaults` also runs every xtrain configuration with that turned off
(XTRAIN_CPU_MALLOC=default: every process at glibc's defaults), interleaved with the others, and
gives the ratios both ways (torch runs the same in both: at its defaults). Each worker reads back
the allocator settings and thread count it ran with, and the file prints those, not what the
driver meant to set.

Runs are interleaved over rounds (rotating order), the first --warmup steps of each run
(compilation) are not timed, and the figure is the median step time over all timed steps.
Prints a markdown table and writes it to benchmarks/results/ddp_vs_xtrain.md (or --out).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "ddp_vs_xtrain.md"
XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
PINNING = ("each process pinned to one core (sched_setaffinity; torch's OpenMP pool follows it); "
           f"XLA processes: XLA_FLAGS={XLA_FLAGS} + the one-core affinity (XLA sizes its pools by schedulable CPUs)")
MODEL_NAMES = {"gpt": "examples/gpt_model.py", "llama": "HF LlamaForCausalLM (SwiGLU, 2 kv heads)"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One configuration of the comparison.

    Attributes:
        key: short name used in the ratios ("xtrain-xla", "ddp", "eager").
        label: how the table names it.
        launch: how it is launched, in words.
        worker: the worker script in benchmarks/.
        processes: processes started (1 = plain python, else torchrun).
        extra: extra worker arguments.
        allocator: "own" (what the framework sets itself) or "defaults" (XTRAIN_CPU_MALLOC=default).
    """

    key: str
    label: str
    launch: str
    worker: str
    processes: int
    extra: tuple[str, ...] = ()
    allocator: str = "own"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each runs every configuration once)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per run (compilation)")
    p.add_argument("--nproc", type=int, default=2, help="processes of the data-parallel runs")
    p.add_argument("--lowerings", default="explicit,xla",
                   help="xtrain lowerings to run, comma separated (the first also runs in 1 process)")
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--guards-cost", action="store_true",
                   help="also run the first lowering with detect_nan=False, check_inputs=False (their cost)")
    p.add_argument("--fsdp", action="store_true",
                   help="also xtrain ZeRO-3 (Plan(zero=3)) beside PyTorch FSDP2 (fully_shard per block), N processes")
    p.add_argument("--profile-split", action="store_true",
                   help="xtrain runs also report where their step time goes (benchmarks/profile_split.py)")
    p.add_argument("--no-jit", action="store_true",
                   help="leave out the plain jax.jit row (about 7 s a step at 24 layers)")
    p.add_argument("--model", default="gpt", choices=("gpt", "llama"),
                   help="gpt: examples/gpt_model.py; llama: HF LlamaForCausalLM of the same width")
    p.add_argument("--allocator", default="own",
                   help="comma separated, xtrain's runs: own (what xtrain.init sets itself), defaults "
                        "(XTRAIN_CPU_MALLOC=default: glibc's defaults, as torch always runs); both: own,defaults")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS, help="markdown file to write")
    args = p.parse_args(argv)
    args.allocators = args.allocator.split(",")
    if not args.allocators or set(args.allocators) - {"own", "defaults"}:
        p.error(f"--allocator {args.allocator}: a comma-separated list of own, defaults")
    args.model_args = ("--model", args.model)
    args.xtrain_args = ("--profile-split",) if args.profile_split else ()
    return args


def runs(args) -> list[Run]:
    out = [with_allocator(run, mode) for mode in args.allocators for run in xtrain_runs(args)]
    out.extend(torch_runs(args))
    return out


def with_allocator(run: Run, mode: str) -> Run:
    """`run` under allocator `mode`: the key and label say so when it is not xtrain's own."""
    if mode == "own":
        return run
    return dataclasses.replace(run, key=f"{run.key}@defaults", label=f"{run.label}, glibc defaults",
                               allocator=mode)


def xtrain_runs(args) -> list[Run]:
    n = args.nproc
    out = [Run(key=f"xtrain-{lw}", label=f"xtrain (lowering={lw})", launch=f"torchrun, {n} processes x 1 CPU device",
               worker="bench_xtrain.py", processes=n, extra=("--lowering", lw))
           for lw in args.lowerings.split(",")]
    # The same program on one device of one process: compute alone, no communication.
    first = args.lowerings.split(",")[0]
    out.append(Run(key="xtrain-1proc", label=f"xtrain (lowering={first})", launch="1 process x 1 CPU device",
                   worker="bench_xtrain.py", processes=1, extra=("--lowering", first)))
    if args.guards_cost:
        out.append(Run(key="unguarded", label=f"xtrain (lowering={first}), no detect_nan / input checks",
                       launch=f"torchrun, {n} processes x 1 CPU device", worker="bench_xtrain.py", processes=n,
                       extra=("--lowering", first, "--no-guards")))
    if args.fsdp:
        out.append(Run(key="xtrain-fsdp", label="xtrain ZeRO-3 (Plan(zero=3))", launch=f"torchrun, {n} processes x 1 CPU device",
                       worker="bench_xtrain.py", processes=n, extra=("--lowering", first, "--plan", "fsdp")))
    return out


def torch_runs(args) -> list[Run]:
    n = args.nproc
    out = []
    if args.fsdp:
        out.append(Run(key="fsdp2", label="PyTorch FSDP2 (gloo)", launch=f"torchrun, {n} processes",
                       worker="bench_fsdp.py", processes=n))
    if not args.no_jit:
        out.append(Run(key="jit", label="plain jax.jit of the traced model (no xtrain lowering)", launch="1 process",
                       worker="bench_jit.py", processes=1))
    out.append(Run(key="ddp", label="PyTorch DDP (gloo)", launch=f"torchrun, {n} processes",
                   worker="bench_ddp.py", processes=n))
    out.append(Run(key="eager", label="torch eager", launch="1 process", worker="bench_eager.py", processes=1))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(*, xla: bool = True, allocator: str = "own") -> dict[str, str]:
    """The environment of a run: the caller's, without launcher variables, malloc or thread
    variables of the caller's shell; XLA's thread flag for the processes that run XLA."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "JAX_NUM_CPU_DEVICES")}
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env.update(JAX_PLATFORMS="cpu", XTRAIN_COORDINATOR_PORT=str(free_port()))
    if xla:
        env.update(XLA_FLAGS=XLA_FLAGS)
    if allocator == "defaults":
        env.update(XTRAIN_CPU_MALLOC="default")
    return env


def check_xla_flags() -> None:
    """XLA aborts on an unknown XLA_FLAGS entry; fail here with a clear message instead."""
    proc = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=child_env(),
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"this XLA rejects XLA_FLAGS={XLA_FLAGS!r}:\n{proc.stderr[-2000:]}")


def command(run: Run, args) -> list[str]:
    worker = [str(HERE / run.worker), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--batch", str(args.batch), "--seq", str(args.seq), "--layers", str(args.layers),
              "--d-model", str(args.d_model), *run.extra, *getattr(args, "model_args", ()),
              *(getattr(args, "xtrain_args", ()) if run.worker == "bench_xtrain.py" else ())]
    if run.processes == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={run.processes}",
            "--master_addr=127.0.0.1", f"--master_port={free_port()}", *worker]


def launch(run: Run, args) -> dict:
    """Runs one configuration; returns the worker's result record."""
    xla = run.worker in ("bench_xtrain.py", "bench_jit.py")
    proc = subprocess.run(command(run, args), env=child_env(xla=xla, allocator=run.allocator), capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{run.label} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def measure(all_runs: list[Run], args) -> dict[str, list[dict]]:
    """Every run once per round, the order rotated each round; key -> one record per round."""
    records: dict[str, list[dict]] = {r.key: [] for r in all_runs}
    for round_index in range(args.rounds):
        shift = round_index % len(all_runs)
        for run in all_runs[shift:] + all_runs[:shift]:
            record = launch(run, args)
            records[run.key].append(record)
            print(f"round {round_index + 1}/{args.rounds}  {run.label:26s} median "
                  f"{1e3 * statistics.median(record['step_s']):7.1f} ms/step", flush=True)
    return records


def median_ms(records: list[dict]) -> float:
    return 1e3 * statistics.median(s for r in records for s in r["step_s"])


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return f"{os.cpu_count()} CPUs (nproc), {cpu}, {platform.system()} {platform.release()}"


def versions() -> str:
    import jax
    import torch

    git = ["git", "-C", str(HERE)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    if subprocess.run([*git, "status", "--porcelain", "--", "../xtrain"], capture_output=True, text=True).stdout:
        commit += " with uncommitted changes to xtrain/"
    return f"python {platform.python_version()}, torch {torch.__version__}, jax {jax.__version__}, xtrain commit {commit or 'unknown'}"


def faults_per_step(recs: list[dict]) -> float:
    return statistics.median(r.get("faults_per_step") or 0 for r in recs)


def allocator_line(recs: list[dict]) -> str:
    seen = {json.dumps(r.get("allocator", {}), sort_keys=True) for r in recs}
    text = " | ".join(", ".join(f"{k}={v}" for k, v in json.loads(s).items()) or "glibc defaults" for s in sorted(seen))
    threads = {r["torch_threads"] for r in recs if "torch_threads" in r}
    return text + (f" (torch threads {', '.join(map(str, sorted(threads)))})" if threads else "")


def table(all_runs: list[Run], records: dict[str, list[dict]], args) -> list[str]:
    tokens = args.batch * args.seq
    lines = ["| run | launch | median step (ms) | round medians (ms) | tokens/s | loss first -> last |",
             "|---|---|---:|---|---:|---|"]
    for run in all_runs:
        recs = records[run.key]
        ms = median_ms(recs)
        rounds = ", ".join(f"{1e3 * statistics.median(r['step_s']):.0f}" for r in recs)
        loss = f"{recs[0]['first_loss']:.4f} -> {recs[0]['last_loss']:.4f}"
        lines.append(f"| {run.label} | {run.launch} | {ms:.1f} | {rounds} | {tokens / ms * 1e3:,.0f} | {loss} |")
    return lines


def ratios(all_runs: list[Run], records: dict[str, list[dict]]) -> list[str]:
    ms = {run.key: median_ms(records[run.key]) for run in all_runs}
    lines = ["| ratio of median step times | value |", "|---|---:|"]
    for suffix, how in (("", ""), ("@defaults", ", xtrain at glibc defaults")):
        if f"xtrain-1proc{suffix}" not in ms:
            continue
        if f"unguarded{suffix}" in ms:
            first = next(k for k in ms if k.startswith("xtrain") and k.endswith(suffix))
            lines.append(f"| {first} / the same without detect_nan and input checks (their cost){how} | "
                         f"{ms[first] / ms[f'unguarded{suffix}']:.3f} |")
        for key in (k for k in ms if k.startswith("xtrain") and k.endswith(suffix) and "@" not in k[:len(k) - len(suffix)]
                    and k.removesuffix(suffix) not in ("xtrain-1proc", "xtrain-fsdp")):
            lines.append(f"| {key.removesuffix(suffix)} / DDP{how} | {ms[key] / ms['ddp']:.2f} |")
            lines.append(f"| {key.removesuffix(suffix)} / eager{how} | {ms[key] / ms['eager']:.2f} |")
        if "fsdp2" in ms:
            lines.append(f"| xtrain ZeRO-3 / PyTorch FSDP2{how} | {ms[f'xtrain-fsdp{suffix}'] / ms['fsdp2']:.2f} |")
        lines.append(f"| xtrain 1 process / eager (compute only, same work){how} | "
                     f"{ms[f'xtrain-1proc{suffix}'] / ms['eager']:.2f} |")
        if "jit" in ms:
            lines.append(f"| xtrain 1 process / plain jax.jit (xtrain's lowering, same XLA){how} | "
                         f"{ms[f'xtrain-1proc{suffix}'] / ms['jit']:.2f} |")
    lines.append(f"| DDP / eager | {ms['ddp'] / ms['eager']:.2f} |")
    if "jit" in ms:
        lines.append(f"| plain jax.jit / eager (XLA CPU code vs torch kernels) | {ms['jit'] / ms['eager']:.2f} |")
    return lines


def splits(all_runs: list[Run], records: dict[str, list[dict]]) -> list[str]:
    """Where each xtrain run's step time goes (rank 0, median over rounds), if profiled."""
    rows = [(run, [r["split_ms"] for r in records[run.key] if "split_ms" in r]) for run in all_runs]
    rows = [(run, found) for run, found in rows if found]
    if not rows:
        return []
    classes = list(rows[0][1][0])
    lines = ["", "| profile split, ms per step (share) | launch | " + " | ".join(classes) + " |",
             "|---|---|" + "---:|" * len(classes)]
    for run, found in rows:
        ms = {c: statistics.median(f[c] for f in found) for c in classes}
        total = sum(ms.values()) or 1.0
        lines.append(f"| {run.label} | {run.launch} | " +
                     " | ".join(f"{ms[c]:.0f} ({ms[c] / total:.0%})" for c in classes) + " |")
    return lines


def report(all_runs: list[Run], records: dict[str, list[dict]], args, load: tuple[float, float]) -> str:
    head = [
        "# xtrain vs PyTorch DDP vs torch eager",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {machine()}; 1-min load average {load[0]:.2f} before, {load[1]:.2f} after",
        f"- software: {versions()}",
        f"- model: {MODEL_NAMES[args.model]}, {args.layers} layers, d_model {args.d_model}, vocab 256; "
        f"global batch {args.batch} x {args.seq} tokens; AdamW lr 1e-3; fp32",
        f"- threads: {PINNING}",
        f"- allocator (--allocator {args.allocator}), as each process read it back: "
        + "; ".join(f"{run.key}: {allocator_line(records[run.key])}" for run in all_runs),
        "- minor page faults per timed step (rank 0, getrusage, median over rounds): "
        + "; ".join(f"{run.key}: {faults_per_step(records[run.key]):,.0f}" for run in all_runs),
        f"- method: {args.rounds} interleaved rounds (order rotated), {args.warmup} untimed warm-up steps "
        f"per run, {args.steps} timed steps; median over all timed steps (wall time of step(x, y) "
        "including the host float of the loss, on rank 0)",
        "- losses: xtrain and eager train on the whole global batch from the same weights, so their "
        "losses agree; DDP's is rank 0's half of the batch",
        "- reading: the 1-process xtrain row is the compiled program alone (no communication) on the "
        "work eager does; a 2-process row minus half of it is roughly communication and rank skew; the plain "
        "jax.jit row is the same traced model compiled by XLA without xtrain (what XLA's CPU code costs)",
        f"- command: python benchmarks/ddp_vs_xtrain.py {' '.join(sys.argv[1:])}".rstrip(),
        "",
    ]
    return "\n".join(head + table(all_runs, records, args) + [""] + ratios(all_runs, records)
                     + splits(all_runs, records)) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    check_xla_flags()
    all_runs = runs(args)
    load_before = os.getloadavg()[0]
    records = measure(all_runs, args)
    text = report(all_runs, records, args, (load_before, os.getloadavg()[0]))
    print("\n" + text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
