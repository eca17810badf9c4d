"""Train a small GPT with xtrain, data parallel, on text that ships with Python.

    python examples/train_gpt.py                          # 8 emulated CPU devices, one process
    torchrun --nproc_per_node=2 examples/train_gpt.py     # the same script, 2 processes x 4 devices
    torchrun --nproc_per_node=2 --max-restarts=3 examples/train_gpt.py --ckpt-dir ckpt --save-every 50
                                                          # resumes from ckpt/ after a restart or SIGTERM

The model (gpt_model.py) is plain PyTorch; xtrain traces it to JAX and compiles one training
step for the whole mesh. Every process builds the same model (same seed) and passes the same
global batch; xtrain feeds each process's devices their slices.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from tqdm import tqdm

import xtrain
from gpt_model import GPT, GPTConfig, default_corpus, sample_batch, split_corpus


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences per step, all processes)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="emulated CPU devices in the whole job (CPU only; ignored on GPU/Trainium)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    p.add_argument("--emulate", default=None, metavar="INSTANCE[:NODES]",
                   help="fly a virtual cluster on CPU, e.g. trn1.32xlarge or p4d.24xlarge:2, and check "
                        "the compiled step against that hardware's rules")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory: resume from its latest complete "
                   "checkpoint, save every --save-every steps and on SIGTERM")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (with --ckpt-dir)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (with --ckpt-dir)")
    return p.parse_args(argv)


def checkpoints(step, args):
    """(manager, data position) with --ckpt-dir: resumed from the latest complete checkpoint."""
    if args.ckpt_dir is None:
        return None, None
    from xtrain.checkpoint import CheckpointManager, CheckpointOptions

    manager = CheckpointManager(args.ckpt_dir, CheckpointOptions(keep=args.keep, save_every=args.save_every))
    extra = manager.restore(step)
    manager.stop_on_sigterm()  # saves at the end of the current step, then exits 0
    return manager, (extra or {}).get("rng")


def train(step, tokens: np.ndarray, args, show: bool, manager=None, rng_state=None) -> tuple[list[float], list[float]]:
    """Runs the steps from `step.step_count` to `args.steps`; returns (losses, seconds per step)."""
    rng = np.random.default_rng(args.seed)  # same stream in every process: same global batch
    if rng_state is not None:  # the data position of a resumed run
        rng.bit_generator.state = rng_state
    losses, seconds = [], []
    bar = tqdm(range(step.step_count, args.steps), disable=not show, desc="train", unit="step")
    for _ in bar:
        x, y = sample_batch(tokens, rng, args.batch, args.seq)
        start = time.perf_counter()
        loss = step(x, y)["loss"]  # a python float: the step has finished
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{args.batch * args.seq / seconds[-1]:,.0f}")
        if manager is not None:
            manager.maybe_save(step, extra={"rng": rng.bit_generator.state})
    return losses, seconds


def report_conformance(step, tokens, args, show: bool) -> None:
    """Checks the compiled step against the emulated hardware's rules (Neuron collectives,
    unsupported ops and dtypes) before training."""
    from neuron_support.emulate import check_step

    x, y = sample_batch(tokens, np.random.default_rng(args.seed), args.batch, args.seq)
    findings = check_step(step, x, y)
    if show:
        print(f"conformance ({args.emulate}): " + ("the program conforms" if not findings else
              f"{len(findings)} finding(s)\n" + "\n".join(f"  - {f}" for f in findings)), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    # first: emulated devices (or a virtual cluster), jax.distributed
    xtrain.init(cpu_devices=None if args.emulate else args.cpu_devices, emulate=args.emulate)
    import jax

    show = jax.process_index() == 0
    torch.manual_seed(args.seed)  # identical initial weights in every process
    cfg = GPTConfig(seq=args.seq, layers=args.layers, d_model=args.d_model, heads=args.heads,
                    dropout=args.dropout)
    model = GPT(cfg)
    mesh = xtrain.Mesh(data=-1)
    step = xtrain.compile(model, mesh,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))
    train_tokens, val_tokens = split_corpus(default_corpus())
    if show:
        print(f"GPT {model.num_params() / 1e6:.2f}M parameters, {jax.device_count()} {jax.devices()[0].platform} "
              f"devices in {jax.process_count()} process(es), mesh data={jax.device_count()}, "
              f"global batch {args.batch} x {args.seq} tokens, {len(train_tokens):,} training bytes", flush=True)

    if args.emulate:
        report_conformance(step, train_tokens, args, show)
    manager, rng_state = checkpoints(step, args)
    losses, seconds = train(step, train_tokens, args, show, manager, rng_state)
    if not losses:
        if show:
            print(f"nothing to train: resumed at step {step.step_count} >= --steps {args.steps}", flush=True)
        return
    x, y = sample_batch(val_tokens, np.random.default_rng(args.seed + 1), args.batch, args.seq)
    eval_loss = step.eval(x, y)["loss"]
    timed = seconds[1:] or seconds  # the first step includes compilation
    tokens_per_s = args.batch * args.seq * len(timed) / sum(timed)
    if show:
        print(f"done: steps={args.steps} first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
              f"eval_loss={eval_loss:.4f} tokens_per_s={tokens_per_s:.0f} "
              f"compile_s={seconds[0]:.1f} median_step_ms={1e3 * statistics.median(timed):.1f}", flush=True)


if __name__ == "__main__":
    main()
