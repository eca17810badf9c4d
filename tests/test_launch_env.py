"""process_env() from recorded launcher environments: torchrun, SageMaker, Slurm, MPI, single."""
import dataclasses

import pytest

from xtrain.errors import LaunchError
from xtrain.runtime.launch import (COORDINATOR_PORT_OFFSET, Cluster, Launcher, ProcessEnv,
                                   expand_hostlist, expand_tasks_per_node, process_env)

pytestmark = pytest.mark.unit

# torchrun --nnodes 2 --nproc_per_node 4 --node_rank 1 --master_addr 10.0.0.5 --master_port 29400,
# the process with LOCAL_RANK 2 (variables as torchrun 2.13 sets them).
TORCHRUN = {
    "RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "6", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2",
    "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_USE_AGENT_STORE": "True",
}

# SageMaker, 2 x ml.trn1.32xlarge, distribution={"torch_distributed": {"enabled": True}}: the toolkit
# runs `torchrun --nnodes 2 --nproc_per_node 32 --master_addr algo-1 --master_port 7777 --node_rank 1`.
SAGEMAKER = {
    "SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2", "SM_NUM_GPUS": "0",
    "SM_NUM_NEURONS": "32", "SM_NUM_CPUS": "128", "SM_MODEL_DIR": "/opt/ml/model",
    "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train", "SM_CHANNEL_TEST": "/opt/ml/input/data/test",
    "SM_CURRENT_INSTANCE_TYPE": "ml.trn1.32xlarge",
}
SAGEMAKER_TORCHRUN = {
    **SAGEMAKER, "RANK": "37", "LOCAL_RANK": "5", "WORLD_SIZE": "64", "LOCAL_WORLD_SIZE": "32",
    "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "algo-1", "MASTER_PORT": "7777",
    "TORCHELASTIC_RESTART_COUNT": "0",
}

# srun --nodes 3 --ntasks-per-node 2 python train.py (job 123456), task 3 on the second node.
SLURM = {
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_NTASKS": "6", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "3",
    "SLURM_STEP_NUM_NODES": "3", "SLURM_JOB_NODELIST": "gpu[01-03,07]",
    "SLURM_STEP_NODELIST": "gpu[02-03,07]", "SLURM_NODELIST": "gpu[01-03,07]",
    "SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_STEP_TASKS_PER_NODE": "2(x3)",
}

# mpirun -np 16 --map-by ppr:8:node -x MASTER_ADDR=ip-10-0-0-1 python train.py, rank 9.
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "OMPI_COMM_WORLD_NODE_RANK": "1", "MASTER_ADDR": "ip-10-0-0-1",
    "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
}


def with_(base, **changes):
    out = {k: v for k, v in base.items() if k not in changes or changes[k] is not None}
    out.update({k: v for k, v in changes.items() if v is not None})
    return out


def test_single_process():
    assert process_env({}) == ProcessEnv()
    assert not process_env({"PATH": "/usr/bin"}).is_multi_process


def test_torchrun_multi_node():
    env = process_env(TORCHRUN)
    assert (env.process_id, env.num_processes, env.local_rank, env.local_world_size) == (6, 8, 2, 4)
    assert (env.node_rank, env.num_nodes, env.restart_count) == (1, 2, 2)
    assert env.coordinator == f"10.0.0.5:{29400 + COORDINATOR_PORT_OFFSET}"
    assert env.master_addr == "10.0.0.5"
    assert (env.launcher, env.cluster) == (Launcher.TORCHRUN, Cluster.LOCAL)
    assert env.launcher == "torchrun"  # str enum: compares with the plain name


def test_coordinator_overrides():
    assert process_env(with_(TORCHRUN, XTRAIN_COORDINATOR_PORT="5000")).coordinator == "10.0.0.5:5000"
    assert process_env(with_(TORCHRUN, XTRAIN_COORDINATOR="head:6000")).coordinator == "head:6000"
    with pytest.raises(LaunchError, match=r"XTRAIN_COORDINATOR='head' must be 'host:port'"):
        process_env(with_(TORCHRUN, XTRAIN_COORDINATOR="head"))


@pytest.mark.parametrize("drop, named", [
    ("WORLD_SIZE", "WORLD_SIZE not set"),
    ("MASTER_ADDR", "MASTER_ADDR not set"),
    ("RANK", "RANK not set"),
    ("LOCAL_WORLD_SIZE", "LOCAL_RANK is set but LOCAL_WORLD_SIZE is not"),
])
def test_torchrun_partial(drop, named):
    with pytest.raises(LaunchError, match=named):
        process_env(with_(TORCHRUN, **{drop: None}))


