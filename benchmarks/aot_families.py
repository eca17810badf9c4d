"""Every plan family compiled by XLA's GPU compiler for a cluster that is not here (xtrain.aot), on
this CPU-only machine: per family the compile time, memory per device and whether the compiled
collectives agree with the step's report (per kind and mesh axes, bytes within 1%, no more
collectives than reported).

    python benchmarks/aot_families.py          # writes benchmarks/results/aot_families.md

The suite (tests/test_aot.py) compiles DDP, ZeRO-3, Megatron TP+SP, 1F1B, expert parallel, int8
gradient sync, ring context parallel (8 x H100) and HSDP (2 x 8 A100); this adds ZeRO-1/2, GPipe,
interleaved 1F1B, optimizer offload and DDP on 2 x 8 A100, with the suite's tiny models (one child
process compiles them all).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the suite's small models


import xtrain  # noqa: E402
from test_aot import A100, D, FAMILIES, H100, LAYER_BUCKETS, SEQ, _gpt, adamw  # noqa: E402
from xtrain import aot  # noqa: E402

PIPE = xtrain.Mesh(pipe=2, data=4)


MORE = {
    "zero1": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=1))),
    "zero2": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=2))),
    "gpipe": (H100, _gpt(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=2), layers=2)),
    "interleaved": (H100, _gpt(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=2, schedule="interleaved",
                                                                 virtual_stages=2), layers=4)),
    "offload_optimizer": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=1, offload="optimizer"))),
    "a100_ddp": (A100, _gpt(xtrain.Mesh(data=-1), xtrain.Plan(), batch=16, grad_sync=LAYER_BUCKETS)),
}


def main() -> None:
    families = {**FAMILIES, **MORE}
    prepared, errors = {}, {}
    start = time.perf_counter()
    for family, (target, case) in families.items():
        model, batch, mesh, plan, options = case()
        try:
            prepared[family] = aot.prepare(model, mesh, target=target, optimizer=adamw(model.parameters()), plan=plan,
                                           batch=batch, **options)
        except Exception as e:  # a family that cannot compile is a named error: the table says which
            errors[family] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    traced = time.perf_counter() - start
    programs = dict(zip(prepared, aot.compile_prepared(list(prepared.values()))))
    rows = ["| family | target | mesh | compile s | memory/device (KiB) | fits | collectives vs report |",
            "|---|---|---|---|---|---|---|"]
    for family, (target, _) in families.items():
        if family in errors:
            rows.append(f"| {family} | {target} | | | | | {errors[family]} |")
            continue
        p = programs[family]
        problems = aot.disagreements(p)
        mesh = "x".join(f"{a}={n}" for a, n in p.mesh.items())
        rows.append(f"| {family} | {target} | {mesh} | {p.compile_s:.1f} | {p.memory.total / 1024:.0f} | "
                    f"{p.memory.fits} | {'agree' if not problems else '; '.join(problems)} |")
    out = HERE / "results" / "aot_families.md"
    out.write_text(f"# Every plan family compiled for GPUs without them (xtrain.aot)\n\nd_model {D}, sequence {SEQ}, "
                   f"AdamW; traced and exported in {traced:.0f} s, {len(programs)} steps compiled in one child "
                   f"({time.perf_counter() - start - traced:.0f} s wall, 2 shared CPU cores).\n\n" + "\n".join(rows) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
