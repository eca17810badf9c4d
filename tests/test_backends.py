"""Backend detection before JAX starts, device counts, per-backend variables and XLA flags, GPU pinning."""
import os
import subprocess
import sys

import pytest

from xtrain.errors import LaunchError, OptionsError
from xtrain.runtime import backends
from xtrain.runtime.devices import local_device_ids
from xtrain.runtime.launch import ProcessEnv, process_env


def detect(env=None, modules=(), files=()):
    return backends.detect_backend(env or {}, has_module=lambda m: m in modules, exists=lambda p: p in files)


@pytest.mark.unit
def test_detection_order_and_overrides():
    assert detect() == "cpu"
    assert detect(modules={"jax_plugins.xla_cuda12"}, files={"/dev/nvidia0"}) == "cuda"
    both = dict(modules={"libneuronxla", "jax_plugins.xla_cuda12"}, files={"/dev/neuron0", "/dev/nvidia0"})
    assert detect(**both) == "neuron"                    # Neuron first
    assert detect(modules={"libneuronxla"}) == "cpu"     # plugin installed, no Neuron device
    assert detect({"XTRAIN_BACKEND": "cpu"}, **both) == "cpu"
    assert detect({"JAX_PLATFORMS": "gpu,cpu"}) == "cuda"
    with pytest.raises(LaunchError, match="XTRAIN_BACKEND='tpu' names no backend xtrain runs on"):
        detect({"XTRAIN_BACKEND": "tpu"})


@pytest.mark.unit
def test_instance_type():
    none = lambda path: None  # noqa: E731
    assert backends.instance_type({"XTRAIN_INSTANCE_TYPE": "trn1.2xlarge"}, read=none) == "trn1.2xlarge"
    assert backends.instance_type({"SM_CURRENT_INSTANCE_TYPE": "ml.trn1.32xlarge"}, read=none) == "trn1.32xlarge"
    assert backends.instance_type({}, read=lambda path: "p4d.24xlarge") == "p4d.24xlarge"
    assert backends.instance_type({}, read=lambda path: "Standard PC (i440FX)") is None


@pytest.mark.unit
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
    with pytest.raises(LaunchError, match="cannot count the NeuronCores of this node; set XTRAIN_INSTANCE_TYPE"):
        backends.default_nproc_per_node("neuron", layout="process-per-core", local_devices=None)


