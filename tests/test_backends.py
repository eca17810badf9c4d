"""Backend detection before JAX starts, device counts, per-backend variables, GPU pinning."""
import pytest

from xtrain.runtime import backends
from xtrain.runtime.devices import local_device_ids
from xtrain.runtime.launch import ProcessEnv, process_env


def detect(env=None, modules=(), files=()):
    return backends.detect_backend(env or {}, has_module=lambda m: m in modules, exists=lambda p: p in files)


def test_detection_order_and_overrides():
    assert detect() == "cpu"
    assert detect(modules={"jax_plugins.xla_cuda12"}, files={"/dev/nvidia0"}) == "cuda"
    both = dict(modules={"libneuronxla", "jax_plugins.xla_cuda12"}, files={"/dev/neuron0", "/dev/nvidia0"})
    assert detect(**both) == "neuron"                    # Neuron first
    assert detect(modules={"libneuronxla"}) == "cpu"     # plugin installed, no Neuron device
    assert detect({"XTRAIN_BACKEND": "cpu"}, **both) == "cpu"
    assert detect({"JAX_PLATFORMS": "gpu,cpu"}) == "cuda"
    with pytest.raises(ValueError, match="XTRAIN_BACKEND='tpu' names no backend xtrain runs on"):
        detect({"XTRAIN_BACKEND": "tpu"})


def test_instance_type():
    none = lambda path: None  # noqa: E731
    assert backends.instance_type({"XTRAIN_INSTANCE_TYPE": "trn1.2xlarge"}, read=none) == "trn1.2xlarge"
    assert backends.instance_type({"SM_CURRENT_INSTANCE_TYPE": "ml.trn1.32xlarge"}, read=none) == "trn1.32xlarge"
    assert backends.instance_type({}, read=lambda path: "p4d.24xlarge") == "p4d.24xlarge"
    assert backends.instance_type({}, read=lambda path: "Standard PC (i440FX)") is None


def test_local_device_counts_and_default_processes():
    assert backends.local_device_count("cuda", {"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3
    nvidia = lambda pattern: ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]  # noqa: E731
    assert backends.local_device_count("cuda", {}, devices=nvidia) == 2
    assert backends.local_device_count("neuron", {"NEURON_RT_VISIBLE_CORES": "0-31"}) == 32
    assert backends.local_device_count("neuron", {"XTRAIN_INSTANCE_TYPE": "trn2.48xlarge"}) == 64
    assert backends.default_nproc_per_node("cuda", local_devices=8) == 8
    assert backends.default_nproc_per_node("neuron", local_devices=32) == 1
    assert backends.default_nproc_per_node("neuron", layout="process-per-core", local_devices=32) == 32
    assert backends.default_nproc_per_node("cpu") == 1
    with pytest.raises(ValueError, match="cannot count the NeuronCores of this node; set XTRAIN_INSTANCE_TYPE"):
        backends.default_nproc_per_node("neuron", layout="process-per-core", local_devices=None)


def test_neuron_variables_follow_the_launch():
    per_core = process_env({"RANK": "3", "WORLD_SIZE": "32", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "32",
                            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    out = backends.backend_env("neuron", per_core, instance="trn1.32xlarge")
    assert (out["NEURON_RT_VISIBLE_CORES"], out["NEURON_PJRT_PROCESS_INDEX"]) == ("3", "3")
    assert backends.backend_env("neuron", ProcessEnv(), instance="trn1.32xlarge")["NEURON_RT_VISIBLE_CORES"] == "0-31"
    assert backends.backend_env("cuda", per_core, instance=None) == {}
    with pytest.raises(ValueError, match="set XTRAIN_INSTANCE_TYPE=trn1.32xlarge"):
        backends.backend_env("neuron", ProcessEnv(), instance=None)


def test_gpu_pinning_per_process():
    env = lambda lr, lws, dpp=None: ProcessEnv(process_id=lr, num_processes=lws, local_rank=lr,  # noqa: E731
                                               local_world_size=lws, coordinator="h:1", devices_per_process=dpp)
    assert local_device_ids(env(3, 8), "cuda") == [3]          # torchrun, one GPU per process
    assert local_device_ids(env(1, 2, dpp=4), "cuda") == [4, 5, 6, 7]
    assert local_device_ids(env(0, 1), "cuda") is None         # one process owns the node
    assert local_device_ids(env(1, 2), "cpu") is None
