"""Train a small GPT with xtrain, data parallel, on text that ships with Python.

    python examples/train_gpt.py                          # 8 emulated CPU devices, one process
    torchrun --nproc_per_node=2 examples/train_gpt.py     # the same script, 2 processes x 4 devices
    python examples/train_gpt.py --profile-steps 5:7      # also a jax.profiler trace of steps 5-7
    torchrun --nproc_per_node=2 --max-restarts=3 examples/train_gpt.py --ckpt-dir ckpt --save-every 50
                                                          # resumes from ckpt/ after a restart or SIGTERM

In a SageMaker training job it trains on the "training" input channel (`estimator.fit({"training":
"s3://..."})`; its files read as bytes: UTF-8 text, see gpt_model.corpus_from_dir) instead of the
embedded corpus, checkpoints to the job's checkpoint directory when the estimator set
`checkpoint_s3_uri` (and resumes from it after a spot interruption), and exports the final
weights to SM_MODEL_DIR/model.safetensors, which SageMaker uploads.

The model (gpt_model.py) is plain PyTorch; xtrain traces it to JAX and compiles one training
step for the whole mesh. Every process builds the same model (same seed) and passes the same
global batch; xtrain feeds each process's devices their slices. A background thread places
the next batches on the devices while a step runs (xtrain.Loader); xtrain.Monitor shows loss,
tokens/s, step time and MFU, logs them as JSONL and the script plots them to a PNG at the end.
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch

import xtrain
from gpt_model import GPT, GPTConfig, corpus_from_dir, default_corpus, sample_batch, split_corpus


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
    p.add_argument("--comm-dtype", default=None, choices=["bfloat16", "int8"],
                   help="gradients on the wire (xtrain.GradSync): bfloat16, or int8 with error feedback")
    p.add_argument("--cpu-devices", type=int, default=8,
                   help="emulated CPU devices in the whole job (CPU only; ignored on GPU/Trainium)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    p.add_argument("--emulate", default=None, metavar="INSTANCE[:NODES]",
                   help="fly a virtual cluster on CPU, e.g. trn1.32xlarge or p4d.24xlarge:2, and check "
                        "the compiled step against that hardware's rules")
    p.add_argument("--metrics", default="runs/train_gpt/metrics.jsonl",
                   help="JSONL log of loss, step time, tokens/s, MFU per step ('' for none)")
    p.add_argument("--plot", default="runs/train_gpt/train.png",
                   help="PNG of loss and throughput over steps, written at the end ('' for none)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also log to TensorBoard in DIR (needs the tensorboard package)")
    p.add_argument("--profile-steps", default=None, type=step_range, metavar="A:B",
                   help="trace steps A..B (inclusive) with jax.profiler into --profile-dir")
    p.add_argument("--profile-dir", default="runs/train_gpt/profile", help="where the profiler trace goes")
    p.add_argument("--ckpt-dir", default=None, help="checkpoint directory: resume from its latest complete "
                   "checkpoint, save every --save-every steps and on SIGTERM")
    p.add_argument("--save-every", type=int, default=100, help="steps between checkpoints (with --ckpt-dir)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept (with --ckpt-dir)")
    return p.parse_args(argv)


def step_range(text: str) -> tuple[int, int]:
    """'5:7' -> (5, 7)."""
    first, _, last = text.partition(":")
    try:
        return int(first), int(last or first)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--profile-steps {text!r}: give A:B, e.g. 5:7") from None


def batches(tokens: np.ndarray, args):
    """Endless random windows; the same stream in every process (same seed): same global batch."""
    rng = np.random.default_rng(args.seed)
    while True:
        yield sample_batch(tokens, rng, args.batch, args.seq)


def corpus(sagemaker) -> tuple[np.ndarray, str]:
    """(byte tokens, where from): a SageMaker job's "training" channel, else the embedded corpus."""
    if sagemaker is not None and "training" in sagemaker.channels:
        return corpus_from_dir(sagemaker.channels["training"]), f"SageMaker channel 'training' ({sagemaker.channels['training']})"
    return default_corpus(), "CPython's pydoc topics"


def checkpoints(step, loader, args, sagemaker):
    """With --ckpt-dir (or in a SageMaker job that configured checkpoints: its directory): a
    checkpoint manager, the step and the data position resumed from its latest complete checkpoint."""
    directory = args.ckpt_dir or (sagemaker.checkpoint_dir if sagemaker is not None else None)
    if directory is None:
        return None
    from xtrain.checkpoint import CheckpointManager, CheckpointOptions

    manager = CheckpointManager(directory, CheckpointOptions(keep=args.keep, save_every=args.save_every))
    extra = manager.restore(step)
    if extra:
        loader.load_state_dict(extra["data"])
    manager.stop_on_sigterm()  # saves at the end of the current step, then exits 0
    return manager


