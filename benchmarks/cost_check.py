"""Cost model vs measurement on this machine: predicted and measured step time of 13 candidate
plans (3 of them pipelines) on 8 emulated CPU devices (Spearman rank correlation), and predicted FLOPs vs XLA's
cost analysis. Prints one `RESULT {json}` line; benchmarks/run.py runs it.

    python benchmarks/cost_check.py --model gpt --layers 2 --d-model 128

Every plan is compiled first; then the timed steps are interleaved over the plans (round k
runs one step of every plan), so load on the shared host hits all plans alike. The profile is
`hardware.emulated(8)`, calibrated in this process just before.
"""
from __future__ import annotations

import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import copy  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import bench_common  # noqa: E402

PLANS = [dict(data=8), dict(data=8, zero=1), dict(data=8, zero=2), dict(data=8, zero=3), dict(data=8, remat=True),
         dict(data=4, tensor=2), dict(data=4, tensor=2, zero=1), dict(data=4, tensor=2, zero=3),
         dict(data=2, tensor=4), dict(data=1, tensor=8),
         # pipelines of the 2 blocks (batch 16 = data 4 x microbatches x rows)
         dict(data=4, pipe=2, microbatches=2), dict(data=4, pipe=2, microbatches=4),
         dict(data=4, pipe=2, microbatches=4, schedule="1f1b")]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in set(x):  # mean rank for ties
            idx = [i for i, y in enumerate(x) if y == v]
            r[idx] = np.mean(r[idx])
        return r
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def main() -> None:
    args = bench_common.parse_args()
    import torch

    import xtrain
    from xtrain.cost import hardware, search
    from xtrain.frontend.torch_module import wrap
    from xtrain.step import host_batch
    from xtrain.ir.analysis import flops

    xtrain.init()
    profile = hardware.emulated(8)
    model = bench_common.build_model(args)
    data = bench_common.batches(args)
    candidates = [search.Candidate(**p) for p in PLANS]
    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01)  # noqa: E731
    trainable = wrap(model, opt(model))
    predicted = search.search(trainable.model, trainable.tx, host_batch(data[0]), profile, 8,
                              structure=trainable.structure, candidate_list=candidates,
                              regather=False,  # the CPU runtime keeps ZeRO-3 weights (xtrain.step)
                              prune_remat=False)
    steps, compile_s = {}, {}
    for c in candidates:
        m = copy.deepcopy(model)
        start = time.perf_counter()
        steps[c] = xtrain.compile(m, xtrain.Mesh(**c.mesh), optimizer=opt(m), plan=c.plan(trainable.structure))
        steps[c](*data[0])
        compile_s[c] = time.perf_counter() - start
    times = {c: [] for c in candidates}
    for i, batch in enumerate(data[1:]):
        for c in candidates:
            start = time.perf_counter()
            steps[c](*batch)
            if i >= 1:
                times[c].append(time.perf_counter() - start)
    rows = []
    for r in predicted.rows:
        c = r.candidate
        rows.append(dict(plan=c.name, predicted_ms=1e3 * r.prediction.step_s, measured_ms=1e3 * statistics.median(times[c]),
                         compute_ms=1e3 * r.prediction.compute_s, comm_ms=1e3 * sum(r.prediction.comm_s.values()),
                         predicted_memory=r.prediction.memory_bytes, compile_s=compile_s[c]))
    rho = spearman([x["predicted_ms"] for x in rows], [x["measured_ms"] for x in rows])
    # FLOPs vs XLA: XLA's cost analysis counts a while loop's body once, so layers are unrolled
    m = copy.deepcopy(model)
    unrolled = xtrain.compile(m, xtrain.Mesh(data=8), optimizer=opt(m), scan_layers=False)
    x, y = data[0]
    ours = flops.count(unrolled.program(x, y))
    xla = unrolled.compiled(x, y).cost_analysis()["flops"]
    bench_common.emit("cost-check", [0.0], [0.0], rows=rows, spearman=rho, profile=profile.notes,
                      flops_ours=ours.total, flops_ours_matmul=ours.matmul, flops_xla=xla,
                      pick=predicted.best.candidate.name if predicted.best else None)


if __name__ == "__main__":
    main()