@pytest.mark.parametrize("changes, message", [
    (dict(RANK="8"), "RANK=8 is outside WORLD_SIZE=8"),
    (dict(WORLD_SIZE="10"), "WORLD_SIZE=10 is not a multiple of LOCAL_WORLD_SIZE=4"),
    (dict(GROUP_WORLD_SIZE="3"), "GROUP_WORLD_SIZE=3 disagrees with WORLD_SIZE=8"),
    (dict(RANK="two"), "RANK='two' is not an integer"),
    (dict(LOCAL_RANK="4"), "LOCAL_RANK=4 is outside LOCAL_WORLD_SIZE=4"),
])
def test_torchrun_inconsistent(changes, message):
    with pytest.raises(LaunchError, match=message):
        process_env(with_(TORCHRUN, **changes))


def test_sagemaker_torch_distributed_on_trn1():
    env = process_env(SAGEMAKER_TORCHRUN)
    assert (env.launcher, env.cluster) == (Launcher.TORCHRUN, Cluster.SAGEMAKER)
    assert (env.process_id, env.num_processes, env.node_rank, env.num_nodes) == (37, 64, 1, 2)
    assert env.hosts == ("algo-1", "algo-2")
    assert env.devices_per_process == 1  # 32 NeuronCores over 32 processes on the node
    assert env.coordinator == f"algo-1:{7777 + COORDINATOR_PORT_OFFSET}"
    assert env.instance_type == "trn1.32xlarge"
    assert env.model_dir == "/opt/ml/model"
    assert env.data_channels == (("test", "/opt/ml/input/data/test"), ("train", "/opt/ml/input/data/train"))


