"""The CPU side of benchmarks/accelerator_step.py (the ~1B Llama bf16 benchmark for GPU hosts),
on a tiny config: every row runs, all count the model's FLOPs by the one definition, and the
table names the device."""
import json
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
