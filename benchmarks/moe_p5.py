"""Mixtral-8x7B's expert parallelism as XLA's GPU compiler schedules it for two p5.48xlarge nodes
(16 H100s), compiled on this CPU-only machine (xtrain.aot): expert parallel over 8, ZeRO-3 over
the other 2, activation checkpointing, bf16, seq 4096, local batch 1 (the recipe of
benchmarks/real_configs.py's Mixtral row, built from the published shapes without weights).

For every MoE dispatch and combine (a ragged all-to-all of the rows a device routes to other
devices, in 2 chunks per layer) it lists what one execution moves, how often it runs, and the
expert GEMMs XLA placed between its start and done: each should enclose some (another chunk's
experts, or the rows a device routes to its own experts). It also compares the dispatch's bytes
with the routed rows' (tokens x top-2 x hidden x the bytes of the dtype they travel in).

    python benchmarks/moe_p5.py          # writes benchmarks/results/moe_p5.md
"""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "moe_p5.md"
sys.path.insert(0, str(HERE))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import real_configs  # noqa: E402
import xtrain  # noqa: E402
from xtrain import aot  # noqa: E402
from xtrain.aot import request  # noqa: E402
from xtrain.cost import search  # noqa: E402
from xtrain.frontend.torch_module import wrap  # noqa: E402

TARGET, SEQ, BATCH, TOP_K = "p5.48xlarge:2", 4096, 16, 2
FLOAT_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
PLAN = dict(data=2, expert=8, zero=3, remat=True, precision="bf16")


def _roles(text: str, hidden: int) -> dict:
    """Each ragged all-to-all's role, from its (operand, output) shapes: a dispatch sends (S, H + 1)
    rows into a buffer of the other peers' (7 S, H + 1), a combine the reverse with H columns;
    their transposes (the backward pass) run the other way."""
    roles = {}
    for m in re.finditer(r"%(ragged-all-to-all-start[.\d]*) = \(\(\w+\[(\d+),(\d+)\]\{[\d,]*\}, \w+\[(\d+),", text):
        name, sent, cols, into = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        grows = into > sent
        roles[name] = {(True, True): "dispatch", (False, False): "combine", (False, True): "dispatch's transpose",
                       (True, False): "combine's transpose"}[(cols == hidden + 1, grows)]
    return roles


def _expert_gemms(collective) -> int:
    return sum(".mlp.experts" in g and ("ragged_dot" in g or "grouped" in g) for g in collective.overlapped)


def main() -> None:
    xtrain.init()
    start = time.perf_counter()
    module = real_configs._module("mixtral-8x7b")
    hidden, layers = module.config.hidden_size, module.config.num_hidden_layers
    t = wrap(module, torch.optim.AdamW(module.parameters(), lr=1e-4), loss_fn=real_configs._loss)
    ids = jax.ShapeDtypeStruct((BATCH, SEQ), np.int32)
    candidate = search.Candidate(**PLAN)
    plan = candidate.plan(search.tensor_plan(t.model, (ids, ids)), search.expert_plan(t.model, sorted(t.experts)))
    prepared = request.prepare(t, xtrain.Mesh(**candidate.mesh), plan, (ids, ids), aot.gpu_target(TARGET))
    (program,) = aot.compile_prepared([prepared])
    wall = time.perf_counter() - start
    ragged = [c for c in program.collectives if c.name.startswith("ragged-all-to-all")]
    roles = _roles(program.text, hidden)
    rows = ["| all-to-all | role | dtype | MB per run | runs per step | expert GEMMs inside |",
            "|---|---|---|---:|---:|---:|"]
    for c in ragged:
        rows.append(f"| {c.name} | {roles.get(c.name, '?')} | {','.join(c.dtypes)} | {c.payload / 1e6:.1f} | {c.times} "
                    f"| {_expert_gemms(c)} |")
    enclosing = sum(_expert_gemms(c) > 0 for c in ragged)
    tokens = BATCH * SEQ // 16  # one device's tokens per step
    wire = max(FLOAT_BYTES.get(d, 0) for c in ragged for d in c.dtypes)  # the rows' dtype (not the s64 offsets)
    chunk = tokens * TOP_K // 2 * hidden * wire  # one chunk's routed rows (2 chunks per layer)
    dispatch = {c.payload for c in ragged if roles.get(c.name) == "dispatch"}
    lines = [
        "# Mixtral-8x7B expert parallel, compiled for 2 x p5.48xlarge (deviceless)", "",
        f"`python benchmarks/moe_p5.py`: dp2 x ep8, ZeRO-3, remat, bf16, seq {SEQ}, global batch {BATCH}; "
        f"compiled memory {program.memory.total / (1 << 30):.1f} GiB per GPU, wall {wall / 60:.1f} min "
        f"(trace and XLA's compile on this host).", "",
        f"- ragged all-to-alls enclosing expert GEMMs: **{enclosing} of {len(ragged)}** (each instruction once: the "
        "forward layer loop, its last layer peeled by XLA, and the backward loop with the recomputed forward)",
        f"- each dispatch moves {', '.join(f'{b / 1e6:.2f} MB' for b in sorted(dispatch))} = "
        f"{max(dispatch) / chunk:.4f} x one chunk's routed rows x hidden x {wire} bytes ({tokens} tokens x "
        f"top-{TOP_K} / 2 chunks x {hidden}; the extra column is each row's expert id; the rows a device "
        "routes to its own experts are counted but not sent)", "",
        *rows, ""]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
