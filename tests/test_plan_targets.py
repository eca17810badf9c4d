"""The plan search for real targets: Trainium candidates pass the Neuron conformance checker
(mesh axes reordered where that helps, the rest marked and never picked), one MFU definition
for every plan and for the monitor, and a hardware profile for every GPU AWS rents (A100 40/80GB,
H100, H200)."""
import functools

import numpy as np
import pytest
import torch

import xtrain
from models import GPT, token_batches
from neuron_support import conformance
from xtrain import observe
from xtrain.cost import hardware, search
from xtrain.cost.program import abstract_step, trainable_of
from xtrain.errors import UnsupportedError
from xtrain.frontend.structure import describe
from xtrain.frontend.torch_module import wrap
from xtrain.ir.analysis import flops

TRN1_4 = "trn1.32xlarge:4"
BATCH = (np.zeros((128, 16), np.int32),) * 2


@functools.cache
def gpt():
    torch.manual_seed(0)
    model = GPT(layers=2)
    trainable = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model, trainable.model, trainable.tx


def trn_candidates():
    C = search.Candidate
    return [C(data=128), C(data=64, tensor=2), C(data=32, tensor=4),
            C(data=32, tensor=2, pipe=2, microbatches=2), C(data=8, tensor=8, pipe=2, microbatches=2)]


def row_of(result, data, tensor=1, pipe=1):
    return next(r for r in result.rows if (r.candidate.data, r.candidate.tensor, r.candidate.pipe) == (data, tensor, pipe))


@functools.cache
def trn1_result():
    model, wrapped, tx = gpt()
    profile, devices = hardware.target(TRN1_4)
    return search.search(wrapped, tx, BATCH, profile, devices, structure=describe(model),
                         candidate_list=trn_candidates())


def rejected(candidate) -> list:
    """The checker's errors for `candidate`'s program, lowered for Neuron over its own mesh order."""
    _, wrapped, tx = gpt()
    traced = abstract_step(trainable_of(wrapped, tx), candidate.mesh, candidate.plan(search.tensor_plan(wrapped, BATCH)), BATCH, platform="neuron")
    found = conformance.check(traced.hlo, conformance.Target.for_instance("trn1.32xlarge"))
    return [f for f in found if f.severity is conformance.Severity.ERROR]


@pytest.mark.e2e
def test_trn1_plan_search_never_picks_a_plan_the_checker_rejects():
    result = trn1_result()
    assert result.best is not None and not result.best.findings
    assert rejected(result.best.candidate) == []
    # tensor=8 with two stages: in every axis order some group or permute breaks trn1's rules
    bad = row_of(result, 8, tensor=8, pipe=2)
    assert bad.findings and not bad.usable and "rejects it in every mesh-axis order: " in bad.reason
    assert bad.reason in str(result) and bad.candidate.mesh == {"data": 8, "pipe": 2, "tensor": 8}
    # 64-way data parallel, tensor innermost, puts 16 cores of a node in a group (not a trn1
    # size): the search lays "data" innermost instead (whole nodes), tensor pairs across nodes
    dp64 = row_of(result, 64, tensor=2)
    assert rejected(search.Candidate(data=64, tensor=2))[0].rule == "replica-groups"
    assert list(dp64.candidate.mesh) == ["tensor", "data"] and rejected(dp64.candidate) == []
    assert all(r.usable == (not r.findings and r.prediction.fits) for r in result.rows if r.prediction)


@pytest.mark.e2e
def test_pipeline_stages_move_to_neighbouring_cores_when_tensor_innermost_is_rejected():
    default = search.Candidate(data=32, tensor=2, pipe=2, microbatches=2)
    (error, *_) = rejected(default)  # data, pipe, tensor: stage s -> s + 1 is two cores away
    assert error.rule == "permute-ring" and "0 -> 2 is not a step between adjacent ranks" in error.message
    row = row_of(trn1_result(), 32, tensor=2, pipe=2)
    order = list(row.candidate.mesh)
    assert order != ["data", "pipe", "tensor"] and order.index("pipe") > order.index("tensor"), order
    short = {"data": "dp32", "tensor": "tp2", "pipe": "pp2"}
    assert row.candidate.name.startswith("x".join(short[a] for a in order))
    assert not row.findings and row.usable and rejected(row.candidate) == []


@pytest.mark.e2e
def test_mfu_counts_the_models_flops_the_same_way_for_every_plan():
    model, wrapped, tx = gpt()
    result = trn1_result()
    model_flops = flops.model_flops(wrapped, wrapped.param_shapes(), {}, np.zeros(2, np.uint32), BATCH)
    peak = result.profile.matmul_flops_per_s("float32")
    for row in (r for r in result.rows if r.prediction):
        p = row.prediction
        assert p.mfu == pytest.approx(model_flops / (p.step_s * 128 * peak), rel=1e-9), row.candidate.name
    # the monitor's definition is the same function of the same graph
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    batch = token_batches(n=1, batch=128)[0]
    assert observe.model_flops(step, *batch) == pytest.approx(model_flops, rel=1e-12)
    assert observe.utilisation(model_flops, 0.5, 128, peak)["mfu"] == pytest.approx(flops.mfu(model_flops, 0.5, 128, peak))


@pytest.mark.unit
@pytest.mark.parametrize("kind, instance, hbm_gib", [
    ("NVIDIA A100-SXM4-40GB", "p4d.24xlarge", 40), ("NVIDIA A100-SXM4-80GB", "p4de.24xlarge", 80),
    ("NVIDIA H100 80GB HBM3", "p5.48xlarge", 80), ("NVIDIA H200", "p5e.48xlarge", 141)])
def test_every_aws_gpu_has_its_own_profile(kind, instance, hbm_gib):
    profile = hardware.profile_for_device("gpu", kind)
    assert profile.name == instance and profile.hbm_bytes == hbm_gib * 2**30
    assert profile.matmul_flops_per_s("bf16") == hardware.peak_flops(kind, "bf16")
    with pytest.raises(UnsupportedError, match="no hardware profile for device kind 'NVIDIA B200'"):
        hardware.profile_for_device("gpu", "NVIDIA B200")


@pytest.mark.e2e
def test_zero3_in_fp32_lowers_for_neuron_without_reduce_precision():
    # ZeRO-3 re-gathers parameters in the backward pass through jax.checkpoint, and JAX rounds
    # each residual of such a region to its own type (reduce_precision, identity in fp32), which
    # Neuron refuses. Lowered for Neuron those roundings are left out; for CPU they stay.
    _, wrapped, tx = gpt()
    candidate = search.Candidate(data=128, zero=3)
    plan = candidate.plan(search.tensor_plan(wrapped, BATCH))
    on_cpu = abstract_step(trainable_of(wrapped, tx), candidate.mesh, plan, BATCH, platform="cpu")
    assert "reduce-precision" in on_cpu.hlo
    assert rejected(candidate) == []
