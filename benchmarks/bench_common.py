"""What the benchmark workers share: core pinning, the model, the batches, the result line.

Each worker (bench_xtrain.py, bench_ddp.py, bench_eager.py) trains the GPT of
examples/train_gpt.py on the same global batches and prints one `RESULT {json}` line from
rank 0 with its per-step wall times. ddp_vs_xtrain.py launches them and compares.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

RESULT_PREFIX = "RESULT "


def pin_to_core() -> int:
    """Pins this process to one core (LOCAL_RANK modulo the cores it may use); returns the core.

    Call before torch or jax start their thread pools: XLA sizes its pools by the schedulable
    CPUs, so this is what makes XLA run on one thread; torch's OpenMP pool is sized by the same
    affinity (one thread), as torchrun's own OMP_NUM_THREADS=1 would size it.
    """
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(os.environ.get("LOCAL_RANK", "0")) % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, caches)")
    p.add_argument("--batch", type=int, default=32, help="global batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lowering", default="xla", help="xtrain lowering (bench_xtrain.py only)")
    p.add_argument("--model", default="gpt", choices=("gpt", "llama"),
                   help="gpt: examples/gpt_model.py; llama: HF LlamaForCausalLM of the same width (SwiGLU, GQA)")
    p.add_argument("--plan", default="ddp", choices=("ddp", "fsdp", "auto"),
                   help="bench_xtrain.py: the default data-parallel plan, ZeRO-3 (fsdp: Plan(zero=3)), or "
                        "plan='auto' (the cost model's pick)")
    p.add_argument("--report", action="store_true",
                   help="bench_xtrain.py: also emit step.report()'s wire bytes and XLA memory per device")
    p.add_argument("--scan-layers", default="auto", choices=("auto", "scan", "unrolled"),
                   help="bench_xtrain.py: compile(scan_layers=...): the default, the layer scan, or unrolled blocks")
    p.add_argument("--profile-split", action="store_true",
                   help="bench_xtrain.py: after the timed steps, trace 3 more and split their time into matmul, "
                        "other compute, collectives and data movement (profile_split.py)")
    p.add_argument("--no-guards", action="store_true",
                   help="bench_xtrain.py: compile with detect_nan=False, check_inputs=False (their cost is the "
                        "difference)")
    return p.parse_args(argv)


def gloo_rank_slice(args) -> tuple[int, int, slice]:
    """(rank, world, this rank's rows of the global batch) of a torch.distributed (gloo) worker."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} is not divisible by {world} processes")
    return rank, world, slice(rank * args.batch // world, (rank + 1) * args.batch // world)


def build_model(args):
    """The example's GPT (or a tiny HF Llama), with the same initial weights in every process
    and framework; `model(x, y)` returns the mean next-token loss."""
    import torch
    from gpt_model import GPT, GPTConfig

    torch.manual_seed(args.seed)
    if getattr(args, "model", "gpt") == "llama":
        return LlamaLM(args)
    return GPT(GPTConfig(seq=args.seq, layers=args.layers, d_model=args.d_model, heads=args.heads))


def _llama_base():
    import torch

    class LlamaLM(torch.nn.Module):
        """HF Llama with forward(x, y) -> loss on already shifted targets (as the GPT's)."""

        def __init__(self, args):
            super().__init__()
            from transformers import LlamaConfig, LlamaForCausalLM

            self.lm = LlamaForCausalLM(LlamaConfig(
                vocab_size=256, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
                num_hidden_layers=args.layers, num_attention_heads=args.heads,
                num_key_value_heads=max(1, args.heads // 2), max_position_embeddings=args.seq,
                bos_token_id=0, eos_token_id=0))

        def forward(self, x, y):
            logits = self.lm(input_ids=x).logits  # (B, T, V)
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return LlamaLM


def LlamaLM(args):  # noqa: N802 (a class built on first use: transformers loads only for llama)
    return _llama_base()(args)


def batches(args) -> list[tuple[np.ndarray, np.ndarray]]:
    """warmup + steps global batches (inputs, targets), identical in every process."""
    from gpt_model import default_corpus, sample_batch, split_corpus

    tokens, _ = split_corpus(default_corpus())
    rng = np.random.default_rng(args.seed)
    return [sample_batch(tokens, rng, args.batch, args.seq) for _ in range(args.warmup + args.steps)]


FIRST_STEP_S: list[float] = []  # the first step's wall time (compilation, for xtrain), set by timed_loop
TIMED_FAULTS: list[float] = []  # minor page faults per timed step, set by timed_loop


def timed_loop(step_fn, all_batches, warmup: int) -> tuple[list[float], list[float]]:
    """Calls `step_fn(x, y) -> float loss` on each batch; returns (losses, seconds of timed steps).
    `step_fn` must return a host float, so each step has finished when the clock stops."""
    import resource

    losses, seconds = [], []
    for i, (x, y) in enumerate(all_batches):
        if i == warmup:
            TIMED_FAULTS[:] = [resource.getrusage(resource.RUSAGE_SELF).ru_minflt]
        start = time.perf_counter()
        losses.append(step_fn(x, y))
        if i == 0:
            FIRST_STEP_S[:] = [time.perf_counter() - start]
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    if TIMED_FAULTS:  # minor page faults per timed step
        TIMED_FAULTS[:] = [(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - TIMED_FAULTS[0]) / len(seconds)]
    return losses, seconds


def allocator_in_effect() -> dict[str, object]:
    """This process's malloc settings as it runs: the MALLOC_* variables glibc read at start-up,
    and what xtrain.init set through mallopt (xtrain workers only)."""
    found: dict[str, object] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}
    if "xtrain" in sys.modules:
        from xtrain.runtime.devices import allocator_settings

        found.update({f"mallopt {k}": v for k, v in allocator_settings().items()})
    return found


def emit(framework: str, losses: list[float], seconds: list[float], **extra) -> None:
    """Prints the result line the driver parses, with the allocator and thread counts the
    process actually ran with (read here, not assumed by the driver)."""
    import resource

    threads = {}
    if "torch" in sys.modules and "torch_threads" not in extra:
        threads["torch_threads"] = sys.modules["torch"].get_num_threads()
    record = dict(framework=framework, step_s=seconds, first_loss=losses[0], last_loss=losses[-1],
                  first_step_s=FIRST_STEP_S[0] if FIRST_STEP_S else None,
                  peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  faults_per_step=TIMED_FAULTS[0] if TIMED_FAULTS else None,
                  allocator=allocator_in_effect(), **threads, **extra)
    print(RESULT_PREFIX + json.dumps(record), flush=True)


# -- the example GPT trained for a few hundred steps (int8_grad_sync.py, fp8_training.py) ---------
def long_run_args(description: str) -> argparse.ArgumentParser:
    """The options of a long training comparison on the example GPT (its defaults: 300 steps)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    return p


def long_run(args, train_tokens, val_tokens, **compile_options) -> tuple[dict, object]:
    """Trains the example GPT `args.steps` steps on 8 emulated devices (data=8) from seed
    `args.seed`'s weights and batches, `xtrain.compile(..., **compile_options)`; returns
    ({"losses", "eval_loss", "tail_loss" (mean of the last 20), "seconds"}, the step)."""
    import torch

    import xtrain
    from gpt_model import GPT, GPTConfig, sample_batch

    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(seq=args.seq, layers=args.layers, d_model=args.d_model, heads=4))
    step = xtrain.compile(model, xtrain.Mesh(data=-1), **compile_options,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    rng, losses, start = np.random.default_rng(args.seed), [], time.perf_counter()
    for _ in range(args.steps):
        losses.append(step(*sample_batch(train_tokens, rng, args.batch, args.seq))["loss"])
    seconds = time.perf_counter() - start
    x, y = sample_batch(val_tokens, np.random.default_rng(args.seed + 1), args.batch, args.seq)
    return {"losses": losses, "eval_loss": step.eval(x, y)["loss"],
            "tail_loss": float(np.mean(losses[-min(20, len(losses)):])), "seconds": seconds}, step


def save_long_run(name: str, text: str, args, runs) -> None:
    """Prints the table; for runs of 100 steps or more writes benchmarks/results/NAME.md and
    NAME.json (the arguments and every step's loss)."""
    print(text)
    if args.steps >= 100:
        results = pathlib.Path(__file__).resolve().parent / "results"
        (results / f"{name}.md").write_text(text)
        (results / f"{name}.json").write_text(json.dumps({"args": vars(args), "runs": runs}))


def verdict_lines(label: str, runs: tuple[dict, dict], bar: float) -> list[str]:
    """The comparison's last lines: how far apart the second run's tail and eval losses are from
    the first's, and PASS when both are within `bar`."""
    base, other = runs
    rel = lambda k: abs(other[k] - base[k]) / base[k]
    return [f"{label}: loss {rel('tail_loss'):.2%} apart, eval loss {rel('eval_loss'):.2%} apart (bar: {bar:.0%})",
            f"verdict: {'PASS' if max(rel('tail_loss'), rel('eval_loss')) <= bar else 'FAIL'}"]


# -- sweeps over sequence lengths, each point in a fresh process (long_sequence.py, packed_sequences.py) --
def sequence_sweep(script: str, description: str, seqs: list[int], kinds, measure, write) -> None:
    """The `main` of a sweep: `script --seqs ...` runs `script --child SEQ KIND` per (sequence,
    kind), each in a fresh process with the compilation cache off, and calls `write(rows)` after
    each sequence (rows: {seq: {kind: measure's dict}}); in the child, `measure(seq, kind)` runs and
    its dict is printed as JSON."""
    import subprocess

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--seqs", type=int, nargs="+", default=seqs)
    parser.add_argument("--child", nargs=2, metavar=("SEQ", "KIND"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(int(args.child[0]), args.child[1])))
        return
    env = {**os.environ, "XLA_FLAGS": "", "XTRAIN_CACHE_DIR": "off", "PYTHONPATH": str(pathlib.Path(script).parents[1])}

    def child(seq: int, kind: str) -> dict:
        done = subprocess.run([sys.executable, script, "--child", str(seq), kind], env=env, capture_output=True,
                              text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    rows = {}
    for seq in args.seqs:
        rows[seq] = {kind: child(seq, kind) for kind in kinds}
        print(seq, rows[seq], flush=True)
        write(rows)
