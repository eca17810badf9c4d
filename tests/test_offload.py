"""Plan(offload="optimizer"): the optimizer state lives in host memory (memory kind
"pinned_host") between steps and trains like torch; the report splits device and host bytes;
checkpoints move between offloaded and on-device plans; the plan search proposes offload when
a plan does not fit otherwise, charging its host transfers. The cost model of
Plan(offload="activations") (the lowering's tests: test_activation_offload.py): the estimate's
host bytes are the report's, charged as transfers, and the search proposes it too."""
import copy
import dataclasses
import re

import jax
import pytest
import torch

import xtrain
from models import GPT, token_batches
from test_cost import host_batch, wrapped_gpt
from xtrain.cost import hardware, search
from xtrain.errors import PlanError
from xtrain.sharding.offload import Offload
from xtrain.frontend.structure import describe
from xtrain.testing import assert_parity, run_parity, torch_reference

OFFLOAD = xtrain.Plan(offload="optimizer")
ACTIVATIONS = search.Candidate(data=2, offload="activations")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


@pytest.mark.e2e
def test_adam_state_on_the_host_matches_torch_and_the_report_splits_its_bytes(tmp_path):
    torch.manual_seed(0)
    model, batches = GPT(), token_batches(n=4)
    reference = torch_reference(model, adamw, batches)
    assert_parity(run_parity(model, adamw, batches, xtrain.Mesh(data=8), plan=OFFLOAD, reference=reference))

    candidate = copy.deepcopy(model)
    step = xtrain.compile(candidate, xtrain.Mesh(data=8), optimizer=adamw(candidate.parameters()), plan=OFFLOAD)
    for batch in batches[:2]:
        step(*batch)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(step.state.opt_state)} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in step.state.params.values()} == {"device"}
    state = step.report().state_memory
    moments = 2 * sum(p.numel() * 4 for p in model.parameters())  # Adam's mu and nu, fp32, replicated
    assert state["optimizer"] == 0 and moments <= state["optimizer_host"] <= moments + 64  # + the step count
    assert "S(5)" in step.compiled().as_text()  # the program takes and returns host-memory buffers

    # a checkpoint of the offloaded state resumes on the device under ZeRO-1 (and back)
    step.save(tmp_path / "mid")
    other = copy.deepcopy(model)
    plain = xtrain.compile(other, xtrain.Mesh(data=8), optimizer=adamw(other.parameters()), plan=xtrain.Plan(zero=1))
    plain.load(tmp_path / "mid")
    expected = [step(*b)["loss"] for b in batches[2:]]
    assert [plain(*b)["loss"] for b in batches[2:]] == pytest.approx(expected, rel=1e-6)


@pytest.mark.unit
def test_search_proposes_offload_when_nothing_else_fits():
    model, wrapped, tx = wrapped_gpt()
    profile = hardware.profile("p4d.24xlarge")
    tight = search.search(wrapped, tx, host_batch(batch=16), profile, 2, structure=describe(model),
                          pipe_degrees=(1,))
    plain = next(r for r in tight.rows if r.candidate.name == "dp2").prediction
    offloaded = next(r for r in tight.rows if r.candidate.name == "dp2 offload")
    assert offloaded.reason.startswith("not lowered: fits with the optimizer state on the device")
    activations = next(r for r in tight.rows if r.candidate.name == "dp2 act-offload")
    assert activations.reason.startswith("not lowered: fits with the activations on the device")
    assert not [r for r in tight.rows if r.candidate.offload is Offload.ACTIVATIONS and r.candidate.remat]
    # a device just too small for dp2's state: ZeRO and offload remain; an offloaded row is costed
    small = profile.with_memory(int(plain.memory_bytes * 0.97))
    result = search.search(wrapped, tx, host_batch(batch=16), small, 2, structure=describe(model), pipe_degrees=(1,),
                           candidate_list=[search.Candidate(data=2), search.Candidate(data=2, offload="optimizer")])
    row = result.best
    assert row.candidate.offload is Offload.OPTIMIZER and row.prediction.fits and row.prediction.offload_s > 0
    assert row.cost.memory.host == 2 * sum(p.numel() * 4 for p in model.parameters()) + 4
    assert row.candidate.plan(describe(model)).offload.value == "optimizer"


