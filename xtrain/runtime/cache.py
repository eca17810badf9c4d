"""Persistent compilation caches, so a second run of a script compiles nothing.

Root: XTRAIN_CACHE_DIR, else $XDG_CACHE_HOME/xtrain (~/.cache/xtrain); XTRAIN_CACHE_DIR=off
turns caching off. JAX's executables go to <root>/jax on every backend; Neuron's compiler
cache (NEURON_COMPILE_CACHE_URL) to <root>/neuron when XTRAIN_CACHE_DIR is set, else Neuron's
own default.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

CACHE_ENV = "XTRAIN_CACHE_DIR"
_OFF = {"off", "0", "none", "false"}


def cache_root(env: Mapping[str, str] | None = None) -> Path | None:
    """The cache root directory, or None when caching is off."""
    env = os.environ if env is None else env
    value = env.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF or not value.strip() else Path(value).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xtrain"


def jax_cache_dir(env: Mapping[str, str] | None = None) -> Path | None:
    root = cache_root(env)
    return None if root is None else root / "jax"


def neuron_cache_url(env: Mapping[str, str] | None = None) -> str | None:
    """NEURON_COMPILE_CACHE_URL under xtrain's root when XTRAIN_CACHE_DIR is set (None: Neuron's default)."""
    env = os.environ if env is None else env
    root = cache_root(env)
    return str(root / "neuron") if CACHE_ENV in env and root is not None else None


def enable_jax_cache(path: Path) -> None:
    """Turns on JAX's persistent compilation cache in `path`, for programs of any size.

    JAX skips programs that compile in under jax_persistent_cache_min_compile_time_secs (1 s
    by default): a training step on a small model or on CPU would never be cached.
    """
    import jax

    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _reset_if_started()
    log.info("JAX compilation cache: %s", path)


def _reset_if_started() -> None:
    """JAX fixes its cache the first time it compiles; a program compiled before xtrain.init
    (a test, a notebook cell) would leave it off. Reset so the next compile sees the new dir."""
    from jax._src import compilation_cache

    if getattr(compilation_cache, "_cache_initialized", False) or getattr(compilation_cache, "_cache_checked", False):
        compilation_cache.reset_cache()
