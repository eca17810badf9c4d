"""Restarts: SIGTERM saves a checkpoint and exits cleanly; a real torchrun job
(`--max-restarts 1`, ZeRO-3 over 2 processes, async saves) whose worker dies restarts and resumes from the latest
complete checkpoint."""
import json
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import xtrain
from xtrain.checkpoint import CheckpointManager, read_manifest
from xtrain.cli import free_port_pair

from models import GPT, token_batches
from test_checkpoint import TESTS, TIMEOUT_S, adamw, worker_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS = 6


def uninterrupted(steps: int):
    """The single-process run every resumed run must continue (batch i % 8 at step i)."""
    torch.manual_seed(0)
    model = GPT()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()))
    batches = token_batches(n=8)
    return [step(*batches[i % 8])["loss"] for i in range(steps)], step.state_dict()


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    cmd = [sys.executable, str(TESTS / "_ckpt_worker.py"), "run", str(tmp_path), str(tmp_path / "out.json"),
           "--steps", "1000", "--save-every", "0", "--sleep", "0.2"]
    proc = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "step 2 loss" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 0, output
    assert "xtrain: SIGTERM: saved" in output, output
    latest = CheckpointManager(tmp_path).latest()
    manifest = read_manifest(latest)
    # saved at the end of the step running when the signal came, with the data position
    assert manifest["step"] >= 3 and manifest["extra"] == {"next_batch": manifest["step"]}
    assert f"step {manifest['step']} loss" not in output  # no step ran after the save
    assert not (tmp_path / "out.json").exists()  # exited at the save, not at the end of training


def test_torchrun_restarts_a_dead_worker_and_resumes_from_the_latest_checkpoint(tmp_path):
    out = tmp_path / "out.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
           f"--master_port={free_port_pair()}", str(TESTS / "_ckpt_worker.py"), "run", str(tmp_path / "ckpt"),
           str(out), "--steps", str(STEPS), "--plan", "fsdp", "--save-every", "1", "--async-save", "--grace", "3", "--die-rank", "1",
           "--die-after", "2"]
    start = time.monotonic()
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "rank 1 exits abruptly after step 2" in output and "rank 0 attempt 1 step 3" in output, output
    assert "attempt 1 step 2 " not in output  # the restart did not redo a checkpointed step
    # rank 0 was blocked in step 3's collectives when torchrun sent it SIGTERM: the watchdog ended it
    assert "xtrain: SIGTERM: no step ended within 3.0 s" in output, output
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and result["first"] == 3
    assert result["resumed_from"].endswith("step_00000003")
    losses, state = uninterrupted(STEPS)
    for got, want in zip(result["losses"], losses[3:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (result["losses"], losses[3:])
    resumed = load_file(str(out.with_suffix(".safetensors")))
    worst = max(float((resumed[k] - state[k]).abs().max()) for k in state)
    assert worst <= 5e-5, worst
    kept = CheckpointManager(tmp_path / "ckpt").complete()
    assert [p.name for p in kept] == ["step_00000005", "step_00000006"]  # keep=2
    # ZeRO-3: each process wrote the shards it holds, nothing twice
    pieces = read_manifest(kept[-1])["tensors"]["opt_state/0/mu/blocks.0.mlp.0.weight"]["pieces"]
    assert sorted(p["file"] for p in pieces) == ["shards-00000.safetensors"] * 4 + ["shards-00001.safetensors"] * 4
    print(f"torchrun job with one restart took {time.monotonic() - start:.1f} s")