@pytest.mark.unit
def test_offload_values_name_what_is_supported():
    with pytest.raises(PlanError, match=re.escape("Plan(offload='gradients') must be one of ['none', 'optimizer', "
                                                  "'activations']")):
        xtrain.Plan(offload="gradients")
    assert "offload=optimizer" in str(OFFLOAD)


@pytest.mark.e2e
def test_activation_offload_estimate_counts_the_reports_host_bytes_and_charges_their_transfers():
    torch.manual_seed(0)
    # a batch whose saved activations outweigh the optimizer's temporaries: the peak is in the
    # backward pass, where the layers' inputs are held (at batch 64 it is in the update, where
    # offloading them saves nothing)
    layers, batch = 4, 256
    model, wrapped, tx = wrapped_gpt(layers=layers)
    profile = hardware.profile("p4d.24xlarge")
    candidate = search.Candidate(data=8, offload="activations")
    assert candidate.plan().offload is Offload.ACTIVATIONS
    row = search.evaluate(wrapped, tx, None, candidate, host_batch(batch=batch), profile)
    saving = search.evaluate(wrapped, tx, None, search.Candidate(data=8, remat=True), host_batch(batch=batch), profile)

    gpt = copy.deepcopy(model)
    step = xtrain.compile(gpt, xtrain.Mesh(data=8), optimizer=adamw(gpt.parameters()), plan=candidate.plan())
    x, y = token_batches(n=1, batch=batch)[0]
    reported = step.report(x, y).memory["activations_host"]
    assert reported == layers * (batch // 8) * 16 * 32 * 4  # each layer's input: batch/8 x seq x d, fp32
    memory = row.cost.memory
    assert memory.activations_host == memory.host == reported
    # the same recomputation as remat='full' with the residuals off the device: at most one layer's
    # input is back on the device at the peak (none when the peak is outside the backward's layers)
    saved = saving.cost.memory.total - memory.total
    assert reported - reported // layers <= saved <= reported, (saved, reported)
    # out in the forward pass and back in the backward, over the host link
    assert row.prediction.offload_s == pytest.approx(2 * reported / profile.host_bytes_per_s)
    assert row.prediction.step_s == pytest.approx(saving.prediction.step_s + row.prediction.offload_s)
    compiled = search.compiled_step_cost(step, x, y).memory
    assert compiled.source == "xla" and compiled.activations_host == compiled.host == reported


@pytest.mark.unit
def test_search_picks_activation_offload_when_the_plain_plan_does_not_fit():
    model, wrapped, tx = wrapped_gpt()
    profile = hardware.profile("p4d.24xlarge")
    pair = [search.Candidate(data=2), ACTIVATIONS]
    roomy = search.search(wrapped, tx, host_batch(batch=16), profile, 2, candidate_list=pair, prune_remat=False)
    plain, offloaded = (r.prediction.memory_bytes for r in roomy.rows)
    assert offloaded < plain
    small = profile.with_memory((plain + offloaded) // 2)
    result = search.search(wrapped, tx, host_batch(batch=16), small, 2, candidate_list=pair)
    assert not result.rows[0].prediction.fits and result.best is result.rows[1]
    assert result.best.prediction.offload_s > 0 and "dp2 act-offload" in str(result)
    assert result.best.candidate.plan().offload is Offload.ACTIVATIONS
    # no layer scan in a pipeline, and offloading already recomputes each layer
    with pytest.raises(PlanError, match=re.escape("Candidate(offload='activations', pipe=2)")):
        search.Candidate(data=1, pipe=2, offload="activations")
    with pytest.raises(PlanError, match=re.escape("Candidate(offload='activations', remat=True)")):
        search.Candidate(data=2, remat=True, offload="activations")
    with pytest.raises(PlanError, match=re.escape("Candidate(offload=True) must be one of ['none', 'optimizer', "
                                                  "'activations']")):
        search.Candidate(data=2, offload=True)
    # without a host link in the profile, no offload candidates at all
    no_link = dataclasses.replace(profile, host_bytes_per_s=None)
    assert all(c.offload is Offload.NONE for c in search.candidates(2, no_link))
    assert {c.offload for c in search.candidates(2, profile)} == set(Offload)
