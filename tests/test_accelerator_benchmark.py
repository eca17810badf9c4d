"""The CPU side of benchmarks/accelerator_step.py (the ~1B Llama bf16 benchmark for GPU hosts),
on a tiny config: every row runs, all count the model's FLOPs by the one definition, and the
table names the device."""
import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import accelerator_step  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_tiny_llama_rows_share_one_flop_count_and_the_table_names_the_device(tmp_path):
    runs = ["xtrain fsdp", "xtrain tp", "jax.jit"]  # the XLA rows differ only by lowering="xla"
    rows = accelerator_step.main(["--tiny", "--steps", "1", "--tensor", "2", "--runs", ",".join(runs),
                                  "--out", str(tmp_path)])
    assert [r["run"] for r in rows] == runs
    assert len({r["model_flops"] for r in rows}) == 1 and rows[0]["model_flops"] > 0
    assert all(r["tokens_per_s"] > 0 and r["mfu"] is None for r in rows)  # CPU: no bf16 peak, no MFU
    table = (tmp_path / "accelerator_step_cpu.md").read_text()
    assert table.startswith("# Llama ") and "8 x cpu (cpu)" in table and "| jax.jit |" in table
    assert json.loads((tmp_path / "accelerator_step_cpu.json").read_text())["device"] == "cpu"


def test_gpu_step_bundle_and_its_deviceless_compile(tmp_path, monkeypatch):
    """benchmarks/gpu_step.py's CPU half on a tiny Llama: the bundle holds the blockwise and the
    cuDNN step (a bf16 plan of a float32 model: cuDNN's kernels on the GPU), and the GPU host's
    deviceless compile of the blockwise one runs here as there (the gpu-compile extra's ptxas)."""
    import pickle

    import gpu_step
    from xtrain.aot import toolchain

    bundle, out = tmp_path / "bundle", tmp_path / "out"
    gpu_step.main(["prepare", "--bundle", str(bundle), "--tiny"])
    variants = pickle.loads((bundle / "steps.pkl").read_bytes())
    assert (variants["blockwise"]["cudnn_calls"], variants["cudnn"]["cudnn_calls"]) == (0, 4)  # 2 layers x fwd, bwd
    assert json.loads((bundle / "meta.json").read_text())["predicted"]["step_s"] > 0
    monkeypatch.setenv("PATH", f"{toolchain.cuda_dir() / 'bin'}:{os.environ['PATH']}")  # as the GPU host's ptxas
    gpu_step.main(["run", "--bundle", str(bundle), "--out", str(out), "--parts", "deviceless"])
    results = json.loads((out / "gpu_step.json").read_text())
    assert not results["errors"] and results["deviceless"]["memory"]["argument"] > 0
    assert results["deviceless"]["schedule"]["triton_gemms"] > 0  # no device, no autotuning: Triton GEMMs
