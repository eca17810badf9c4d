"""Real torchrun jobs (2 processes x 4 CPU devices) train like one process with 8 devices, under
data and tensor parallelism; a process that dies ends the job with an error instead of a hang."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

import xtrain
from xtrain.runtime.launch import COORDINATOR_PORT_OFFSET

from models import GPT, token_batches

STEPS = 4
TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 240


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free for torchrun's store whose jax.distributed coordinator port is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + COORDINATOR_PORT_OFFSET < 65536 and _port_is_free(port + COORDINATOR_PORT_OFFSET):
            return port


def worker_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    # conftest asks this process for 8 devices; each worker must ask xtrain.init for its share.
    env.pop("JAX_NUM_CPU_DEVICES", None)
    env.pop("XLA_FLAGS", None)
    return env


def run_torchrun(out: Path, *worker_args: str) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(TESTS / "_mp_worker.py"), str(out), str(STEPS), *worker_args]
    try:
        proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"torchrun did not finish in {TIMEOUT_S} s:\n{err.stdout}\n{err.stderr}") from None
    assert proc.returncode == 0 and out.exists(), (
        f"torchrun exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(out.read_text())


def single_process_losses(mesh: xtrain.Mesh, plan=None) -> list[float]:
    torch.manual_seed(0)  # the same initial weights as every worker
    model = GPT()
    step = xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          plan=plan(model, mesh) if plan else None)
    return [step(*batch)["loss"] for batch in token_batches(n=STEPS)]


def assert_layout(result: dict) -> None:
    layout = {k: result[k] for k in ("device_count", "local_device_count", "process_count")}
    assert layout == dict(device_count=8, local_device_count=4, process_count=2)
    assert all(run["mesh_processes"] == [0, 1] for run in result["runs"])


def assert_losses_match(run: dict, expected: list[float]) -> None:
    assert len(run["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(run["losses"], expected)):
        assert abs(got - want) <= 1e-5 * abs(want), (
            f"{run['plan']} on Mesh({run['mesh']}), step {step}: torchrun loss {got} vs single process {want}\n"
            f"torchrun {run['losses']}\nsingle process {expected}")


def test_torchrun_two_processes_match_one_process(tmp_path):
    result = run_torchrun(tmp_path / "result.json")
    assert_layout(result)
    assert_losses_match(result["runs"][0], single_process_losses(xtrain.Mesh(data=8)))


def test_torchrun_tensor_parallel_matches_one_process(tmp_path):
    # data=4, tensor=2: each tensor-parallel pair inside one process (the usual layout);
    # tensor=2, data=4: each pair spans the two processes, so TP collectives cross gloo.
    result = run_torchrun(tmp_path / "result.json", "--plan", "megatron",
                          "--mesh", "data=4,tensor=2", "--mesh", "tensor=2,data=4")
    assert_layout(result)
    # One process: the mesh's axis order only moves devices around, not the arithmetic.
    expected = single_process_losses(xtrain.Mesh(data=4, tensor=2), xtrain.plans.megatron)
    assert [(run["mesh"], run["cross_process_axes"]) for run in result["runs"]] == [
        ({"data": 4, "tensor": 2}, ["data"]), ({"tensor": 2, "data": 4}, ["tensor"])]
    for run in result["runs"]:
        assert_losses_match(run, expected)
