"""Compile time against depth: HF GPT-2 and HF Llama (tiny) at 2 and 8 layers, data=8 over 8
emulated CPU devices, explicit lowering, with the layer scan (default) and unrolled.

    python benchmarks/compile_depth.py          # about a minute on 2 cores

Each (model, layers, layout) runs in a fresh process with the compilation cache off, and reports:
  trace    tracing the torch model and emitting xtrain's per-device program (jax.jit lowering)
  compile  XLA's compilation of that program
  eqns     equations in the emitted program (nested ones included)
  hlo      lines of XLA's optimized HLO
The issue's target (issue 3): 8 layers compile within 1.5x of 2 layers. Writes
benchmarks/results/compile_depth.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "compile_depth.md"


def measure(model: str, layers: int, scan: bool) -> dict:
    """Runs in the child process."""
    import torch
    from jax.extend import core as jcore
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    import xtrain

    torch.manual_seed(0)
    vocab, seq, batch = 256, 32, 16
    if model == "gpt2":
        module = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=vocab, n_positions=seq))
    else:
        module = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                              num_hidden_layers=layers, num_attention_heads=4,
                                              num_key_value_heads=2, max_position_embeddings=seq))

    def loss_fn(m, ids):
        return m(input_ids=ids, labels=ids).loss

    ids = torch.randint(0, vocab, (batch, seq)).numpy()
    start = time.perf_counter()
    step = xtrain.compile(module, xtrain.Mesh(data=8), optimizer=torch.optim.AdamW(module.parameters(), lr=1e-3),
                          loss_fn=loss_fn, scan_layers=scan)
    lowered = step.lower(ids)  # traced and lowered for these devices, not compiled
    traced = time.perf_counter()
    compiled = lowered.compile()
    done = time.perf_counter()

    def count(jaxpr):
        return sum(1 + sum(count(sub) for sub in jcore.jaxprs_in_params(e.params)) for e in jaxpr.eqns)

    return {"trace_s": traced - start, "compile_s": done - traced, "eqns": count(step.program(ids).jaxpr),
            "hlo_lines": len(compiled.as_text().splitlines()), "stored_params": len(step.state.params)}


def child(model: str, layers: int, scan: bool) -> dict:
    env = dict(os.environ, XTRAIN_CACHE_DIR="off", JAX_NUM_CPU_DEVICES="8", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, __file__, "--child", model, str(layers), str(int(scan))], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--depths", type=int, nargs=2, default=(2, 8), metavar=("SHALLOW", "DEEP"),
                   help="the two depths compared (the ratio is deep / shallow)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args()
    if args.child:
        model, layers, scan = args.child
        print(json.dumps(measure(model, int(layers), bool(int(scan)))))
        return
    rows, results, load = [], {}, os.getloadavg()[0]
    for model in ("gpt2", "llama"):
        for scan in (True, False):
            shallow, deep = args.depths
            for layers in (shallow, deep):
                r = results[model, scan, layers] = child(model, layers, scan)
                print(model, "scan" if scan else "unrolled", layers, r, flush=True)
            two, eight = results[model, scan, shallow], results[model, scan, deep]
            for layers, r in ((shallow, two), (deep, eight)):
                total = r["trace_s"] + r["compile_s"]
                ratio = "" if layers == shallow else f"{total / (two['trace_s'] + two['compile_s']):.2f}"
                rows.append(f"| {model} | {'layer scan' if scan else 'unrolled'} | {layers} | {r['stored_params']} | "
                            f"{r['eqns']:,} | {r['hlo_lines']:,} | {r['trace_s']:.2f} | {r['compile_s']:.2f} | "
                            f"{total:.2f} | {ratio} |")
    head = [
        "# Compile time against depth (issue 3)", "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, 8 emulated CPU devices; "
        f"1-min load average {load:.2f} before, {os.getloadavg()[0]:.2f} after (other jobs share the cores: times "
        "are noisy, the program sizes are exact)",
        "- models: HF GPT-2 (n_embd 64, 4 heads) and HF Llama (hidden 64, GQA 4/2 heads), vocab 256; batch 16 x 32; "
        "AdamW; data=8; explicit lowering; compilation cache off; one fresh process per row",
        "- stored params: tensors in the TrainState (with the layer scan, block parameters are stored stacked per "
        "block position); eqns: equations of xtrain's emitted program; hlo: lines of XLA's optimized HLO",
        f"- ratio: (trace + compile) at {args.depths[1]} layers / at {args.depths[0]} layers; target <= 1.5 with the layer scan",
        f"- command: python benchmarks/compile_depth.py {' '.join(sys.argv[1:])}".rstrip(), "",
        f"| model | layout | layers | stored params | eqns | hlo lines | trace+lower s | XLA compile s | total s | {args.depths[1]}/{args.depths[0]} |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    args.out.write_text("\n".join(head + rows) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
