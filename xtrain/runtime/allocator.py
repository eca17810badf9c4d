"""The host allocator behaviour xtrain needs on CPU: freed memory kept for reuse.

A training step on CPU allocates the same multi-MB buffers every step (XLA's temporaries, the
batch, the optimizer's updates). glibc's defaults hand large blocks back to the kernel (blocks
above the mmap threshold are unmapped on free; the top of the heap is trimmed; the per-thread
arenas of XLA's worker threads are shrunk with MADV_DONTNEED), so every step faults the same
pages in again: about 63,000 minor page faults per step of a 12-layer example GPT in one process,
none with the settings below. `retain_freed_memory` sets them through glibc's `mallopt` (see
mallopt(3)), the run-time twin of the MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_ and
MALLOC_ARENA_MAX variables, so a plain `python train.py` gets them without a wrapper.

CPU only: on GPU and Trainium hosts the large host buffers are checkpoints, offloaded optimizer
state and staging copies, whose memory must go back to the system when freed.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from typing import Mapping

log = logging.getLogger(__name__)

SWITCH = "XTRAIN_CPU_MALLOC"       # "retain" (default on CPU) or "default": leave glibc as it is
MODES = ("retain", "default")
# mallopt(3) parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
RETAIN = {"MALLOC_MMAP_MAX_": (M_MMAP_MAX, 0),                  # no mmap'd blocks: all from the heap
          "MALLOC_TRIM_THRESHOLD_": (M_TRIM_THRESHOLD, 1 << 30),  # never trim the heap's top (below 1 GiB)
          "MALLOC_ARENA_MAX": (M_ARENA_MAX, 1)}                 # one arena: worker threads' frees reused too


def mode(env: Mapping[str, str] | None = None) -> str:
    """The allocator mode asked for: XTRAIN_CPU_MALLOC, "retain" by default."""
    env = os.environ if env is None else env
    chosen = env.get(SWITCH, "retain")
    if chosen not in MODES:
        from xtrain.errors import OptionsError

        raise OptionsError(f"{SWITCH}={chosen!r}: use 'retain' (keep freed memory for reuse, the CPU default) "
                           "or 'default' (glibc's own behaviour)")
    return chosen


def wanted(env: Mapping[str, str] | None = None) -> dict[str, tuple[int, int]]:
    """The mallopt settings to make (variable name -> (parameter, value)): none under
    XTRAIN_CPU_MALLOC=default; a setting the user made through its MALLOC_* variable (which
    glibc read at start-up) is left out."""
    env = os.environ if env is None else env
    if mode(env) == "default":
        return {}
    return {name: setting for name, setting in RETAIN.items() if name not in env}


def retain_freed_memory(env: Mapping[str, str] | None = None) -> dict[str, int]:
    """Sets glibc's malloc to keep freed memory for reuse (`wanted`). Call it once per process,
    before the threads that will allocate start. Returns the settings made (variable name ->
    value); empty when nothing was set (not glibc, switched off, or all given by the user)."""
    settings = wanted(env)
    libc = _glibc() if settings else None
    if libc is None:
        return {}
    made = {}
    for name, (param, value) in settings.items():
        if libc.mallopt(param, value) == 1:
            made[name] = value
        else:
            log.warning("mallopt(%d, %d) for %s failed: glibc keeps its default", param, value, name)
    return made


def _glibc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version  # only glibc has mallopt with these parameters
    except (OSError, AttributeError):
        return None
    return libc
