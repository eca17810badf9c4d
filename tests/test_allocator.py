"""xtrain.runtime.allocator: on CPU, glibc keeps freed memory for reuse (mallopt), switchable."""
import os
import subprocess
import sys

import pytest

from xtrain.errors import OptionsError
from xtrain.runtime import allocator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.unit
def test_the_switch_and_the_users_own_variables_win():
    # what would be set (applying it here would change this test process's allocator)
    assert allocator.wanted({"XTRAIN_CPU_MALLOC": "default"}) == {}
    assert set(allocator.wanted({})) == {"MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX"}
    assert set(allocator.wanted({"MALLOC_ARENA_MAX": "4"})) == {"MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"}
    with pytest.raises(OptionsError, match=r"XTRAIN_CPU_MALLOC='keep': use 'retain'"):
        allocator.mode({"XTRAIN_CPU_MALLOC": "keep"})


@pytest.mark.multiprocess
def test_init_on_cpu_sets_the_allocator_and_says_so():
    probe = ("import xtrain; xtrain.init(cpu_devices=1); "
             "from xtrain.runtime.devices import allocator_settings; print(allocator_settings())")
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    run = lambda **extra: subprocess.run([sys.executable, "-c", probe], env={**env, **extra}, capture_output=True,
                                         text=True, timeout=120)
    on, off = run(), run(XTRAIN_CPU_MALLOC="default")
    assert on.returncode == 0 and off.returncode == 0, on.stderr[-2000:] + off.stderr[-2000:]
    assert on.stdout.strip().splitlines()[-1] == str({"MALLOC_MMAP_MAX_": 0, "MALLOC_TRIM_THRESHOLD_": 1 << 30,
                                                      "MALLOC_ARENA_MAX": 1})
    assert off.stdout.strip().splitlines()[-1] == "{}"
