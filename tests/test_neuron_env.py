"""neuron_support.topology and .env: instance tables, physical meshes, Neuron variables per layout."""
import pytest

from neuron_support import env as nenv
from neuron_support import topology
from xtrain.errors import LaunchError, MeshError, OptionsError
from xtrain.runtime.launch import ProcessEnv, process_env

pytestmark = pytest.mark.unit


def torchrun(rank, world, local_rank, local_world, master="10.0.0.5"):
    return process_env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
                        "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master, "MASTER_PORT": "29500"})


def test_topology_table():
    trn1 = topology.instance("ml.trn1.32xlarge")
    assert (trn1.chips, trn1.cores_per_chip, trn1.devices, trn1.hbm_gib_per_chip, trn1.efa_gbit_s) == (16, 2, 32, 32, 800)
    assert topology.instance("trn1n.32xlarge").efa_gbit_s == 1600
    assert topology.instance("trn2.48xlarge").devices == 64  # 16 chips x 8 cores at LNC=2
    assert topology.instance("p4d.24xlarge").devices == 8 and topology.instance("p5.48xlarge").efa_gbit_s == 3200
    with pytest.raises(OptionsError, match="unknown instance type 'trn9.large'; known: trn1.2xlarge"):
        topology.instance("trn9.large")


def test_physical_and_logical_meshes():
    assert topology.physical_axes("trn1.32xlarge", 2) == {"node": 2, "chip": 16, "core": 2}
    assert topology.physical_axes("p4d.24xlarge", 4) == {"node": 4, "gpu": 8}
    assert topology.mesh_axes("trn1.32xlarge", 4, tensor=8) == {"data": 16, "pipe": 1, "tensor": 8}
    assert topology.mesh_axes("trn1.32xlarge", 2, tensor=32, pipe=2) == {"data": 1, "pipe": 2, "tensor": 32}
    with pytest.raises(MeshError, match="tensor=16 is not a replica-group size trn1.32xlarge supports"):
        topology.mesh_axes("trn1.32xlarge", 1, tensor=16)
    with pytest.raises(MeshError, match="tensor=3 does not divide the 8 devices of one p4d.24xlarge"):
        topology.mesh_axes("p4d.24xlarge", 1, tensor=3)
    assert topology.parse_cluster("trn1.32xlarge:2")[1] == 2
    with pytest.raises(OptionsError, match="node count after ':' must be a positive integer"):
        topology.parse_cluster("trn1.32xlarge:x")


def test_process_per_node_two_trn1():
    out = nenv.neuron_env(torchrun(1, 2, 0, 1), "trn1.32xlarge", "process-per-node")
    assert out["NEURON_RT_ROOT_COMM_ID"] == f"10.0.0.5:{nenv.ROOT_COMM_PORT}"
    assert out["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == "32,32"
    assert out["NEURON_PJRT_PROCESS_INDEX"] == "1"
    assert out["NEURON_RT_VISIBLE_CORES"] == "0-31"
    assert (out["FI_PROVIDER"], out["FI_EFA_USE_DEVICE_RDMA"], out["FI_EFA_FORK_SAFE"]) == ("efa", "1", "1")
    assert out["NEURON_CC_FLAGS"] == "--model-type transformer -O1 --target trn1 --auto-cast none"
    assert out["NEURON_COMPILE_CACHE_URL"] == "/var/tmp/neuron-compile-cache"
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN" not in out


def test_process_per_core_torchrun():
    # torchrun --nnodes 2 --nproc_per_node 32: global rank 37 is core 5 of the second node.
    out = nenv.neuron_env(torchrun(37, 64, 5, 32), "trn1n.32xlarge", "process-per-core", precision="bf16",
                          optimization=2, compile_cache="s3://bucket/cache")
    assert out["NEURON_PJRT_PROCESSES_NUM_DEVICES"] == ",".join(["1"] * 64)
    assert (out["NEURON_PJRT_PROCESS_INDEX"], out["NEURON_RT_VISIBLE_CORES"]) == ("37", "5")
    assert out["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    # the program is already cast by the plan's policy: the compiler adds no casts of its own
    assert out["NEURON_CC_FLAGS"] == ("--model-type transformer -O2 --target trn1n --auto-cast none "
                                      "--enable-mixed-precision-accumulation")
    assert out["NEURON_COMPILE_CACHE_URL"] == "s3://bucket/cache"


def test_single_node_and_trn2():
    single = nenv.neuron_env(ProcessEnv(), "trn1.2xlarge")
    assert single["NEURON_RT_VISIBLE_CORES"] == "0-1" and "FI_PROVIDER" not in single
    assert single["NEURON_RT_ROOT_COMM_ID"] == f"localhost:{nenv.ROOT_COMM_PORT}"
    trn2 = nenv.neuron_env(ProcessEnv(), "trn2.48xlarge")
    assert trn2["NEURON_LOGICAL_NC_CONFIG"] == "2" and trn2["NEURON_RT_VISIBLE_CORES"] == "0-63"


@pytest.mark.parametrize("process, layout, message", [
    (torchrun(1, 4, 1, 2), "process-per-node", "LOCAL_WORLD_SIZE=2 processes x 32 cores exceed the 32 cores"),
    (torchrun(3, 64, 3, 64), "process-per-core", "launch at most 32 processes per node"),
])
def test_layout_mismatch(process, layout, message):
    with pytest.raises(LaunchError, match=message):
        nenv.neuron_env(process, "trn1.32xlarge", layout)


def test_bad_options():
    with pytest.raises(OptionsError, match="layout='process-per-chip' is not one of 'process-per-node'"):
        nenv.neuron_env(ProcessEnv(), "trn1.32xlarge", "process-per-chip")
    with pytest.raises(OptionsError, match="precision='int8' is not one of 'fp32', 'bf16'"):
        nenv.neuron_env(ProcessEnv(), "trn1.32xlarge", precision="int8")
    with pytest.raises(OptionsError, match=r"precision='fp8': trn1.32xlarge has no FP8 arithmetic.*trn2.48xlarge"):
        nenv.neuron_env(ProcessEnv(), "trn1.32xlarge", precision="fp8")
    fp8 = nenv.neuron_env(ProcessEnv(), "trn2.48xlarge", precision="fp8")  # bf16's flags: FP8 dots in the program
    assert fp8["NEURON_CC_FLAGS"].endswith("--auto-cast none --enable-mixed-precision-accumulation")
    assert fp8["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    with pytest.raises(OptionsError, match="optimization=4 is not a neuronx-cc level"):
        nenv.neuron_env(ProcessEnv(), "trn1.32xlarge", optimization=4)
    with pytest.raises(OptionsError, match="p4d.24xlarge has no NeuronCores"):
        nenv.neuron_env(ProcessEnv(), "p4d.24xlarge")
