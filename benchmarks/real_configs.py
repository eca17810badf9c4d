"""Published training configurations at their real size, planned and compiled on this CPU-only
machine: the flight simulator (xtrain's cost model) and XLA's GPU compiler (xtrain.aot) side by
side, against the figures their authors published.

Each row builds the model from its published shapes on torch's meta device (no weights), the
closest xtrain plan to the published recipe, and gives: the compiled memory per GPU and whether it
fits (XLA's buffer assignment for the target's GPUs), the cost model's memory (and its ratio to the
compiled one), its predicted tokens/s per device and MFU next to the published figures, the host's
peak RSS and the wall time. Each row runs in its own process (its peak RSS is its own). Trainium
rows have no compiler here (the Neuron compiler is not installed): the cost model and the Neuron
conformance checker of the lowered program stand for it.

    python benchmarks/real_configs.py                 # every row -> benchmarks/results/real_configs.md
    python benchmarks/real_configs.py --rows llama8b-p5

Published figures (public pages, for comparison only):
- torchtitan, Llama-3.1-8B on 8 x H100, FSDP, bf16, seq 8192, local batch 1, activation
  checkpointing: about 6,667 tokens/s/GPU, 33-39% MFU (pytorch/torchtitan docs/performance.md).
- Megatron-LM (NVIDIA Megatron Core performance table), Llama-3-70B on H100s in FP8: 1,602
  tokens/s/GPU; MaxText (AI-Hypercomputer/maxtext), Llama2-70B in bf16 on 128 H100s: 1,052 tokens/s/GPU.
- AWS Neuron (neuronx-distributed training performance page), Llama-3.1-8B on 32 trn1.32xlarge:
  about 767 tokens/s per Trainium chip.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "real_configs.md"
GiB = 1 << 30

# Published shapes (the models' config.json on the Hugging Face hub)
MODELS = {
    "llama3.1-8b": dict(kind="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                        max_position_embeddings=131072, rope_theta=500000.0),
    "llama3-70b": dict(kind="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                       num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       max_position_embeddings=8192, rope_theta=500000.0),
    "mixtral-8x7b": dict(kind="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                         rope_theta=1000000.0),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """One published configuration and the candidates xtrain may pick from for it."""

    model: str
    target: str
    seq: int
    global_batch: int
    candidates: tuple[dict, ...]   # xtrain.cost.search.Candidate fields (and "batch": that plan's global batch)
    recipe: str                    # the published recipe, in words
    published: str                 # the published throughput
    published_tokens: float | None = None  # tokens/s per device, for the ratio
    compile: bool = True           # a GPU target: compiled by XLA's GPU compiler
    note: str = ""


BF16 = dict(precision="bf16")
ROWS = {
    "llama8b-p5": Config(
        "llama3.1-8b", "p5.48xlarge:1", 8192, 8, (dict(data=8, zero=3, remat=True, **BF16),),
        "torchtitan: FSDP over 8, bf16, seq 8192, local batch 1, full activation checkpointing",
        "torchtitan: 6,667 tokens/s/GPU, 33-39% MFU", 6667),
    "llama70b-p5x8": Config(
        "llama3-70b", "p5.48xlarge:8", 8192, 64,
        (dict(data=8, tensor=8, zero=1, remat=True, batch=8, **BF16),
         dict(data=8, tensor=8, zero=3, remat=True, batch=8, **BF16), dict(data=64, zero=3, remat=True, **BF16)),
        "tensor parallel inside a node (8), data over nodes, bf16, seq 8192, local batch 1 per data rank",
        "Megatron-LM FP8: 1,602 tokens/s/GPU; MaxText bf16 (128 H100): 1,052", 1052,
        note="published-style plans only (TP 8 inside a node, or FSDP over all 64); bf16, not FP8"),
    "mixtral-p5x2": Config(
        "mixtral-8x7b", "p5.48xlarge:2", 4096, 16,
        (dict(data=2, expert=8, zero=3, remat=True, **BF16), dict(data=16, zero=3, remat=True, **BF16)),
        "expert parallel over 8 inside a node, ZeRO-3 over the rest, bf16, seq 4096, local batch 1",
        "(no like-for-like published figure on 16 H100s)"),
    "llama8b-p4d": Config(
        "llama3.1-8b", "p4d.24xlarge:1", 8192, 8,
        (dict(data=8, **BF16), dict(data=8, zero=1, remat=True, **BF16), dict(data=8, zero=3, remat=True, **BF16),
         dict(data=2, tensor=4, zero=1, remat=True, **BF16)),
        "which plans fit 8 x A100 40 GB: AdamW replicated (DDP) must not",
        "(A100 40 GB: plans compared, no published row)"),
    "llama8b-trn1x4": Config(
        "llama3.1-8b", "trn1.32xlarge:4", 8192, 16,
        (dict(data=4, tensor=32, zero=1, remat=True, batch=4, **BF16),
         dict(data=16, tensor=8, zero=1, remat=True, batch=16, **BF16), dict(data=128, zero=3, remat=True, batch=128,
                                                                              **BF16)),
        "Neuron's recipe: tensor parallel 32 (whole node), ZeRO-1 over nodes, bf16, seq 8192",
        "Neuron (32 nodes): ~767 tokens/s per chip (2 cores)", 767 / 2, compile=False,
        note="no Neuron compiler here: cost model + conformance checker; per device = per NeuronCore"),
}


def _module(name: str):
    import torch
    import transformers

    dims = dict(MODELS[name])
    kind = dims.pop("kind")
    config = (transformers.LlamaConfig if kind == "llama" else transformers.MixtralConfig)(**dims)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _loss(m, ids, labels):
    return m(input_ids=ids, labels=labels).loss


def run_row(key: str) -> dict:
    """One row, in this process: the cost model's rows for the configuration's candidates and, on
    a GPU target, the compiled program of each that the cost model says fits (or the best one)."""
    import jax
    import numpy as np
    import torch

    import xtrain
    from xtrain import aot
    from xtrain.aot import request
    from xtrain.cost import hardware, program, search
    from xtrain.frontend.torch_module import wrap

    xtrain.init()
    cfg = ROWS[key]
    start = time.perf_counter()
    module = _module(cfg.model)
    params = sum(p.numel() for p in module.parameters())
    t = wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-4), loss_fn=_loss)
    profile, devices = hardware.target(cfg.target)
    planned = []  # (search row, its batch): one search per global batch, over the candidates given it
    for size in dict.fromkeys(c.get("batch", cfg.global_batch) for c in cfg.candidates):
        ids = jax.ShapeDtypeStruct((size, cfg.seq), np.int32)
        candidates = [search.Candidate(**{k: v for k, v in c.items() if k != "batch"}) for c in cfg.candidates
                      if c.get("batch", cfg.global_batch) == size]
        result = search.search(t.model, t.tx, (ids, ids), profile, devices, structure=t.structure,
                               candidate_list=candidates, experts=sorted(t.experts), prune_remat=False,
                               target=cfg.target)
        planned += [(r, (ids, ids)) for r in result.rows]
    planned_s = time.perf_counter() - start
    usable = [r for r, _ in planned if r.usable]
    best = max(usable, key=lambda r: r.prediction.tokens_per_s, default=None)  # batches differ: tokens/s, not step time
    rows = []
    for r, batch in planned:
        p = r.prediction
        row = dict(plan=r.candidate.name, batch=batch[0].shape[0], reason=r.reason, findings=list(r.findings),
                   predicted_bytes=p.memory_bytes if p else None, predicted_fits=p.fits if p else None,
                   tokens_per_s_device=p.tokens_per_s / devices if p else None, mfu=p.mfu if p else None,
                   picked=r is best)
        if p is None and r.reason.startswith(search.STATE_ALONE):  # the cost model's floor: no trace
            row.update(floor_bytes=r.candidate.state_floor(*program.state_totals(t.model, t.tx)), predicted_fits=False)
        # refused by the state floor: compiled anyway, for the compiler's word on it
        if cfg.compile and (p is not None or r.reason.startswith(search.STATE_ALONE)):
            plan = r.candidate.plan(search.tensor_plan(t.model, batch), search.expert_plan(t.model, sorted(t.experts))
                                    if t.experts else None)
            gpu = aot.gpu_target(cfg.target)
            c0 = time.perf_counter()
            try:
                prepared = request.prepare(t, xtrain.Mesh(**r.candidate.mesh), plan, batch, gpu)
                compiled, = aot.compile_prepared([prepared])  # not `program` (xtrain.cost.program, above)
                row.update(compiled_bytes=compiled.memory.total, compiled_fits=compiled.memory.fits,
                           capacity=compiled.memory.capacity, compile_s=time.perf_counter() - c0,
                           temporaries=compiled.memory.temporaries, arguments=compiled.memory.arguments)
            except Exception as e:  # noqa: BLE001 - the table names what the compiler refused
                row.update(compile_error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
        rows.append(row)
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    return dict(key=key, params=params, devices=devices, plan_s=planned_s, wall_s=time.perf_counter() - start,
                rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, child_rss=children, rows=rows,
                capacity=profile.hbm_bytes)


def _gb(b) -> str:
    return "-" if b is None else f"{b / GiB:.1f}"


def table(results: list[dict]) -> str:
    out = ["# Published configurations at real size, planned and compiled on a CPU-only machine", "",
           "`python benchmarks/real_configs.py` (models on torch's meta device; GPU rows compiled by XLA's GPU "
           "compiler through `xtrain.aot`; memory in GiB per device; cost/compiled is the cost model's memory "
           "over the compiled one). Host: " + _host() + ".", ""]
    for res in results:
        cfg = ROWS[res["key"]]
        out += [f"## {res['key']}: {cfg.model} ({res['params'] / 1e9:.1f}B parameters) on {cfg.target} "
                f"({res['devices']} devices), seq {cfg.seq}, global batch {cfg.global_batch} (unless a row says)", "",
                f"Published recipe: {cfg.recipe}. Published: {cfg.published}." + (f" {cfg.note}." if cfg.note else ""),
                "", f"Wall time {res['wall_s'] / 60:.1f} min (cost model {res['plan_s'] / 60:.1f} min); host peak "
                f"RSS {_gb(res['rss'])} GiB (compiler child {_gb(res['child_rss'])} GiB).", "",
                "| plan | compiled | fits | cost model | fits | cost/compiled | tokens/s/device | MFU | vs published |",
                "|---|---:|:-:|---:|:-:|---:|---:|---:|---:|"]
        for r in res["rows"]:
            compiled = r.get("compiled_bytes")
            yes = lambda f: "-" if f is None else ("yes" if f else "**no**")
            ratio = f"{r['predicted_bytes'] / compiled:.2f}" if compiled and r["predicted_bytes"] else "-"
            tok = r["tokens_per_s_device"]
            mfu = "-" if r["mfu"] is None else f"{r['mfu'] * 100:.0f}%"
            vs = f"{tok / cfg.published_tokens:.2f}" if tok and cfg.published_tokens else "-"
            name = ("**" + r["plan"] + "** (pick)") if r["picked"] else r["plan"]
            name += f", batch {r['batch']}" if r["batch"] != cfg.global_batch else ""
            extra = r.get("compile_error") or (r["reason"] if not r["predicted_bytes"] and "floor_bytes" not in r else "")
            predicted = _gb(r["predicted_bytes"]) if r.get("floor_bytes") is None else f">= {_gb(r['floor_bytes'])}"
            out.append(f"| {name} | {_gb(compiled)} | {yes(r.get('compiled_fits'))} | {predicted} | "
                       f"{yes(r['predicted_fits'])} | {ratio} | {'-' if tok is None else f'{tok:,.0f}'} | "
                       f"{mfu} | {vs} |" + (f" {extra}" if extra else ""))
            if r["findings"]:
                out.append(f"|  conformance: {'; '.join(r['findings'])[:300]} |||||||||")
        out.append("")
    return "\n".join(out)


def _host() -> str:
    return f"{os.cpu_count()} cores, {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GiB:.0f} GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated: " + ", ".join(ROWS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child: run one row, print its JSON
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--json", default=None, metavar="DIR", help="also keep each row's figures as DIR/<row>.json")
    ap.add_argument("--render", default=None, metavar="DIR", help="only write the table of the rows kept in DIR")
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_row(args.one)), flush=True)
        return
    results = []
    for key in args.rows.split(","):
        if args.render:
            results.append(json.loads((Path(args.render) / f"{key}.json").read_text()))
            continue
        proc = subprocess.run([sys.executable, __file__, "--one", key], capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{key}: failed\n{proc.stderr[-3000:]}", file=sys.stderr, flush=True)
            continue
        results.append(json.loads(line[len("RESULT "):]))
        if args.json:
            Path(args.json).mkdir(parents=True, exist_ok=True)
            (Path(args.json) / f"{key}.json").write_text(line[len("RESULT "):])
        print(table(results[-1:]), flush=True)
    Path(args.out).write_text(table(results) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
