"""The main example (examples/train_gpt.py) runs end to end and its loss falls."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ["--steps", "8", "--layers", "1", "--d-model", "32", "--batch", "16", "--seq", "32", "--lr", "1e-2"]
# Launcher variables would turn the child into a rank of some other job.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(drop=()) -> dict[str, str]:
    """A clean environment for the example: no launcher variables, CPU, this checkout first."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS + tuple(drop)}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE.parents[1]), env.get("PYTHONPATH", "")])
    return env


def final_line(stdout: str) -> dict[str, float]:
    """{"first_loss": ..., "last_loss": ..., ...} from the example's closing `done: k=v ...` line."""
    lines = [line for line in stdout.splitlines() if line.startswith("done:")]
    assert lines, f"no 'done:' line in the example's output:\n{stdout}"
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-+.\deE]+)", lines[-1])}


def test_train_gpt_runs_and_loss_falls(tmp_path):
    env = child_env()
    metrics, png = tmp_path / "metrics.jsonl", tmp_path / "train.png"
    proc = subprocess.run([sys.executable, str(EXAMPLE), *TINY, "--metrics", str(metrics), "--plot", str(png)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"example failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    done = final_line(proc.stdout)
    assert done["steps"] == 8
    assert done["last_loss"] < done["first_loss"] - 0.5, done
    assert done["eval_loss"] < done["first_loss"], done
    assert done["tokens_per_s"] > 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(8))
    assert records[0]["loss"] == pytest.approx(done["first_loss"], abs=1e-4)
    assert all(r["tokens_per_s"] > 0 and r["tflops_s"] > 0 and r["lr"] == 1e-2 for r in records)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_train_gpt_under_xtrain_run_emulates_two_trn1_nodes_and_checks_conformance():
    # `xtrain run --emulate` names the cluster for the job: 2 processes x 32 devices, although the
    # example asks for 8 CPU devices by default; its default batch (32) is rounded up to 64.
    env = child_env(drop=("JAX_NUM_CPU_DEVICES",))
    args = ["--steps", "2", "--layers", "1", "--d-model", "32", "--seq", "16", "--metrics", "", "--plot", ""]
    proc = subprocess.run([sys.executable, "-m", "xtrain.cli", "run", "--emulate", "trn1.32xlarge:2", str(EXAMPLE),
                           *args], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"example failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert "emulating 2 x trn1.32xlarge on 64 CPU devices" in proc.stdout
    assert "64 cpu devices in 2 process(es)" in proc.stdout
    assert "--batch 32 rounded up to 64" in proc.stdout
    assert "conformance (trn1.32xlarge): the program conforms" in proc.stdout
    assert final_line(proc.stdout)["steps"] == 2


def test_train_gpt_resumes_from_its_checkpoint_directory(tmp_path):
    env = child_env()
    quiet = ["--metrics", "", "--plot", ""]
    run = lambda *extra: subprocess.run([sys.executable, str(EXAMPLE), *TINY[2:], *quiet, *extra], env=env,
                                        capture_output=True, text=True, timeout=180)
    whole = run("--steps", "6", "--ckpt-dir", str(tmp_path), "--save-every", "3")
    assert whole.returncode == 0, whole.stdout + whole.stderr[-4000:]
    assert (tmp_path / "step_00000003" / "COMMITTED").exists()
    shutil.rmtree(tmp_path / "step_00000006")  # as if the job had died after step 5
    resumed = run("--steps", "6", "--ckpt-dir", str(tmp_path))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr[-4000:]
    # the resumed run trains steps 3-5 on the same batches (data position restored) to the same loss
    assert final_line(resumed.stdout)["last_loss"] == final_line(whole.stdout)["last_loss"]
    assert final_line(resumed.stdout)["first_loss"] != final_line(whole.stdout)["first_loss"]
