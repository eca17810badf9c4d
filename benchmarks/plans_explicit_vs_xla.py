"""Explicit lowering vs XLA's partitioner, per plan: collective bytes and count, per-device
memory, step time. One command, one process, 8 emulated CPU devices.

    python benchmarks/plans_explicit_vs_xla.py                  # ~3 minutes on 2 cores
    python benchmarks/plans_explicit_vs_xla.py --steps 30 --models gpt

For each model (a GPT-2-shaped GPT from examples/gpt_model.py and an HF Llama, both tiny) and
each plan (ddp, zero(1), zero(2), fsdp = zero(3), megatron TP2 x DP4, megatron + fsdp), both
lowerings train the same model on the same batches (the explicit one twice: its default
layer scan, and scan_layers=False, the layers one after another) and `step.report()` gives:
  bytes    wire bytes per device per step (ring algorithms), summed over collectives; for
           the explicit lowering counted on the emitted program, for XLA read from its
           optimized HLO (the CPU backend may merge several collectives into one)
  count    collectives per step (scan bodies count once per layer)
  memory   XLA's compiled memory analysis: arguments + temporaries per device
  step     median wall time of step(x, y) after --warmup untimed steps
Writes a markdown table to benchmarks/results/plans_explicit_vs_xla.md.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "examples"))
RESULTS = HERE / "results" / "plans_explicit_vs_xla.md"
PLANS = ("ddp", "zero1", "zero2", "fsdp", "megatron-tp2xdp4", "megatron+fsdp")
MODELS = ("gpt", "llama")


@dataclasses.dataclass(frozen=True)
class Measure:
    """One (model, plan, lowering) run."""

    wire_bytes: float
    count: int
    memory: int
    step_ms: float
    first_loss: float


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--plans", nargs="+", default=list(PLANS), choices=PLANS)
    p.add_argument("--out", default=str(RESULTS))
    return p.parse_args(argv)


# -- models and batches ----------------------------------------------------------------------
def gpt_model():
    from gpt_model import GPT, GPTConfig

    return GPT(GPTConfig(vocab=256, seq=64, layers=4, d_model=128, heads=4))


def llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0))


def lm_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def batches(n: int, batch: int, seq: int, model: str) -> list[tuple]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
        # examples' GPT: forward(idx, targets); HF shifts the labels itself
        out.append((ids[:, :-1], ids[:, 1:]) if model == "gpt" else (ids[:, :-1], ids[:, :-1]))
    return out


MODEL_DESCRIPTIONS = {
    "gpt": "examples/gpt_model.GPT (GPT-2 shape: learned positions, pre-LN, GELU MLP, tied head): "
           "4 layers, d_model 128, 4 heads, vocab 256",
    "llama": "HF LlamaForCausalLM: 4 layers, hidden 128, intermediate 256 (SwiGLU), 4 heads / 2 kv heads "
             "(GQA), vocab 256, untied head",
}


# -- plans -----------------------------------------------------------------------------------
def mesh_and_plan(name: str, model):
    import xtrain
    from xtrain import plans

    if name.startswith("megatron"):
        sizes = dict(data=4, tensor=2)
        plan = plans.megatron(model, sizes)
        if name == "megatron+fsdp":
            plan = plans.fsdp(model, sizes, base=plan)
        return xtrain.Mesh(**sizes), plan
    sizes = dict(data=8)
    plan = {"ddp": lambda: plans.ddp(), "zero1": lambda: plans.zero(1), "zero2": lambda: plans.zero(2),
            "fsdp": lambda: plans.fsdp(model, sizes)}[name]()
    return xtrain.Mesh(**sizes), plan


def _compile(model_name: str, plan_name: str, lowering: str, scan_layers: bool = True):
    import torch

    import xtrain

    torch.manual_seed(0)
    model = gpt_model() if model_name == "gpt" else llama_model()
    mesh, plan = mesh_and_plan(plan_name, model)
    return xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), plan=plan,
                          lowering=lowering, loss_fn=None if model_name == "gpt" else lm_loss, scan_layers=scan_layers)


VARIANTS = (("explicit", True), ("explicit", False), ("xla", True))  # (lowering, scan_layers)


def measure_row(model_name: str, plan_name: str, args) -> list[Measure]:
    """The explicit lowering (layer scan, then unrolled) and XLA's on one (model, plan), their
    timed steps interleaved so that load from other processes on the host hits all alike."""
    steps = [_compile(model_name, plan_name, lowering, scan) for lowering, scan in VARIANTS]
    data = batches(args.warmup + args.steps, args.batch, args.seq, model_name)
    losses, seconds = ([[] for _ in steps] for _ in range(2))
    for batch in data:
        for i, step in enumerate(steps):
            start = time.perf_counter()
            losses[i].append(step(*batch)["loss"])
            seconds[i].append(time.perf_counter() - start)
    out = []
    for i, step in enumerate(steps):
        rep = step.report()
        out.append(Measure(wire_bytes=sum(c.wire_bytes for c in rep.collectives), count=len(rep.collectives),
                           memory=rep.memory.get("arguments", 0) + rep.memory.get("temporaries", 0),
                           step_ms=1e3 * statistics.median(seconds[i][args.warmup:]), first_loss=losses[i][0]))
    return out


# -- output ----------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else ("-" if not a else "inf")


def table(rows: list[tuple[str, str, list[Measure]]]) -> list[str]:
    lines = ["| model | plan | wire KiB explicit | wire KiB xla | bytes ratio | count explicit | count xla | "
             "memory KiB explicit | memory KiB xla | step ms explicit | step ms xla | time ratio | "
             "memory KiB unrolled | step ms unrolled | unrolled time ratio | loss0 e / x |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for model, plan, (e, u, x) in rows:
        lines.append(f"| {model} | {plan} | {e.wire_bytes / 1024:,.1f} | {x.wire_bytes / 1024:,.1f} | "
                     f"{_ratio(e.wire_bytes, x.wire_bytes)} | {e.count} | {x.count} | {e.memory / 1024:,.0f} | "
                     f"{x.memory / 1024:,.0f} | {e.step_ms:.1f} | {x.step_ms:.1f} | {_ratio(e.step_ms, x.step_ms)} | "
                     f"{u.memory / 1024:,.0f} | {u.step_ms:.1f} | {_ratio(u.step_ms, x.step_ms)} | "
                     f"{e.first_loss:.4f} / {x.first_loss:.4f} |")
    return lines


def header(args, seconds: float) -> list[str]:
    import jax
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return [
        "# Explicit lowering vs XLA partitioner, per plan",
        "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} CPUs, {cpu}, {platform.system()} {platform.release()}; "
        f"{jax.device_count()} emulated CPU devices in one process",
        f"- software: python {platform.python_version()}, torch {torch.__version__}, jax {jax.__version__}, "
        f"xtrain commit {commit}",
        *[f"- model {k}: {v}" for k, v in MODEL_DESCRIPTIONS.items() if k in args.models],
        f"- batch: {args.batch} x {args.seq} tokens; AdamW lr 1e-3; fp32",
        "- plans: ddp, zero1/zero2 = Plan(zero=1|2) over data=8, fsdp = plans.fsdp (ZeRO-3) over data=8, "
        "megatron = plans.megatron on Mesh(data=4, tensor=2), megatron+fsdp = plans.fsdp(base=megatron)",
        "- wire bytes: per device per step, ring algorithms (all-reduce 2(n-1)/n, gather/scatter (n-1)/n of the "
        "payload); explicit: counted on the emitted program; xla: parsed from XLA's optimized HLO",
        "- memory: compiled memory analysis, arguments + temporaries per device",
        f"- step: median of {args.steps} timed steps after {args.warmup} warm-up steps, the three variants' steps "
        f"interleaved; the 8 devices share "
        f"{os.cpu_count()} cores, so times are noisy and include all devices' compute",
        f"- ratios: explicit / xla (below 1: explicit moves fewer bytes or is faster); total run {seconds:.0f} s",
        "- unrolled: the explicit lowering with scan_layers=False (the repeated blocks one after another, "
        "parameters stored per layer; same collectives as the scan), timed in the same interleaved loop; "
        "its ratio is unrolled / xla",
        f"- command: python benchmarks/plans_explicit_vs_xla.py {' '.join(sys.argv[1:])}".rstrip(),
        "",
    ]


def main(argv=None) -> None:
    args = parse_args(argv)
    from xtrain.runtime.backends import with_cpu_xla_flags

    os.environ["XLA_FLAGS"] = with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))
    import jax

    started = time.perf_counter()
    rows = []
    for model in args.models:
        for plan in args.plans:
            rows.append((model, plan, measure_row(model, plan, args)))
            print(table(rows)[-1], flush=True)
            jax.clear_caches()
    text = "\n".join(header(args, time.perf_counter() - started) + table(rows)) + "\n"
    print(text)
    pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
