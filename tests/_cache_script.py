"""A small xtrain job that reports what JAX compiled (run twice by test_compilation_cache)."""
import json
import sys

import jax
import numpy as np
import optax

import xtrain

counts = {"compiles": 0, "cache_hits": 0, "cache_writes": 0}


def on_event(event, **_):
    if event == "/jax/compilation_cache/cache_hits":
        counts["cache_hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":  # recorded when an entry is written
        counts["cache_writes"] += 1


def on_duration(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":  # every compile request, hit or not
        counts["compiles"] += 1


jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_duration)
xtrain.init(cpu_devices=2)


def loss(params, x, y):
    return ((x @ params["w"] - y) ** 2).mean()


step = xtrain.compile(loss, xtrain.Mesh(data=2), params={"w": np.zeros((4, 1), np.float32)},
                      optimizer=optax.sgd(0.1))
x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
losses = [step(x, y)["loss"] for _ in range(2)]
counts["losses"] = losses
print(json.dumps(counts))
sys.stdout.flush()
