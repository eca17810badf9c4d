"""Packed sequences: step time and temporaries with the documents' blocks skipped, against the
same mask computed whole, beside torch.

HF Llama (1 layer, hidden 32, 4 heads, 2 key/value heads, intermediate 64, vocab 256, fp32,
use_cache=False), batch 8 of rows packing 8 equal documents each (`position_ids` restarting
at each, HF's convention), on Mesh(data=8) over 8 emulated CPU devices:

- "documents": xtrain as it runs (the mask read as per-token comparisons; each block's mask
  built from its tokens, other documents' blocks skipped at run time);
- "dense mask": the same step with that reading turned off (the L x S mask HF builds, every
  block computed with it: what xtrain did before);
- "torch": torch eager on one device, HF's SDPA with the mask HF builds (as its users run it).

    python benchmarks/packed_sequences.py                  # about 10 minutes on 2 loaded cores
    python benchmarks/packed_sequences.py --seqs 1024

Each (sequence, kind) runs in a fresh process with the compilation cache off: XLA's compiled
temporaries per device, the median step time of 3 steps after the first, and the block pairs
computed per device against a causal call's. Writes benchmarks/results/packed_sequences.md.
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
RESULTS = HERE / "results" / "packed_sequences.md"
BATCH, VOCAB, DOCUMENTS, STEPS = 8, 256, 8, 3
KINDS = ("documents", "dense mask", "torch")


def _model(seq: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                        bos_token_id=0, eos_token_id=0, use_cache=False))


def _loss(model, ids, positions):
    return model(input_ids=ids, position_ids=positions, labels=ids.masked_fill(positions == 0, -100)).loss


def _batch(seq: int):
    import torch

    positions = torch.arange(seq // DOCUMENTS).repeat(DOCUMENTS)[None].expand(BATCH, -1)
    return torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(0)), positions


def _timed(run) -> float:
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure_xtrain(seq: int, kind: str) -> dict:
    """Runs in the child process."""
    import torch

    import xtrain
    from xtrain.frontend import token_mask
    from xtrain.ir import attention as markers

    xtrain.init(cpu_devices=8)
    if kind == "dense mask":
        token_mask.factors = lambda mask: None  # the mask as HF built it, every block computed
    model = _model(seq)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          loss_fn=_loss)
    batch = _batch(seq)
    compiled = step.compiled(*batch)
    out = {"temporaries": compiled.memory_analysis().temp_size_in_bytes}
    blocks = step(*batch).get("attention_blocks", {})
    n = -(-seq // markers.DEFAULT_BLOCK["cpu"])
    if blocks:
        out["blocks"] = sum(int(b) for b in blocks.values()) / 8 / (n * (n + 1) // 2)
    out["step_s"] = _timed(lambda: float(step(*batch)["loss"]))
    return out


def measure_torch(seq: int) -> dict:
    import torch

    model = _model(seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = _batch(seq)

    def run():
        optimizer.zero_grad()
        _loss(model, *batch).backward()
        optimizer.step()
    return {"step_s": _timed(run)}


def write(rows: dict) -> None:
    lines = ["# Packed sequences: documents' blocks skipped vs the dense mask", "",
             f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()} "
             f"({os.cpu_count()} cores, shared), `python benchmarks/packed_sequences.py`. HF Llama, 1 layer, hidden 32, "
             f"4 heads (2 kv), vocab 256, fp32, batch {BATCH} rows of {DOCUMENTS} equal documents (position_ids "
             "restarting, use_cache=False), Mesh(data=8) over 8 emulated CPU devices; torch: eager on one device, "
             "HF's SDPA with its packed mask. Blocks: block pairs computed per device / a causal call's.", "",
             "| seq | documents step s | dense mask step s | torch step s | documents / dense | documents temp MB "
             "| dense temp MB | blocks computed |", "|---|---|---|---|---|---|---|---|"]
    for seq, r in sorted(rows.items()):
        d, m, t = r["documents"], r["dense mask"], r["torch"]
        lines.append(f"| {seq} | {d['step_s']:.3f} | {m['step_s']:.3f} | {t['step_s']:.3f} "
                     f"| {d['step_s'] / m['step_s']:.2f}x | {d['temporaries'] / 1e6:.1f} | {m['temporaries'] / 1e6:.1f} "
                     f"| {d.get('blocks', 1.0):.0%} |")
    RESULTS.write_text("\n".join(lines) + "\n")


def _measure(seq: int, kind: str) -> dict:
    return measure_torch(seq) if kind == "torch" else measure_xtrain(seq, kind)


def main() -> None:
    bench_common.sequence_sweep(__file__, __doc__.splitlines()[0], [1024, 2048, 4096], KINDS, _measure, write)


if __name__ == "__main__":
    main()
