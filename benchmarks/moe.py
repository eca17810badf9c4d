"""A tiny Mixtral-shaped MoE (8 experts, top-2): step time and wire bytes per device for
replicated experts (data=8), expert parallel (data=2, expert=4) and FSDP over 8, beside torch
eager on one device.

    python benchmarks/moe.py                  # 8 emulated CPU devices, writes benchmarks/results/moe.md
    python benchmarks/moe.py --steps 3 --out ''

Same model (HF MixtralForCausalLM, random init), weights, batches and SGD in every row. Step
time is the median over `--steps` timed steps after one warm-up (compile) step; wire bytes are
the report's ring bytes per device per step (xtrain rows only). On emulated CPU devices the
numbers show the program's shape (what is communicated), not an accelerator's speed.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from transformers import MixtralConfig, MixtralForCausalLM

import xtrain


def model(args) -> MixtralForCausalLM:
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0))


def lm_loss(m, ids, labels):
    return m(input_ids=ids, labels=labels).loss


def batches(args):
    g = torch.Generator().manual_seed(1)
    return [(ids, ids) for ids in (torch.randint(0, 512, (args.batch, args.seq), generator=g)
                                   for _ in range(args.steps + 1))]


def timed(step_fn, data) -> float:
    step_fn(*data[0])  # compile / warm up
    times = []
    for b in data[1:]:
        start = time.perf_counter()
        step_fn(*b)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def torch_eager(base, data) -> float:
    m = copy.deepcopy(base)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(ids, labels):
        opt.zero_grad()
        lm_loss(m, ids, labels).backward()
        opt.step()

    return timed(step, data)


def xtrain_row(base, data, mesh: xtrain.Mesh, fsdp: bool):
    m = copy.deepcopy(base)
    plan = xtrain.plans.fsdp(m, mesh) if fsdp else None
    step = xtrain.compile(m, mesh, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), plan=plan, loss_fn=lm_loss)
    seconds = timed(lambda *b: float(step(*b)["loss"]), data)
    report = step.report()
    a2a = sum(c.wire_bytes for c in report.collectives if c.kind == "all-to-all")
    return seconds, sum(report.bytes_per_axis().values()), a2a


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/moe.md")
    args = parser.parse_args()
    xtrain.init(cpu_devices=8)
    base, data = model(args), batches(args)
    rows = [("torch eager, 1 device", torch_eager(base, data), None, None)]
    for name, mesh, fsdp in (("replicated experts, data=8", xtrain.Mesh(data=8), False),
                             ("expert parallel, data=2 x expert=4", xtrain.Mesh(data=2, expert=4), False),
                             ("FSDP over data=8", xtrain.Mesh(data=8), True)):
        rows.append((name, *xtrain_row(base, data, mesh, fsdp)))
    lines = [f"# MoE step: Mixtral-shaped, 8 experts top-2, hidden {args.hidden}, {args.layers} layers, "
             f"batch {args.batch} x {args.seq}", "",
             "| layout | step ms (median) | wire bytes / device / step | of which all-to-all |", "|---|---|---|---|"]
    for name, seconds, wire, a2a in rows:
        fmt = lambda v: "-" if v is None else f"{v:,.0f}"
        lines.append(f"| {name} | {seconds * 1e3:.1f} | {fmt(wire)} | {fmt(a2a)} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
