"""Step time and temporaries against the sequence length: HF Llama (1 layer, hidden 32, 4 heads,
2 key/value heads, intermediate 64, vocab 256, batch 8, fp32) on Mesh(data=8) over 8 emulated
CPU devices, xtrain's blockwise attention against full attention, and context parallel
(Mesh(data=8/c, context=c), c = 2, 4, 8: the sequence split, ring attention; the same 8
devices and batch, so every device holds as many tokens as under data=8), beside torch's own
SDPA (eager, one device, its CPU flash kernel) training the same model.

    python benchmarks/long_sequence.py                       # about 20 minutes on 2 loaded cores
    python benchmarks/long_sequence.py --seqs 512 1024       # fewer sequences

"full" is the same kernel with one block as long as the sequence: the whole L x S score
matrix, forward and backward (what xtrain computed before the blockwise kernel). "blockwise"
uses the CPU default block (xtrain.ir.attention.DEFAULT_BLOCK). Each (sequence, attention)
runs in a fresh process with the compilation cache off and reports XLA's compiled temporaries
per device, the compile time and the median step time of 3 steps after the first; a full
attention whose temporaries on all 8 emulated devices would not fit in half of this machine's
memory is compiled but not run. Writes benchmarks/results/long_sequence.md.
"""
from __future__ import annotations

import datetime
import os
import pathlib
import platform
import statistics
import time

import bench_common  # benchmarks/ (it puts examples/ on the path)

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "long_sequence.md"
BATCH, VOCAB, STEPS = 8, 256, 3
CONTEXT = {"cp2": 2, "cp4": 4, "cp8": 8}  # context-parallel kinds: the context degree


def _model(seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                        bos_token_id=0, eos_token_id=0))


def _loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def measure_xtrain(seq: int, attention: str) -> dict:
    """Runs in the child process."""
    import torch

    import xtrain
    from xtrain.ir import attention as markers

    xtrain.init(cpu_devices=8)
    if attention == "full":
        markers.DEFAULT_BLOCK["cpu"] = seq
    model = _model(seq)
    c = CONTEXT.get(attention, 1)
    mesh = xtrain.Mesh(data=8 // c, context=c) if c > 1 else xtrain.Mesh(data=8)
    step = xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          loss_fn=_loss)
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    start = time.perf_counter()
    compiled = step.compiled(ids)
    out = {"compile_s": time.perf_counter() - start, "temporaries": compiled.memory_analysis().temp_size_in_bytes}
    if out["temporaries"] * 8 > _memory_bytes() / 2:
        return out
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        float(step(ids)["loss"])
        times.append(time.perf_counter() - start)
    out["step_s"] = statistics.median(times[1:])
    return out


def measure_torch(seq: int) -> dict:
    """torch eager on one device: F.scaled_dot_product_attention (flash kernel on CPU)."""
    import torch

    model = _model(seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (BATCH, seq))
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        _loss(model, ids).backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times[1:])}


def _memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _cell(row: dict, key: str, scale: float, fmt: str) -> str:
    return fmt.format(row[key] * scale) if key in row else "not run"


def write(rows: dict) -> None:
    lines = ["# Long sequences: blockwise vs full attention", "",
             f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()} "
             f"({os.cpu_count()} cores, shared), `python benchmarks/long_sequence.py`. HF Llama, 1 layer, hidden 32, "
             "4 heads (2 kv), vocab 256, batch 8, fp32, Mesh(data=8) over 8 emulated CPU devices (one sample "
             "per device); torch: eager on one device, its SDPA. Temporaries: XLA's compiled temporaries "
             "per device. 'not run': full attention's temporaries x 8 devices exceed half this machine's memory.",
             "", "| seq | full temp MB | blockwise temp MB | full compile s | blockwise compile s "
             "| full step s | blockwise step s | torch SDPA step s |", "|---|---|---|---|---|---|---|---|"]
    for seq, r in sorted(rows.items()):
        full, block, torch_ = r["full"], r["blockwise"], r["torch"]
        lines.append(f"| {seq} | {full['temporaries'] / 1e6:.1f} | {block['temporaries'] / 1e6:.1f} "
                     f"| {full['compile_s']:.1f} | {block['compile_s']:.1f} | {_cell(full, 'step_s', 1, '{:.3f}')} "
                     f"| {_cell(block, 'step_s', 1, '{:.3f}')} | {torch_['step_s']:.3f} |")
    lines += ["", "Context parallel: Mesh(data=8/c, context=c), the same batch and devices (as many tokens per "
              "device as data=8); ring attention, load-balanced for the causal mask.", "",
              "| seq | " + " | ".join(f"{k} temp MB | {k} step s" for k in CONTEXT) + " |",
              "|---|" + "---|---|" * len(CONTEXT)]
    for seq, r in sorted(rows.items()):
        lines.append(f"| {seq} | " + " | ".join(f"{r[k]['temporaries'] / 1e6:.1f} | {_cell(r[k], 'step_s', 1, '{:.3f}')}"
                                                for k in CONTEXT) + " |")
    RESULTS.write_text("\n".join(lines) + "\n")


def _measure(seq: int, attention: str) -> dict:
    return measure_torch(seq) if attention == "torch" else measure_xtrain(seq, attention)


def main() -> None:
    bench_common.sequence_sweep(__file__, __doc__.splitlines()[0], [512, 1024, 2048, 4096, 8192],
                                ("blockwise", "full", "torch", *CONTEXT), _measure, write)


if __name__ == "__main__":
    main()
