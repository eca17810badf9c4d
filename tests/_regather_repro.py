"""Reproduces the XLA:CPU collective-order hazard of ZeRO-3's re-gather (not a test; run it).

    XTRAIN_CACHE_DIR=off timeout 300 python3 tests/_regather_repro.py [--unordered]

Trains a 2-layer GPT (blocks as one scan) with ZeRO-3 on 8 emulated devices, re-gathering in
the backward pass, with gradient clipping, 4 steps, from a cold compile cache. Prints OK.
--unordered compiles without lowering/explicit/ordering.py's dataflow order. The program then
has the hazard (test_regather.loop_hazards finds it in the HLO), which fires by chance: with
the re-gather of commit 29ca1b0 (one checkpoint around the whole step) 6 of 18 cold runs
aborted (a rendezvous joined 9 times: "Id can't be larger than the number of participating
threads"), segfaulted, or hung with 7 devices in an all-gather and 1 in an all-reduce until
xla_cpu_collective_call_terminate_timeout_seconds; with today's per-layer re-gather it fired
in none of 8 runs, but nothing prevents it.
"""
import os
import sys

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

from xtrain.runtime.backends import with_cpu_xla_flags  # noqa: E402  (before jax starts)

os.environ["XLA_FLAGS"] = with_cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))

import torch  # noqa: E402

import xtrain  # noqa: E402
from xtrain.lowering import ordering  # noqa: E402

from models import GPT, token_batches  # noqa: E402

if "--unordered" in sys.argv:
    ordering.in_order = lambda fn: fn
torch.manual_seed(0)
model, batches = GPT(layers=2), token_batches(n=4)
step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                      plan=xtrain.Plan(zero=3), clip_grad_norm=0.5)
for batch in batches:
    print({k: float(v) for k, v in step(*batch).items()}, flush=True)
print("OK")
