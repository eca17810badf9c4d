"""Plan(offload="optimizer"): the optimizer state lives in host memory (memory kind
"pinned_host") between steps and trains like torch; the report splits device and host bytes;
checkpoints move between offloaded and on-device plans; the plan search proposes offload when
a plan does not fit otherwise, charging its host transfers."""
import copy
import re

import jax
import pytest
import torch

import xtrain
from models import GPT, token_batches
from test_cost import host_batch, wrapped_gpt
from xtrain.cost import hardware, search
from xtrain.frontend.structure import describe
from xtrain.testing import assert_parity, run_parity, torch_reference

OFFLOAD = xtrain.Plan(offload="optimizer")


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


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


def test_search_proposes_offload_when_nothing_else_fits():
    model, wrapped, tx = wrapped_gpt()
    profile = hardware.profile("p4d.24xlarge")
    tight = search.search(wrapped, tx, host_batch(batch=16), profile, 2, structure=describe(model),
                          pipe_degrees=(1,))
    plain = next(r for r in tight.rows if r.candidate.name == "dp2").prediction
    offloaded = next(r for r in tight.rows if r.candidate.name == "dp2 offload")
    assert offloaded.reason.startswith("not lowered: fits with the optimizer state on the device")
    # a device just too small for dp2's state: ZeRO and offload remain; an offloaded row is costed
    small = profile.with_memory(int(plain.memory_bytes * 0.97))
    result = search.search(wrapped, tx, host_batch(batch=16), small, 2, structure=describe(model), pipe_degrees=(1,),
                           candidate_list=[search.Candidate(data=2), search.Candidate(data=2, offload=True)])
    row = result.best
    assert row.candidate.offload and row.prediction.fits and row.prediction.offload_s > 0
    assert row.cost.memory.host == 2 * sum(p.numel() * 4 for p in model.parameters()) + 4
    assert row.candidate.plan(describe(model)).offload.value == "optimizer"


def test_offload_values_name_what_is_supported():
    with pytest.raises(ValueError, match=re.escape("Plan(offload='gradients') must be one of ['none', 'optimizer', "
                                                   "'activations']")):
        xtrain.Plan(offload="gradients")
    assert "offload=optimizer" in str(OFFLOAD)
