"""Every instance type SageMaker sizes clusters with: p3 (V100, no bf16: plans in fp16 with loss
scaling), p3dn, p4de, p5e/p5en; their topologies, profiles, the plan search for them and the
precision rule."""
import os
import re
import subprocess
import sys

import pytest
import torch

import xtrain
from models import GPT, token_batches
from neuron_support import emulate, topology
from xtrain.cost import hardware, search
from xtrain.errors import OptionsError, UnsupportedError
from xtrain.frontend.structure import describe
from xtrain.frontend.torch_module import wrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.unit
@pytest.mark.parametrize("name,gpus,gib,network,efa", [
    ("p3.2xlarge", 1, 16, 10, 0), ("p3.8xlarge", 4, 16, 10, 0), ("p3.16xlarge", 8, 16, 25, 0),
    ("p3dn.24xlarge", 8, 32, 100, 100), ("p4de.24xlarge", 8, 80, 400, 400), ("p5e.48xlarge", 8, 141, 3200, 3200),
    ("p5en.48xlarge", 8, 141, 3200, 3200)])
def test_topologies_and_profiles(name, gpus, gib, network, efa):
    t = topology.instance(f"ml.{name}")
    assert (t.devices, t.hbm_gib_per_chip, t.network_gbit_s, t.efa_gbit_s) == (gpus, gib, network, efa)
    profile = hardware.profile(name)
    assert profile.devices_per_node == gpus and profile.inter_node_bytes_per_s == network / 8 * 1e9 / gpus
    assert profile.plan_precision == ("fp16" if name.startswith("p3") else "fp32")


@pytest.mark.unit
def test_v100_peaks_and_no_bf16():
    assert hardware.peak_flops("Tesla V100-SXM2-16GB", "fp16") == 125e12
    assert hardware.peak_flops("Tesla V100-SXM2-32GB", "fp32") == 15.7e12
    assert hardware.peak_flops("Tesla V100-SXM2-16GB", "bf16") is None
    assert hardware.profile("p3.16xlarge").matmul_flops_per_s("float32") == 15.7e12  # no TF32 on Volta


@pytest.mark.e2e
def test_bf16_on_v100_is_an_error_naming_fp16(monkeypatch):
    message = "has no bfloat16 arithmetic; use Plan(precision='fp16'), which adds dynamic loss scaling, or 'fp32'"
    v100 = message.replace("; use", " (NVIDIA V100); use")
    with pytest.raises(UnsupportedError, match=re.escape("p3.16xlarge " + v100)):
        hardware.profile("p3.16xlarge").check_precision("bf16")
    with pytest.raises(UnsupportedError, match=re.escape("Tesla V100-SXM2-32GB " + message)):
        hardware.check_device_precision("Tesla V100-SXM2-32GB", "bf16")
    hardware.check_device_precision("NVIDIA A100-SXM4-40GB", "bf16")
    # a script flying a p3 cluster on CPU (xtrain.init(emulate="p3.16xlarge:2")) is refused alike
    monkeypatch.setattr("xtrain.runtime.emulated_cluster", lambda: emulate.virtual_cluster("p3.16xlarge:2", devices=8))
    model = GPT()
    with pytest.raises(UnsupportedError, match=re.escape("p3.16xlarge has no bfloat16 arithmetic (NVIDIA V100)")):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       plan=xtrain.Plan(precision="bf16"))


@pytest.mark.unit
def test_unknown_types_name_the_known_ones():
    with pytest.raises(OptionsError, match=r"unknown instance type 'p3.4xlarge'; known: .*p3.2xlarge, p3.8xlarge, "
                                           r"p3.16xlarge, p3dn.24xlarge"):
        topology.instance("p3.4xlarge")


@pytest.mark.e2e
def test_p3dn_search_plans_in_fp16():
    torch.manual_seed(0)
    model = GPT()
    trainable = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = tuple(t.numpy() for t in token_batches(n=1, batch=16)[0])
    profile, devices = hardware.target("p3dn.24xlarge")
    result = search.search(trainable.model, trainable.tx, batch, profile, devices, structure=describe(model),
                           pipe_degrees=(1,), candidate_list=search.candidates(devices, profile, remat=(False,),
                                                                                zero_stages=(0, 3)))
    assert result.best is not None and result.best.candidate.precision == "fp16"
    megatron = search.tensor_plan(trainable.model, batch)  # Candidate.plan takes the Megatron plan per mesh
    assert all(r.candidate.precision == "fp16" and r.candidate.plan(megatron).precision.loss_scale is not None
               for r in result.rows)
    assert result.best.cost.flops.matmul_dtype == "float16"  # lowered in fp16, costed at V100's fp16 peak
    assert "precision: fp16 with dynamic loss scaling" in str(result)


@pytest.mark.multiprocess
def test_cli_plan_for_two_p3_16xlarge_lists_fp16_plans():
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "1"}
    out = subprocess.run([sys.executable, "-m", "xtrain.cli", "plan", "--target", "p3.16xlarge:2",
                          os.path.join(ROOT, "examples", "train_gpt.py"), "--layers", "1", "--d-model", "32",
                          "--batch", "32", "--seq", "16", "--metrics", "", "--plot", ""],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "xtrain plan for p3.16xlarge:2 (16 devices)" in out.stdout
    assert re.search(r"^\* \S+ fp16", out.stdout, re.M) and "dp16 zero1 fp16" in out.stdout
    assert "network 25 Gbit/s (no EFA)" in out.stdout


@pytest.mark.multiprocess
def test_cli_plan_precision_sets_every_candidates_and_a_missing_one_is_refused_first():
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "1"}
    example = [os.path.join(ROOT, "examples", "train_gpt.py"), "--layers", "1", "--d-model", "32", "--batch", "32",
               "--seq", "16", "--metrics", "", "--plot", ""]
    plan = lambda *opts: subprocess.run([sys.executable, "-m", "xtrain.cli", "plan", *opts, *example],
                                        capture_output=True, text=True, env=env, timeout=300)
    out = plan("--target", "p4d.24xlarge", "--precision", "bf16")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = re.findall(r"^[* ] (dp\S*(?: \S+)*?) +\d", out.stdout, re.M)
    assert rows and all(r.endswith("bf16") for r in rows), rows
    assert "precision='bf16'" in out.stdout.split("as code", 1)[1]  # the pick, as code, keeps it
    # V100 has no bf16: refused before the script runs (no trace, no search)
    bad = plan("--target", "p3.16xlarge", "--precision", "bf16")
    assert bad.returncode == 2 and "has no bfloat16 arithmetic (NVIDIA V100)" in bad.stderr, bad.stderr[-2000:]
    assert "xtrain plan for" not in bad.stdout
