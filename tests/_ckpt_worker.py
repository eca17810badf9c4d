"""A training process for the checkpoint tests (one process, or one of a torchrun job).

Usage: python tests/_ckpt_worker.py MODE CKPT_DIR OUT.json [options]

Modes:
  resume     load CKPT_DIR (a checkpoint), train --steps more steps, write losses and the final
             state dict (OUT.json + OUT.safetensors)
  killed     train 2 steps and save CKPT_DIR/step_2, then lower this process's file-size limit
             and save again after 2 more steps: the kernel kills the process mid-write (SIGXFSZ)
  save-loop  train 2 steps, then save that state again and again (step_00000000, step_00000001, ...)
             until killed: the test stops it, checks that it is mid-save, and kills it
  run        train --steps steps with a CheckpointManager on CKPT_DIR: resume from the latest
             complete checkpoint, save every --save-every steps, save and exit on SIGTERM;
             --die-rank R --die-after S: on the first attempt (TORCHELASTIC_RESTART_COUNT 0)
             rank R exits abruptly after step S (once that step's checkpoint is committed);
             --async-save: periodic saves written in the background; --plan fsdp: ZeRO-3 (each process saves its shards)
Every process builds the same GPT (seed 0) and the same global batches (tests/models.py).
"""
import argparse
import itertools
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

import jax
import torch

import xtrain
from models import GPT, token_batches
from xtrain.checkpoint import CheckpointManager, CheckpointOptions

BATCHES = 8


def build(mesh: dict, plan: str = "ddp"):
    torch.manual_seed(0)
    model = GPT()
    chosen = xtrain.plans.fsdp(model, mesh) if plan == "fsdp" else None
    return xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          plan=chosen)


def write(out: Path, step, losses: list[float], **info) -> None:
    state = step.state_dict()
    if jax.process_index() == 0:
        from safetensors.torch import save_file

        save_file(state, str(out.with_suffix(".safetensors")))
        out.write_text(json.dumps(dict(losses=losses, step_count=step.step_count, **info)))


def resume(args) -> None:
    step = build({"data": 8})
    extra = step.load(args.ckpt)
    start = extra["next_batch"]
    losses = [step(*b)["loss"] for b in token_batches(n=BATCHES)[start:start + args.steps]]
    write(args.out, step, losses, extra=extra)


def killed(args) -> None:
    step, batches = build({"data": 8}), token_batches(n=BATCHES)
    for b in batches[:2]:
        step(*b)
    step.save(args.ckpt / "step_00000002", extra={"next_batch": 2})
    for b in batches[2:4]:
        step(*b)
    # Any write past 4 KiB now kills this process (SIGXFSZ, whose default action Python turns
    # off at start-up): the next save dies mid-write.
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    print("saving step 4", flush=True)
    step.save(args.ckpt / "step_00000004", extra={"next_batch": 4})
    print("the save of step 4 was not killed", flush=True)


def save_loop(args) -> None:
    step, batches = build({"data": 8}), token_batches(n=BATCHES)
    for b in batches[:2]:
        step(*b)
    for n in itertools.count():
        step.save(args.ckpt / f"step_{n:08d}", extra={"next_batch": 2})


def run(args) -> None:
    step = build(args.mesh, args.plan)
    manager = CheckpointManager(args.ckpt, CheckpointOptions(keep=2, save_every=args.save_every,
                                                            sigterm_grace_s=args.grace, async_save=args.async_save))
    resumed = manager.latest()
    extra = manager.restore(step) or {"next_batch": 0}
    manager.stop_on_sigterm()
    rank, attempt = jax.process_index(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    losses = {}
    for i in range(extra["next_batch"], args.steps):
        losses[i] = step(*token_batches(n=BATCHES)[i % BATCHES])["loss"]
        print(f"rank {rank} attempt {attempt} step {i} loss {losses[i]}", flush=True)
        time.sleep(args.sleep)
        manager.maybe_save(step, extra={"next_batch": i + 1})
        if (rank, i, attempt) == (args.die_rank, args.die_after, 0):
            manager.wait()  # dies once its (async) checkpoint of this step is committed
            print(f"rank {rank} exits abruptly after step {i}", flush=True)
            os._exit(1)
    manager.wait()
    write(args.out, step, [losses[i] for i in sorted(losses)], first=min(losses, default=args.steps),
          resumed_from=str(resumed) if resumed else None, processes=jax.process_count())


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["resume", "killed", "save-loop", "run"])
    p.add_argument("ckpt", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--mesh", type=lambda t: {k: int(v) for k, v in (i.split("=") for i in t.split(","))},
                   default={"data": 8})
    p.add_argument("--plan", choices=["ddp", "fsdp"], default="ddp")
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--grace", type=float, default=20.0)
    p.add_argument("--die-rank", type=int, default=-1)
    p.add_argument("--die-after", type=int, default=-1)
    args = p.parse_args(argv)
    xtrain.init(cpu_devices=8)
    {"resume": resume, "killed": killed, "save-loop": save_loop, "run": run}[args.mode](args)


if __name__ == "__main__":
    main(sys.argv[1:])
