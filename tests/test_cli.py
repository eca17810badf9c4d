"""The `xtrain` command: `xtrain env` in a subprocess, `xtrain run`'s torchrun command line per
backend and environment (pure), and real `xtrain run` launches on CPU."""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain.cli import RunOptions, launch_command, launch_env
from xtrain.errors import LaunchError, OptionsError
from xtrain.runtime.launch import ProcessEnv, process_env

TESTS = Path(__file__).resolve().parent
SINGLE = ProcessEnv()
PY = "/usr/bin/python3"


def cli(*args, env=None, timeout=120):
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]),
                XTRAIN_CACHE_DIR="off", **(env or {}))
    full = {k: v for k, v in full.items() if v is not None}  # None: unset
    return subprocess.run([sys.executable, "-m", "xtrain.cli", *args], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=TESTS)


def command(opts, backend="cpu", local_devices=None, outer=SINGLE, port=40000):
    cmd = launch_command(opts, backend=backend, local_devices=local_devices, outer=outer, python=PY, free_port=port)
    assert cmd[:3] == [PY, "-m", "torch.distributed.run"]
    flags = dict(zip(cmd[3:13:2], cmd[4:13:2]))
    return flags, cmd[13:]


@pytest.mark.multiprocess
def test_env_prints_backend_devices_and_process():
    proc = cli("env")
    assert proc.returncode == 0, proc.stderr
    assert "backend: cpu" in proc.stdout and "devices: 8 x cpu" in proc.stdout  # conftest's 8 devices
    assert "process: single" in proc.stdout and "Mesh(data=8)" in proc.stdout


@pytest.mark.multiprocess
def test_env_emulated_trn1_cluster():
    proc = cli("env", "--emulate", "trn1.32xlarge:2", env={"JAX_NUM_CPU_DEVICES": None})
    assert proc.returncode == 0, proc.stderr
    assert "devices: 64 x cpu" in proc.stdout and "node=2 x chip=16 x core=2" in proc.stdout
    assert "NEURON_PJRT_PROCESSES_NUM_DEVICES=32,32" in proc.stdout and "FI_PROVIDER=efa" in proc.stdout


@pytest.mark.multiprocess
def test_env_bad_emulate_names_the_choices():
    proc = cli("env", "--emulate", "trn9.large", "--no-start")
    assert proc.returncode == 2 and "unknown instance type 'trn9.large'; known: trn1.2xlarge" in proc.stderr


@pytest.mark.unit
def test_run_defaults_per_backend():
    opts = RunOptions(script="train.py", args=("--steps", "5"))
    flags, rest = command(opts, backend="cuda", local_devices=8)  # p4d: one process per GPU
    assert flags == {"--nnodes": "1", "--nproc_per_node": "8", "--node_rank": "0",
                     "--master_addr": "127.0.0.1", "--master_port": "40000"}
    assert rest == ["train.py", "--steps", "5"]
    assert command(opts, backend="neuron", local_devices=32)[0]["--nproc_per_node"] == "1"  # JAX recipe
    per_core = RunOptions(script="train.py", layout="process-per-core")
    assert command(per_core, backend="neuron", local_devices=32)[0]["--nproc_per_node"] == "32"
    assert command(opts, backend="cpu")[0]["--nproc_per_node"] == "1"
    assert command(RunOptions(script="t.py", nproc_per_node=3), backend="cuda", local_devices=8)[0][
        "--nproc_per_node"] == "3"


