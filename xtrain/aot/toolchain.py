"""The pinned GPU compile toolchain and the child process that compiles.

XLA's GPU compiler runs here without a GPU only in a process of its own:
- JAX_PLATFORMS=cpu: otherwise the CUDA plugin's start-up check calls cuInit, fails, and no
  topology can be made (and on a GPU host the parent holds its GPUs on another backend);
- XLA_FLAGS are read once, when the first backend starts: the child gets xtrain's GPU flags
  (runtime.backends.cuda_xla_flags: latency-hiding scheduler, combine thresholds, pipelined
  all-gathers) whatever the parent started with;
- ptxas from the nvidia-cuda-nvcc-cu12 wheel (the gpu-compile extra): XLA looks for ptxas in
  `--xla_gpu_cuda_data_dir` and on PATH, and a host CUDA toolkit on PATH (CUDA 13 on this
  project's machines) would otherwise be picked, or mixed with the wheel's. The child's PATH
  starts with the wheel's bin.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from xtrain.errors import TargetCompileError
from xtrain.runtime import backends

PLUGIN = "jax_plugins.xla_cuda12"
NVCC_WHEEL = "nvidia.cuda_nvcc"
CHILD = Path(__file__).resolve().parent / "_child.py"
EXTRA = ("pip install 'xtrain[gpu-compile]' (jax-cuda12-plugin, jax-cuda12-pjrt and nvidia-cuda-nvcc-cu12, "
         "pinned to the installed jaxlib)")


def cuda_dir() -> Path:
    """The nvidia-cuda-nvcc-cu12 wheel's CUDA directory (bin/ptxas, nvvm/libdevice)."""
    spec = importlib.util.find_spec(NVCC_WHEEL) if importlib.util.find_spec("nvidia") else None
    if spec is None or not spec.submodule_search_locations:
        raise TargetCompileError(f"no pinned ptxas: the nvidia-cuda-nvcc-cu12 wheel is not installed; {EXTRA}")
    path = Path(next(iter(spec.submodule_search_locations)))
    if not (path / "bin" / "ptxas").exists():
        raise TargetCompileError(f"{path} has no bin/ptxas: reinstall nvidia-cuda-nvcc-cu12; {EXTRA}")
    return path


def ptxas() -> Path:
    """The pinned ptxas binary."""
    return cuda_dir() / "bin" / "ptxas"


@functools.lru_cache(maxsize=None)
def ptxas_version(path: str | None = None) -> str:
    """'12.9.86' for the pinned ptxas (or the one at `path`), from `ptxas --version`."""
    out = subprocess.run([path or str(ptxas()), "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"V(\d+\.\d+\.\d+)", out)
    return found.group(1) if found else out.strip().splitlines()[-1]


def versions() -> dict[str, str]:
    """jaxlib, the CUDA plugin and the pinned ptxas: what a compiled program depends on."""
    out = {}
    for package in ("jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt", "nvidia-cuda-nvcc-cu12"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    out["ptxas"] = ptxas_version()
    return out


def check_installed() -> None:
    """A TargetCompileError naming the extra when the CUDA plugin or the pinned ptxas is missing."""
    if importlib.util.find_spec("jax_plugins") is None or importlib.util.find_spec(PLUGIN) is None:
        raise TargetCompileError(f"no JAX CUDA plugin (jax-cuda12-plugin) to compile for GPUs with; {EXTRA}")
    cuda_dir()


def xla_flags() -> tuple[str, ...]:
    """The child's XLA_FLAGS: xtrain's GPU flags and the pinned toolchain's directory."""
    return (*backends.cuda_xla_flags(), f"--xla_gpu_cuda_data_dir={cuda_dir()}")


def child_env() -> dict[str, str]:
    """The child's environment: CPU platform, xtrain's GPU flags, the wheel's bin first on PATH
    (JAX_ and XLA_ variables of the parent left out: they configure the parent's backend)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(xla_flags()),
               PATH=os.pathsep.join([str(cuda_dir() / "bin"), os.environ.get("PATH", "")]),
               TF_CPP_MIN_LOG_LEVEL="2")  # the plugin's "no CUDA driver" notices at start-up
    return env


def run_child(jobs: list[dict], timeout_s: float) -> list[dict]:
    """Compiles `jobs` (xtrain.aot._child's job dicts) in one child process; one result dict
    each, in order. A child that fails is a TargetCompileError with the end of its stderr."""
    check_installed()
    with tempfile.TemporaryDirectory(prefix="xtrain-aot-") as tmp:
        request, result = Path(tmp) / "jobs.pkl", Path(tmp) / "results.pkl"
        request.write_bytes(pickle.dumps(jobs))
        try:
            proc = subprocess.run([sys.executable, str(CHILD), str(request), str(result)], env=child_env(),
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise TargetCompileError(f"the deviceless GPU compile took more than {timeout_s:.0f} s "
                                     "(pass timeout_s= for a larger program)") from err
        if proc.returncode != 0 or not result.exists():
            tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
            raise TargetCompileError(f"the deviceless GPU compile failed (exit {proc.returncode}):\n{tail}")
        return pickle.loads(result.read_bytes())
