"""Gradient clipping by global norm across sharded parameters, and torch LR schedulers driving
the compiled step, against plain torch on one device."""
import copy
import functools

import numpy as np
import pytest
import torch

import xtrain
from xtrain import plans
from xtrain.errors import OptionsError
from xtrain.testing import ParityResult, assert_parity
from xtrain.testing.parity import PARAM_ATOL

from models import GPT, MLP, mlp_batches, token_batches

MAX_NORM = 0.5


def sgd(params):
    # SGD: every parameter difference is proportional to the gradient error (parity standard)
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def torch_run(model, make_optimizer, batches, *, clip=None, make_scheduler=None):
    """Plain torch on one device: (losses, pre-clip gradient norms, lrs used, state_dict)."""
    model = copy.deepcopy(model).train()
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    losses, norms, lrs = [], [], []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(*batch)
        loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if scheduler:
            scheduler.step()
        losses.append(loss.item())
    return losses, norms, lrs, {k: v.detach().clone() for k, v in model.state_dict().items()}


def xtrain_run(model, make_optimizer, batches, mesh, *, make_scheduler=None, **kwargs):
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    step = xtrain.compile(model, mesh, optimizer=optimizer, **kwargs)
    outs = []
    for batch in batches:
        outs.append(step(*batch))
        if scheduler:
            scheduler.step()
    return step, outs


def parity(reference, step, outs, optimizer_kind="SGD"):
    return ParityResult([o["loss"] for o in outs], reference[0], step.state_dict(), reference[3],
                        PARAM_ATOL[optimizer_kind])


# -- clipping ----------------------------------------------------------------------------------
@functools.cache
def gpt_clip_case():
    torch.manual_seed(0)
    model, batches = GPT(layers=2), token_batches(n=4)
    reference = torch_run(model, sgd, batches, clip=MAX_NORM)
    # the test has teeth only if clipping is active on every step
    assert min(reference[1]) > 2 * MAX_NORM, reference[1]
    return model, batches, reference


CLIP_PLANS = {
    "ddp": (dict(data=8), lambda model, mesh: None),
    "megatron_tp2_dp4": (dict(data=4, tensor=2), lambda model, mesh: plans.megatron(model, mesh)),
    "zero3": (dict(data=8), lambda model, mesh: xtrain.Plan(zero=3)),
}


@pytest.mark.e2e
@pytest.mark.parametrize("plan_name", list(CLIP_PLANS))
def test_clipping_matches_torch_clip_grad_norm(plan_name):
    model, batches, reference = gpt_clip_case()
    mesh, make_plan = CLIP_PLANS[plan_name]
    step, outs = xtrain_run(model, sgd, batches, xtrain.Mesh(**mesh), plan=make_plan(model, mesh),
                            clip_grad_norm=MAX_NORM)
    assert_parity(parity(reference, step, outs))
    norms = [o["grad_norm"] for o in outs]
    np.testing.assert_allclose(norms, reference[1], rtol=1e-5, err_msg="pre-clip norm differs from torch's")


@pytest.mark.e2e
def test_clipping_with_zero1_optimizer_slices_and_the_xla_lowering():
    """ZeRO-1 computes the norm over optimizer slices of whole gradients (summed over data);
    XLA's partitioner computes it in the global view. Both equal torch's."""
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(n=4)
    reference = torch_run(model, sgd, batches, clip=0.1)
    assert min(reference[1]) > 0.2, reference[1]
    for kwargs in (dict(plan=xtrain.Plan(zero=1)), dict(lowering="xla")):
        step, outs = xtrain_run(model, sgd, batches, xtrain.Mesh(data=8), clip_grad_norm=0.1, **kwargs)
        assert_parity(parity(reference, step, outs))
        np.testing.assert_allclose([o["grad_norm"] for o in outs], reference[1], rtol=1e-5)


@pytest.mark.unit
def test_clip_grad_norm_must_be_positive():
    with pytest.raises(OptionsError, match=r"clip_grad_norm=-1.0 must be a positive number or None"):
        xtrain.compile(MLP(), xtrain.Mesh(data=8), optimizer=sgd(MLP().parameters()), clip_grad_norm=-1.0)


# -- learning-rate schedules -------------------------------------------------------------------
def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 5))


def cosine_with_warmup(optimizer, warm=2, total=6):
    lin = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=warm)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total - warm, eta_min=1e-5)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [lin, cos], milestones=[warm])


@pytest.mark.e2e
@pytest.mark.parametrize("make_scheduler", [warmup, cosine_with_warmup], ids=["lambda_warmup", "cosine_warmup"])
def test_scheduler_matches_torch_without_recompiling(make_scheduler):
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(n=6)
    reference = torch_run(model, adamw, batches, make_scheduler=make_scheduler)
    assert len(set(reference[2])) >= 4, f"the schedule must change the lr: {reference[2]}"
    step, outs = xtrain_run(model, adamw, batches, xtrain.Mesh(data=8), make_scheduler=make_scheduler)
    assert_parity(parity(reference, step, outs, "AdamW"))
    assert step.compilations == 1, "a new lr recompiled the step"


@pytest.mark.e2e
def test_scheduler_per_param_group_with_xla_lowering():
    """Two param groups with their own lrs, each scheduled; XLA's partitioner lowering."""
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(n=4)

    def groups(params):
        params = list(params)
        return torch.optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.02}],
                               lr=0.05, momentum=0.9)

    decay = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 0.5 ** s, lambda s: 1.0 + s])
    reference = torch_run(model, groups, batches, make_scheduler=decay)
    step, outs = xtrain_run(model, groups, batches, xtrain.Mesh(data=8), make_scheduler=decay, lowering="xla")
    assert_parity(parity(reference, step, outs))
    assert step.compilations == 1