@pytest.mark.unit
def test_neuron_variables_follow_the_launch():
    per_core = process_env({"RANK": "3", "WORLD_SIZE": "32", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "32",
                            "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    out = backends.backend_env("neuron", per_core, instance="trn1.32xlarge")
    assert (out["NEURON_RT_VISIBLE_CORES"], out["NEURON_PJRT_PROCESS_INDEX"]) == ("3", "3")
    assert backends.backend_env("neuron", ProcessEnv(), instance="trn1.32xlarge")["NEURON_RT_VISIBLE_CORES"] == "0-31"
    assert backends.backend_env("cuda", per_core, instance=None) == {}
    with pytest.raises(LaunchError, match="set XTRAIN_INSTANCE_TYPE=trn1.32xlarge"):
        backends.backend_env("neuron", ProcessEnv(), instance=None)


@pytest.mark.unit
def test_gpu_pinning_per_process():
    env = lambda lr, lws, dpp=None: ProcessEnv(process_id=lr, num_processes=lws, local_rank=lr,  # noqa: E731
                                               local_world_size=lws, coordinator="h:1", devices_per_process=dpp)
    assert local_device_ids(env(3, 8), "cuda") == [3]          # torchrun, one GPU per process
    assert local_device_ids(env(1, 2, dpp=4), "cuda") == [4, 5, 6, 7]
    assert local_device_ids(env(0, 1), "cuda") is None         # one process owns the node
    assert local_device_ids(env(1, 2), "cpu") is None


# -- XLA flags per backend, checked against the installed XLA ------------------------------------

@pytest.mark.multiprocess
def test_probe_rejects_unknown_flags_and_values_and_accepts_gpu_flags_on_cpu():
    # XLA parses GPU flags on a CPU start too, so this machine can vet them for a GPU one.
    assert backends.probe_xla_flags(["--xla_gpu_enable_latency_hiding_scheduler=true"])
    assert not backends.probe_xla_flags(["--xla_gpu_enable_latency_hiding_scheduler=true", "--xla_no_such_flag=1"])
    assert not backends.probe_xla_flags(["--xla_gpu_enable_latency_hiding_scheduler=maybe"])


@pytest.mark.unit
def test_cuda_flags_are_latency_hiding_and_combining_up_to_one_gradient_bucket():
    from xtrain.lowering.gradient_sync import GradSync

    assert backends.GPU_COMBINE_THRESHOLD_BYTES == GradSync().bucket_bytes
    assert backends.default_xla_flags("cuda") == (
        "--xla_gpu_enable_latency_hiding_scheduler=true",
        "--xla_gpu_all_reduce_combine_threshold_bytes=26214400",
        "--xla_gpu_all_gather_combine_threshold_bytes=26214400",
        "--xla_gpu_reduce_scatter_combine_threshold_bytes=26214400",
        "--xla_gpu_enable_pipelined_all_gather=true")
    assert backends.default_xla_flags("neuron") == ()
    user = "--xla_gpu_all_reduce_combine_threshold_bytes=1 --xla_dump_to=/tmp/d"
    merged = backends.merge_xla_flags(user, backends.cuda_xla_flags()).split()
    assert merged[:2] == user.split() and "--xla_gpu_all_reduce_combine_threshold_bytes=26214400" not in merged
    assert len(merged) == 6


@pytest.mark.unit
def test_supported_flags_probe_once_per_jaxlib_version(tmp_path):
    calls = []

    def probe(flags):
        calls.append(list(flags))
        return not any("bogus" in f for f in flags)

    cache = tmp_path / "xla_flags.json"
    flags = ("--xla_a=1", "--xla_bogus=1", "--xla_b=2")
    assert backends.supported_xla_flags(flags, probe=probe, cache_file=cache, version="1.0") == ("--xla_a=1", "--xla_b=2")
    assert calls == [list(flags), ["--xla_a=1"], ["--xla_bogus=1"], ["--xla_b=2"]]  # the set, then one by one
    calls.clear()
    assert backends.supported_xla_flags(flags, probe=probe, cache_file=cache, version="1.0") == ("--xla_a=1", "--xla_b=2")
    assert calls == []                                                              # cached
    backends.supported_xla_flags(flags[:1], probe=probe, cache_file=cache, version="2.0")
    assert calls == [["--xla_a=1"]]                                                 # new jaxlib, new probe


@pytest.mark.multiprocess
def test_init_on_cuda_adds_the_flags_xla_accepts_and_keeps_the_users(tmp_path):
    # In a child: this process's JAX has started, and init sets flags only before it starts.
    code = ("import os; from xtrain.runtime import devices; from xtrain.runtime.launch import ProcessEnv; "
            "print(devices._apply_backend_env('cuda', ProcessEnv())['XLA_FLAGS'])")
    env = dict(os.environ, XTRAIN_CACHE_DIR=str(tmp_path), XLA_FLAGS="--xla_gpu_all_gather_combine_threshold_bytes=7")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["--xla_gpu_all_gather_combine_threshold_bytes=7",
                                  "--xla_gpu_enable_latency_hiding_scheduler=true",
                                  "--xla_gpu_all_reduce_combine_threshold_bytes=26214400",
                                  "--xla_gpu_reduce_scatter_combine_threshold_bytes=26214400",
                                  "--xla_gpu_enable_pipelined_all_gather=true"]
    assert "jaxlib " in (tmp_path / "xla_flags.json").read_text()  # probes recorded in xtrain's cache


TWO_NODES = ProcessEnv(num_processes=2, num_nodes=2, master_addr="10.0.0.1", coordinator="10.0.0.1:29517")


@pytest.mark.unit
def test_cuda_sets_libfabric_over_efa_between_instances_only():
    efa = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
    assert backends.backend_env("cuda", TWO_NODES, instance="p4d.24xlarge", efa=True) == efa
    assert backends.backend_env("cuda", TWO_NODES, instance=None, efa=False) == {}   # no EFA: sockets
    assert backends.backend_env("cuda", ProcessEnv(), instance="p5.48xlarge", efa=True) == {}  # NVLink only
    sysfs = {"/sys/class/infiniband/rdmap16s27": "/sys/bus/pci/drivers/efa", "/sys/class/infiniband/mlx5_0": "mlx5_core"}
    found = lambda drivers: backends.efa_present(devices=lambda pattern: list(drivers),  # noqa: E731
                                                 driver=lambda path: drivers[path.rsplit("/device/", 1)[0]])
    assert found(sysfs) and not found({k: v for k, v in sysfs.items() if "mlx" in k}) and not found({})


@pytest.mark.unit
def test_neuron_compiler_flags_and_rounding_follow_the_plans_precision():
    env = lambda precision: backends.backend_env("neuron", TWO_NODES, instance="trn1.32xlarge",  # noqa: E731
                                                 precision=precision)
    assert env("fp32")["NEURON_CC_FLAGS"].endswith("--target trn1 --auto-cast none")
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN" not in env("fp32")
    bf16 = env("bf16")
    assert bf16["NEURON_CC_FLAGS"].endswith("--auto-cast none --enable-mixed-precision-accumulation")
    assert bf16["NEURON_RT_STOCHASTIC_ROUNDING_EN"] == "1"
    assert "NEURON_RT_STOCHASTIC_ROUNDING_EN" not in env("fp16")  # fp16 scales its loss instead
    with pytest.raises(OptionsError, match="precision='int8' is not one of 'fp32', 'bf16', 'fp16', 'fp8'"):
        env("int8")


@pytest.mark.unit
def test_a_plan_of_another_precision_than_init_is_an_error_naming_the_fix():
    applied = backends.backend_env("neuron", TWO_NODES, instance="trn1.32xlarge")
    backends.check_precision("fp32", "fp32", applied)
    backends.check_precision("bf16", "fp32", {})           # the user set the variables: theirs
    with pytest.raises(LaunchError, match=r"precision is 'bf16' but xtrain.init\(\) started the Neuron runtime for "
                                          r"'fp32' \(NEURON_CC_FLAGS=.*xtrain.init\(precision='bf16'\)"):
        backends.check_precision("bf16", "fp32", applied)


@pytest.mark.unit
def test_init_refuses_an_unknown_precision():
    from xtrain.runtime import devices

    with pytest.raises(OptionsError, match=r"xtrain.init\(precision='tf32'\): use one of fp32, bf16, fp16, fp8"):
        devices.init(precision="tf32")
