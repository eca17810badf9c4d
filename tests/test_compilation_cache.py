"""The persistent compilation cache: a second run of the same script in a new process compiles
nothing (every compile request is a cache hit and no entry is written)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain.runtime import cache

TESTS = Path(__file__).resolve().parent


def run_script(cache_dir: Path) -> dict:
    env = dict(os.environ, XTRAIN_CACHE_DIR=str(cache_dir), JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("JAX_NUM_CPU_DEVICES", None)  # the script asks xtrain.init for its own 2 devices
    proc = subprocess.run([sys.executable, str(TESTS / "_cache_script.py")], env=env, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def entries(cache_dir: Path) -> set[str]:
    return {p.name for p in (cache_dir / "jax").iterdir()}


@pytest.mark.multiprocess
def test_second_run_compiles_nothing(tmp_path):
    first = run_script(tmp_path)
    written = entries(tmp_path)
    assert first["compiles"] > 0 and first["cache_writes"] == first["compiles"] and len(written) > 0
    second = run_script(tmp_path)
    assert second["compiles"] == first["compiles"]       # the same programs were requested ...
    assert second["cache_hits"] == second["compiles"]    # ... and every one came from the cache
    assert second["cache_writes"] == 0 and entries(tmp_path) == written
    assert second["losses"] == first["losses"]


@pytest.mark.unit
def test_cache_location(tmp_path):
    assert cache.cache_root({"XTRAIN_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache.jax_cache_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/xtrain/jax")
    assert cache.cache_root({"XTRAIN_CACHE_DIR": "off"}) is None
    assert cache.neuron_cache_url({"XTRAIN_CACHE_DIR": "/data/x"}) == "/data/x/neuron"
    assert cache.neuron_cache_url({}) is None  # Neuron's own default, /var/tmp/neuron-compile-cache