@pytest.mark.unit
def test_run_multi_node_flags_and_environments():
    opts = RunOptions(script="t.py", nnodes=4, node_rank=2, master_addr="10.0.0.1")
    flags, _ = command(opts, backend="cuda", local_devices=8)
    assert (flags["--nnodes"], flags["--node_rank"], flags["--master_addr"], flags["--master_port"]) == (
        "4", "2", "10.0.0.1", "29500")
    # SageMaker without `distribution`: the entry point `xtrain run t.py` runs once per host.
    sm = process_env({"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_NEURONS": "32"})
    flags, _ = command(RunOptions(script="t.py"), backend="neuron", local_devices=32, outer=sm)
    assert (flags["--nnodes"], flags["--node_rank"], flags["--master_addr"]) == ("2", "1", "algo-1")
    # srun --ntasks-per-node=1 xtrain run t.py
    slurm = process_env({"SLURM_STEP_ID": "0", "SLURM_PROCID": "2", "SLURM_NTASKS": "3", "SLURM_LOCALID": "0",
                         "SLURM_NODEID": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "gpu[1-3]"})
    flags, _ = command(RunOptions(script="t.py"), backend="cuda", local_devices=8, outer=slurm)
    assert (flags["--nnodes"], flags["--node_rank"], flags["--master_addr"]) == ("3", "2", "gpu1")


@pytest.mark.unit
def test_run_emulation_is_one_local_process_per_node():
    opts = RunOptions(script="t.py", emulate="trn1.32xlarge:2")
    flags, _ = command(opts)
    assert (flags["--nnodes"], flags["--nproc_per_node"]) == ("1", "2")
    assert launch_env(opts) == {"XTRAIN_EMULATE": "trn1.32xlarge:2"}


@pytest.mark.unit
@pytest.mark.parametrize("opts, error, message", [
    (RunOptions(script="t.py", nnodes=2), LaunchError, "--nnodes 2 needs --master-addr"),
    (RunOptions(script="t.py", nnodes=2, node_rank=2, master_addr="h"), LaunchError,
     "--node-rank 2 is outside --nnodes 2"),
    (RunOptions(script="t.py", layout="per-chip"), OptionsError, "--layout 'per-chip' is not one of"),
])
def test_run_bad_flags(opts, error, message):
    with pytest.raises(error, match=message):
        command(opts, backend="cuda", local_devices=8)


def ranks(stdout: str) -> list[dict]:
    """Every worker's JSON record. The workers share one stdout, so a record need not start a
    line (another process's output can precede it on the same line): decode from each `{"rank"`."""
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(stdout, m.start())[0] for m in re.finditer(r'\{"rank"', stdout)]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.multiprocess
def test_run_launches_torchrun():
    proc = cli("run", "--nproc-per-node", "2", str(TESTS / "_cli_worker.py"), "a", "--b")
    assert proc.returncode == 0, proc.stderr
    assert ranks(proc.stdout) == [{"rank": r, "world": 2, "args": ["a", "--b"]} for r in (0, 1)]