def train(step, tokens: np.ndarray, args, show: bool, sagemaker=None) -> list[dict]:
    """Runs the steps from `step.step_count` to `args.steps`; returns one record per step
    (loss, step_time_s, tokens_per_s, ...)."""
    loader = xtrain.Loader(lambda epoch: batches(tokens, args), step=step, prefetch=2)
    manager = checkpoints(step, loader, args, sagemaker)
    monitor = xtrain.Monitor(step, total_steps=args.steps - step.step_count, metrics=args.metrics or None,
                             tensorboard=args.tensorboard, progress=show,
                             profile_steps=args.profile_steps, profile_dir=args.profile_dir)
    for _, (x, y) in zip(range(step.step_count, args.steps), loader):
        with monitor.step(tokens=args.batch * args.seq, lr=args.lr) as rec:
            rec["loss"] = step(x, y)["loss"]  # a python float: the step has finished
        if manager is not None:
            manager.maybe_save(step, extra={"data": loader.state_dict()})
    monitor.close()
    return monitor.history


def report_conformance(step, tokens, args, show: bool) -> None:
    """Checks the compiled step against the emulated hardware's rules (Neuron collectives,
    unsupported ops and dtypes) before training."""
    from neuron_support.emulate import check_step

    x, y = sample_batch(tokens, np.random.default_rng(args.seed), args.batch, args.seq)
    findings = check_step(step, x, y)
    if show:
        print(f"conformance ({xtrain.emulated_cluster().instance.name}): " + ("the program conforms" if not findings else
              f"{len(findings)} finding(s)\n" + "\n".join(f"  - {f}" for f in findings)), flush=True)


def round_batch(args, devices: int, show: bool) -> None:
    """Data parallel over every device needs a global batch that the device count divides: round
    --batch up (an emulated trn1.32xlarge:2 has 64 devices, more than the default 32 sequences)."""
    if args.batch % devices:
        rounded = -(-args.batch // devices) * devices
        if show:
            print(f"--batch {args.batch} rounded up to {rounded}, a multiple of the {devices} devices", flush=True)
        args.batch = rounded


def main(argv=None) -> None:
    args = parse_args(argv)
    # first: emulated devices (or a virtual cluster: --emulate, or `xtrain run --emulate`), jax.distributed
    xtrain.init(cpu_devices=None if args.emulate else args.cpu_devices, emulate=args.emulate)
    import jax

    show = jax.process_index() == 0
    cluster = xtrain.emulated_cluster()
    round_batch(args, jax.device_count(), show)
    torch.manual_seed(args.seed)  # identical initial weights in every process
    cfg = GPTConfig(seq=args.seq, layers=args.layers, d_model=args.d_model, heads=args.heads,
                    dropout=args.dropout)
    model = GPT(cfg)
    mesh = xtrain.Mesh(data=-1)
    step = xtrain.compile(model, mesh,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01),
                          grad_sync=xtrain.GradSync(comm_dtype=args.comm_dtype) if args.comm_dtype else None)
    sagemaker = xtrain.sagemaker.paths()  # None outside a SageMaker training job
    tokens, source = corpus(sagemaker)
    train_tokens, val_tokens = split_corpus(tokens)
    if show:
        if cluster is not None:
            print(f"emulating {cluster}", flush=True)
        print(f"GPT {model.num_params() / 1e6:.2f}M parameters, {jax.device_count()} {jax.devices()[0].platform} "
              f"devices in {jax.process_count()} process(es), mesh data={jax.device_count()}, "
              f"global batch {args.batch} x {args.seq} tokens, {len(train_tokens):,} training bytes from {source}",
              flush=True)

    if cluster is not None:
        report_conformance(step, train_tokens, args, show)
    history = train(step, train_tokens, args, show, sagemaker)
    if sagemaker is not None and sagemaker.model_dir is not None:
        path = step.export()  # SM_MODEL_DIR/model.safetensors (process 0), uploaded by SageMaker
        if show:
            print(f"exported: {path}", flush=True)
    if not history:
        if show:
            print(f"nothing to train: resumed at step {step.step_count} >= --steps {args.steps}", flush=True)
        return
    losses, seconds = [r["loss"] for r in history], [r["step_time_s"] for r in history]
    x, y = sample_batch(val_tokens, np.random.default_rng(args.seed + 1), args.batch, args.seq)
    eval_loss = step.eval(x, y)["loss"]
    timed = seconds[1:] or seconds  # the first step includes compilation
    tokens_per_s = args.batch * args.seq * len(timed) / sum(timed)
    if show:
        print(f"done: steps={args.steps} first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} "
              f"eval_loss={eval_loss:.4f} tokens_per_s={tokens_per_s:.0f} "
              f"compile_s={seconds[0]:.1f} median_step_ms={1e3 * statistics.median(timed):.1f}", flush=True)
        if args.plot:
            path = xtrain.observe.plot(history, args.plot, title=f"GPT {model.num_params() / 1e6:.2f}M, "
                                       f"{jax.device_count()} {jax.devices()[0].platform} devices")
            print(f"plot: {path}" + (f"  metrics: {args.metrics}" if args.metrics else ""), flush=True)


if __name__ == "__main__":
    main()
