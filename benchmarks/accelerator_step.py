"""Step time, tokens/s and MFU of the example GPT on whatever accelerator this host has.

    python benchmarks/accelerator_step.py                       # GPT-2-small shape on the GPU
    python benchmarks/accelerator_step.py --layers 2 --d-model 128 --seq 64 --batch 8   # CPU smoke

Runs, side by side in one process: xtrain's explicit lowering, xtrain with XLA's partitioner
(same plan), and torch eager on the same device (CUDA when present), all fp32 with TF32
matmuls allowed on both sides. MFU = model FLOPs (6 x non-embedding params + attention, per
token, forward and backward) x tokens/s / peak. Peaks per device: xtrain.cost.hardware.peak_flops
(cited there).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import xtrain  # noqa: E402
from gpt_model import GPT, GPTConfig  # noqa: E402



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def model_flops_per_token(cfg: GPTConfig, params: int) -> float:
    embed = cfg.vocab * cfg.d_model + cfg.seq * cfg.d_model
    return 6 * (params - embed + cfg.vocab * cfg.d_model) + 12 * cfg.layers * cfg.d_model * cfg.seq


def batches(cfg, args, n):
    rng = np.random.default_rng(0)
    for _ in range(n):
        tokens = rng.integers(0, cfg.vocab, size=(args.batch, args.seq + 1))
        yield torch.from_numpy(tokens[:, :-1]), torch.from_numpy(tokens[:, 1:])


def time_xtrain(cfg, args, lowering):
    torch.manual_seed(0)
    model = GPT(cfg)
    step = xtrain.compile(model, xtrain.Mesh(data=-1), lowering=lowering,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4))
    data = list(batches(cfg, args, args.steps + 2))
    start = time.perf_counter()
    step(*data[0])
    compile_s = time.perf_counter() - start
    step(*data[1])
    times = []
    for b in data[2:]:
        start = time.perf_counter()
        step(*b)  # returns a python float: the step has finished
        times.append(time.perf_counter() - start)
    return statistics.median(times), compile_s


def time_torch(cfg, args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = [(x.to(device), y.to(device)) for x, y in batches(cfg, args, args.steps + 2)]
    times = []
    for i, (x, y) in enumerate(data):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        opt.step()
        loss.item()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times), device


def main(argv=None):
    args = parse_args(argv)
    xtrain.init()
    import jax

    cfg = GPTConfig(seq=args.seq, layers=args.layers, d_model=args.d_model, heads=args.heads)
    params = GPT(cfg).num_params()
    flops_token = model_flops_per_token(cfg, params)
    tokens = args.batch * args.seq
    kind = jax.devices()[0].device_kind
    from xtrain.cost.hardware import peak_flops

    peak = {d: peak_flops(kind, d) for d in ("tf32", "bf16")}
    peak = peak if all(peak.values()) else None
    rows = []
    for name, fn in [("xtrain explicit", lambda: time_xtrain(cfg, args, "explicit")),
                     ("xtrain xla", lambda: time_xtrain(cfg, args, "xla")),
                     ("torch eager", lambda: time_torch(cfg, args))]:
        seconds, extra = fn()
        tok_s = tokens / seconds
        row = {"run": name, "step_ms": 1e3 * seconds, "tokens_per_s": tok_s,
               "tflops": flops_token * tok_s / 1e12, "extra": extra}
        if peak:
            row["mfu_tf32"] = flops_token * tok_s / peak["tf32"]
            row["mfu_bf16_peak"] = flops_token * tok_s / peak["bf16"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\nGPT {params / 1e6:.1f}M params, {args.layers} layers, d={args.d_model}, batch {args.batch} x "
          f"{args.seq}, {jax.device_count()} x {kind} ({jax.devices()[0].platform}), jax {jax.__version__}, "
          f"torch {torch.__version__}")
    print(f"{'run':<18}{'step ms':>10}{'tokens/s':>12}{'TFLOP/s':>10}{'MFU(tf32)':>11}")
    for r in rows:
        print(f"{r['run']:<18}{r['step_ms']:>10.1f}{r['tokens_per_s']:>12,.0f}{r['tflops']:>10.1f}"
              f"{r.get('mfu_tf32', float('nan')):>11.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": kind, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