@pytest.mark.multiprocess
def test_run_emulated_trn1_cluster_across_processes():
    # Two trn1.2xlarge (2 NeuronCores each) as two local processes with 2 CPU devices each.
    # The script asks for 2 CPU devices (as examples/train_gpt.py asks for 8): the launcher's
    # cluster wins, or 2 devices could not even stand for 2 nodes of whole 2-core chips.
    proc = cli("run", "--emulate", "trn1.2xlarge:2", str(TESTS / "_cli_worker.py"), "--jax", "--cpu-devices", "2",
               env={"JAX_NUM_CPU_DEVICES": None, "JAX_PLATFORMS": "cpu"}, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = {"processes": 2, "devices": 4, "local_devices": 2, "axes": {"node": 2, "chip": 1, "core": 2},
                "sum": 4.0}
    assert ranks(proc.stdout) == [{"rank": r, **expected} for r in (0, 1)]
    assert "connected peer ranks" not in proc.stdout  # Gloo's per-rank lines: shown with --verbose only
    loud = cli("run", "--verbose", "--emulate", "trn1.2xlarge:2", str(TESTS / "_cli_worker.py"), "--jax",
               env={"JAX_NUM_CPU_DEVICES": None, "JAX_PLATFORMS": "cpu"}, timeout=180)
    assert loud.returncode == 0 and "connected peer ranks" in loud.stdout, loud.stderr[-3000:]


@pytest.mark.multiprocess
def test_env_shows_the_xla_flags_for_cuda_without_a_gpu():
    proc = cli("env", "--no-start", env={"XTRAIN_BACKEND": "cuda",
                                         "XLA_FLAGS": "--xla_gpu_all_reduce_combine_threshold_bytes=1"})
    assert proc.returncode == 0, proc.stderr
    assert "backend: cuda" in proc.stdout and "XLA flags xtrain adds on cuda" in proc.stdout
    assert "  --xla_gpu_enable_latency_hiding_scheduler=true\n" in proc.stdout
    assert ("--xla_gpu_all_reduce_combine_threshold_bytes=26214400  (not added: XLA_FLAGS has "
            "--xla_gpu_all_reduce_combine_threshold_bytes=1)") in proc.stdout


@pytest.mark.multiprocess
def test_env_shows_what_a_bf16_plan_sets_on_emulated_p4d_and_trn1_clusters():
    p4d = cli("env", "--no-start", "--emulate", "p4d.24xlarge:2", "--precision", "bf16")
    assert p4d.returncode == 0, p4d.stderr
    assert "XLA flags xtrain adds on cuda" in p4d.stdout and "--xla_gpu_enable_pipelined_all_gather=true" in p4d.stdout
    assert "(on a real p4d.24xlarge:2, node 0) (precision bf16" in p4d.stdout
    assert "  FI_PROVIDER=efa\n  FI_EFA_USE_DEVICE_RDMA=1\n" in p4d.stdout
    trn1 = cli("env", "--no-start", "--emulate", "trn1.32xlarge:2", "--precision", "bf16")
    assert trn1.returncode == 0, trn1.stderr
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN=1" in trn1.stdout
    assert "NEURON_CC_FLAGS=--model-type transformer -O1 --target trn1 --auto-cast none " \
           "--enable-mixed-precision-accumulation" in trn1.stdout
    fp32 = cli("env", "--no-start", "--emulate", "trn1.32xlarge:2")
    assert "--auto-cast none\n" in fp32.stdout and "STOCHASTIC" not in fp32.stdout


@pytest.mark.unit
@pytest.mark.parametrize("command", ["report", "plan"])
def test_a_missing_script_is_a_one_line_error(command, capsys):
    from xtrain.cli import main

    extra = ["--target", "p5.48xlarge"] if command == "plan" else []
    assert main([command, *extra, "no_such_train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"xtrain {command}: no script 'no_such_train.py'") and "Traceback" not in err


@pytest.mark.unit
def test_gloo_connection_lines_are_dropped_and_the_rest_kept():
    from xtrain.cli.launch import without_gloo_lines

    line = "[Gloo] Rank 3 is connected to 63 peer ranks. Expected number of connected peer ranks is : 63\n"
    assert without_gloo_lines(line) is None
    assert without_gloo_lines("5 is connected to 63 peer ranks. Expected number of connected peer ranks is : 63\n") is None
    assert without_gloo_lines("done: steps=2\n") == "done: steps=2\n"
    # another worker's record sharing the line survives
    assert without_gloo_lines('{"rank": 1}' + line) == '{"rank": 1}\n'
    # notices cut anywhere by other workers' writes: each piece goes, the record stays
    assert without_gloo_lines("[Gloo] Rank 0 is connected to 3 peer ranks. Expected \n") is None
    assert without_gloo_lines("number of connected peer ranks is : 3\n") is None
    assert without_gloo_lines('ks. Expected number of connected peer ranks is : 3{"rank": 0}\n') == '{"rank": 0}\n'
    assert without_gloo_lines('{"rank": 0}[Gloo] Rank 1 is conn\n') == '{"rank": 0}\n'
    assert without_gloo_lines("Rank 0\n") == "Rank 0\n"  # too short to be sure it is Gloo's