def test_sagemaker_torchrun_per_node_on_p4d():
    sm = with_(SAGEMAKER, SM_NUM_GPUS="8", SM_NUM_NEURONS="0", SM_CURRENT_INSTANCE_TYPE="ml.p4d.24xlarge")
    env = process_env({**sm, "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "1", "MASTER_ADDR": "algo-1", "MASTER_PORT": "7777"})
    assert env.devices_per_process == 8 and env.instance_type == "p4d.24xlarge"


def test_sagemaker_without_distribution_runs_one_process_per_host():
    env = process_env(SAGEMAKER)
    assert (env.launcher, env.cluster) == (Launcher.SAGEMAKER, Cluster.SAGEMAKER)
    assert (env.process_id, env.num_processes, env.node_rank, env.num_nodes) == (1, 2, 1, 2)
    assert env.devices_per_process == 32
    assert env.coordinator == f"algo-1:{29500 + COORDINATOR_PORT_OFFSET}"
    single = process_env(with_(SAGEMAKER, SM_HOSTS='["algo-1"]', SM_CURRENT_HOST="algo-1"))
    assert not single.is_multi_process and single.cluster is Cluster.SAGEMAKER


@pytest.mark.parametrize("changes, message", [
    (dict(SM_HOSTS="algo-1,algo-2"), r"SM_HOSTS='algo-1,algo-2' is not a JSON list"),
    (dict(SM_CURRENT_HOST="algo-9"), r"SM_CURRENT_HOST='algo-9' is not in SM_HOSTS"),
    (dict(SM_CURRENT_HOST=None), "SM_CURRENT_HOST not set"),
    (dict(SM_HOSTS='["algo-1", "algo-2", "algo-3"]'), "SM_HOSTS lists 3 hosts but the job has 64 processes"),
    (dict(GROUP_RANK="0", RANK="5"), "is host 1 of SM_HOSTS but torchrun's GROUP_RANK=0"),
    (dict(SM_NUM_NEURONS="30"), "SM_NUM_NEURONS=30 cannot be split evenly over 32 processes per node"),
])
def test_sagemaker_bad(changes, message):
    with pytest.raises(LaunchError, match=message):
        process_env(with_(SAGEMAKER_TORCHRUN, **changes))


def test_slurm_srun():
    env = process_env(SLURM)
    assert (env.launcher, env.cluster) == (Launcher.SLURM, Cluster.SLURM)
    assert (env.process_id, env.num_processes, env.local_rank, env.local_world_size) == (3, 6, 1, 2)
    assert (env.node_rank, env.num_nodes) == (1, 3)
    # The step's node list wins over the job's; the port follows jax's job-id rule.
    assert env.hosts == ("gpu02", "gpu03", "gpu07")
    assert env.coordinator == f"gpu02:{123456 % 4096 + 61440}"
    assert process_env(with_(SLURM, MASTER_PORT="30000")).coordinator == f"gpu02:{30000 + COORDINATOR_PORT_OFFSET}"


def test_slurm_tasks_per_node_without_ntasks_per_node():
    env = process_env(with_(SLURM, SLURM_NTASKS_PER_NODE=None, SLURM_STEP_TASKS_PER_NODE="3,2(x2)",
                            SLURM_NTASKS="7", SLURM_PROCID="4", SLURM_NODEID="1"))
    assert env.local_world_size == 2


@pytest.mark.parametrize("changes, message", [
    (dict(SLURM_NTASKS=None), "SLURM_PROCID is set but SLURM_NTASKS is not"),
    (dict(SLURM_LOCALID=None), "SLURM_LOCALID not set"),
    (dict(SLURM_STEP_NODELIST=None, SLURM_JOB_NODELIST=None, SLURM_NODELIST=None), "names no host for rank 0"),
    (dict(SLURM_STEP_ID=None), "SLURM_PROCID=3 but SLURM_STEP_ID is unset"),
    (dict(SLURM_STEP_NODELIST="gpu[03-01]"), "Slurm host range '03-01'"),
])
def test_slurm_bad(changes, message):
    with pytest.raises(LaunchError, match=message):
        process_env(with_(SLURM, **changes))


def test_slurm_batch_script_is_not_a_launch():
    # The sbatch script's own variables describe the allocation, not this process.
    batch = with_(SLURM, SLURM_STEP_ID=None, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    assert process_env(batch) == ProcessEnv()
    assert process_env(with_(batch, SLURM_STEP_ID="batch")) == ProcessEnv()


def test_torchrun_under_srun_one_per_node():
    # srun --ntasks-per-node=1 torchrun --nnodes 3 --nproc_per_node 4 ...
    slurm = with_(SLURM, SLURM_NTASKS="3", SLURM_NTASKS_PER_NODE="1", SLURM_PROCID="1", SLURM_LOCALID="0")
    torchrun = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "4",
                "GROUP_RANK": "1", "MASTER_ADDR": "gpu02", "MASTER_PORT": "29500"}
    env = process_env({**slurm, **torchrun})
    assert (env.launcher, env.cluster, env.num_processes, env.num_nodes) == (Launcher.TORCHRUN, Cluster.SLURM, 12, 3)
    assert env.hosts == ("gpu02", "gpu03", "gpu07")
    with pytest.raises(LaunchError, match=r"torchrun and Slurm disagree on the job size: WORLD_SIZE=12 .* SLURM_NTASKS"):
        process_env({**SLURM, **torchrun})


def test_openmpi():
    env = process_env(OPENMPI)
    assert (env.launcher, env.process_id, env.num_processes, env.local_rank, env.local_world_size) == (
        Launcher.MPI, 9, 16, 1, 8)
    assert (env.node_rank, env.num_nodes) == (1, 2)
    assert env.coordinator == f"ip-10-0-0-1:{29500 + COORDINATOR_PORT_OFFSET}"
    assert process_env(with_(OPENMPI, XTRAIN_COORDINATOR="10.1.1.1:7000")).coordinator == "10.1.1.1:7000"
    # Without MASTER_ADDR: mpirun's host from Open MPI's URI, as jax does.
    assert process_env(with_(OPENMPI, MASTER_ADDR=None)).coordinator_host == "10.96.0.1"


def test_pmi_mpich():
    env = process_env({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
                       "XTRAIN_COORDINATOR": "head:9000"})
    assert (env.launcher, env.process_id, env.num_processes, env.node_rank, env.num_nodes) == (Launcher.MPI, 3, 4, 1, 2)
    assert env.coordinator == "head:9000"


@pytest.mark.parametrize("env, message", [
    (with_(OPENMPI, OMPI_COMM_WORLD_SIZE=None), "OMPI_COMM_WORLD_SIZE not set"),
    ({"PMI_RANK": "0"}, "PMI_SIZE not set"),
    (with_(OPENMPI, MASTER_ADDR=None, OMPI_MCA_orte_hnp_uri=None), "names no coordinator: set XTRAIN_COORDINATOR"),
    ({**OPENMPI, "RANK": "2", "WORLD_SIZE": "16", "MASTER_PORT": "1"},
     r"torchrun \(RANK=2, WORLD_SIZE=16\) and MPI \(OMPI_COMM_WORLD_RANK=9"),
])
def test_mpi_bad(env, message):
    with pytest.raises(LaunchError, match=message):
        process_env(env)


def test_sagemaker_mpi():
    # distribution={"mpi": {"enabled": True, "processes_per_host": 8}} on 2 x ml.p4d.24xlarge
    env = {**with_(SAGEMAKER, SM_NUM_GPUS="8", SM_NUM_NEURONS="0"), **with_(OPENMPI, MASTER_ADDR=None)}
    job = process_env(env)
    assert (job.launcher, job.cluster, job.coordinator_host, job.devices_per_process, job.node_rank) == (
        Launcher.MPI, Cluster.SAGEMAKER, "algo-1", 1, 1)


def test_hostlist():
    assert expand_hostlist("node[01-03,07]") == ["node01", "node02", "node03", "node07"]
    assert expand_hostlist("a1,b[8-10],c") == ["a1", "b8", "b9", "b10", "c"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(LaunchError, match="unbalanced bracket"):
        expand_hostlist("node[01-02")


def test_process_env_is_frozen_and_validates():
    env = process_env(TORCHRUN)
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.process_id = 0
    with pytest.raises(TypeError):
        ProcessEnv(0, 1)  # keyword-only
    with pytest.raises(LaunchError, match="needs a coordinator"):
        ProcessEnv(num_processes=2)
