"""The cost model's graph memory (xtrain.cost.model.memory_from_graph, what the plan search
predicts) against the compiled memory of the same step on this machine's emulated CPU devices
(XLA's memory analysis: arguments + outputs - aliased + temporaries per device) and compiled by
XLA's GPU compiler for 8 H100s (xtrain.aot, deviceless), plan by plan, on the suite's small GPT
(tests/models.py). Nothing is tuned on the real configurations.

    python benchmarks/memory_calibration.py      # results: benchmarks/results/memory_calibration.md
"""
from __future__ import annotations

import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import xtrain  # noqa: E402
from xtrain.cost import search  # noqa: E402
from xtrain.cost.program import abstract_step, trainable_of  # noqa: E402
from xtrain.frontend.torch_module import wrap  # noqa: E402

C = search.Candidate
PLANS = [C(data=8), C(data=8, zero=1), C(data=8, zero=3), C(data=4, tensor=2), C(data=2, tensor=4, zero=1),
         C(data=4, pipe=2, microbatches=2), C(data=8, remat=True)]


def rows(plans=PLANS, d: int = 64, layers: int = 2, seq: int = 32, rows_: int = 16):
    """(plan name, compiled bytes on CPU, on H100, graph bytes) per plan."""
    from models import GPT
    from xtrain import aot
    from xtrain.aot import request

    xtrain.init()
    torch.manual_seed(0)
    model = GPT(vocab=64, d=d, layers=layers, seq=seq)
    x = np.zeros((rows_, seq), np.int32)
    batch = (x, x)
    t = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tensor = search.tensor_plan(t.model, batch)
    out, prepared = [], []
    for c in plans:
        plan = c.plan(tensor)
        step = xtrain.compile(model, xtrain.Mesh(**c.mesh), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                              plan=plan, scan_layers=True)
        compiled = search.compiled_step_cost(step, *batch).memory.total
        graph = search.step_cost(abstract_step(trainable_of(t.model, t.tx), c.mesh, plan, batch), c.mesh,
                                 rows_ * seq).memory.total
        out.append((c.name, compiled, graph))
        prepared.append(request.prepare(t, xtrain.Mesh(**c.mesh), plan, batch, aot.gpu_target("p5.48xlarge")))
    gpu = [p.memory.total for p in aot.compile_prepared(prepared)]  # one child compiles them all
    return [(name, cpu, h100, graph) for (name, cpu, graph), h100 in zip(out, gpu)]


def main() -> None:
    print(f"{'plan':<28}{'CPU B':>12}{'H100 B':>12}{'graph B':>12}{'/CPU':>8}{'/H100':>8}")
    for name, cpu, h100, graph in rows():
        print(f"{name:<28}{cpu:>12}{h100:>12}{graph:>12}{graph / cpu:>8.3f}{graph / h100:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
