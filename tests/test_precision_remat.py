"""Mixed precision (bf16, fp16 with dynamic loss scaling, per-module overrides) and activation
checkpointing per layer of the layer scan."""
import copy
import functools
import re

import jax
import numpy as np
import pytest
import torch

import xtrain
from xtrain import errors
from xtrain import LossScale, Precision
from xtrain.errors import PlanError, UnsupportedError
from xtrain.testing import ParityResult, assert_parity, torch_reference

from models import GPT, MLP, mlp_batches, token_batches

STEPS = 8
BF16_LOSS_RTOL = 2e-3  # measured 3.8e-4 on this model over 8 AdamW steps; bf16 has 8 mantissa bits


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def train_gpt(precision, steps=STEPS, **kwargs):
    torch.manual_seed(0)
    model = GPT(layers=2)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()),
                          plan=xtrain.Plan(precision=precision), **kwargs)
    return step, [step(*b)["loss"] for b in token_batches(n=steps)]


@functools.cache
def fp32_losses():
    return train_gpt("fp32")[1]


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
    from jax.extend import core as jcore

    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(sub, (jcore.Jaxpr, jcore.ClosedJaxpr)):
                    yield from _eqns(getattr(sub, "jaxpr", sub))


def dot_operand_dtypes(program) -> list[str]:
    """The dtype of the first operand of every dot_general in an emitted program."""
    return [str(e.invars[0].aval.dtype) for e in _eqns(program.jaxpr) if e.primitive.name == "dot_general"]


@pytest.mark.e2e
def test_bf16_trains_the_gpt_close_to_fp32_with_fp32_master_weights():
    step, losses = train_gpt("bf16")
    reference = fp32_losses()
    rel = np.abs(np.array(losses) - reference) / np.abs(reference)
    assert rel.max() <= BF16_LOSS_RTOL, f"bf16 vs fp32 loss rel diff {rel}"
    assert rel.max() > 0, "bf16 gave fp32's losses bit for bit: the policy did nothing"
    assert losses[-1] < losses[0]
    dtypes = {str(x.dtype) for x in step.state.params.values()} | {
        str(x.dtype) for x in __import__("jax").tree.leaves(step.state.opt_state) if x.dtype.kind == "f"}
    assert dtypes == {"float32"}, f"master weights / optimizer state must stay fp32, got {dtypes}"
    program = step.program()
    ops = dot_operand_dtypes(program)
    assert ops.count("bfloat16") == len(ops) > 0, f"matmul operand dtypes (forward and backward): {ops}"
    psums = [line for line in str(program).splitlines() if "psum" in line]
    assert any("bf16[" in line for line in psums), "gradients must cross the wire in bf16"


@pytest.mark.e2e
def test_fp32_module_override_keeps_those_matmuls_fp32():
    torch.manual_seed(0)
    model = GPT(layers=2)
    plain = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()),
                           plan=xtrain.Plan(precision="bf16"))
    kept = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()),
                          plan=xtrain.Plan(precision=Precision(compute="bf16", fp32_modules=("blocks.*.mlp.*",))))
    batch = token_batches(n=1)[0]
    plain_bf16 = dot_operand_dtypes(plain.program(*batch)).count("bfloat16")
    kept_bf16 = dot_operand_dtypes(kept.program(*batch)).count("bfloat16")
    assert 0 < kept_bf16 < plain_bf16, (kept_bf16, plain_bf16)


@pytest.mark.e2e
def test_bf16_with_the_xla_lowering_trains_close_to_fp32():
    losses = {}
    for precision in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = MLP()
        step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()),
                              plan=xtrain.Plan(precision=precision), lowering="xla")
        losses[precision] = np.array([step(*b)["loss"] for b in mlp_batches(n=4)])
    rel = np.abs(losses["bf16"] - losses["fp32"]) / losses["fp32"]
    assert 0 < rel.max() <= BF16_LOSS_RTOL, rel


@pytest.mark.unit
def test_precision_config_errors_name_field_and_value():
    with pytest.raises(PlanError, match=r"Precision.compute='int8' must be one of \['fp32', 'bf16', 'fp16', 'fp8'\]"):
        xtrain.Plan(precision="int8")
    with pytest.raises(PlanError, match=r"Precision.loss_scale=.* is only used with compute='fp16', not 'bf16'"):
        Precision(compute="bf16", loss_scale=LossScale())
    with pytest.raises(PlanError, match=r"LossScale.growth_interval=0 must be >= 1"):
        LossScale(growth_interval=0)


# -- fp16 dynamic loss scaling ---------------------------------------------------------------
@pytest.mark.e2e
def test_fp16_overflow_skips_exactly_that_step_and_halves_the_scale():
    torch.manual_seed(0)
    model = MLP()
    plan = xtrain.Plan(precision=Precision(compute="fp16", loss_scale=LossScale(initial=1024.0, growth_interval=2)))
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1), plan=plan)
    batches = mlp_batches(n=4)
    x, y = batches[1]
    batches[1] = (x * 1e6, y)  # beyond fp16's range (65504) once cast for the matmul: inf
    outs, states = [], []
    for batch in batches:
        outs.append(step(*batch))
        states.append(step.state_dict())
    assert [o["skipped"] for o in outs] == [False, True, False, False]
    assert [o["loss_scale"] for o in outs] == [1024.0, 1024.0, 512.0, 512.0]
    # two good steps after the overflow: the scale grows back
    assert float(step.state.loss_scale["scale"]) == 1024.0 and int(step.state.loss_scale["good_steps"]) == 0
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0]), "the skipped step changed parameters"
    assert not all(torch.equal(states[1][k], states[2][k]) for k in states[0]), "the step after did not train"
    # fp16 with the overflowing batch is fp32 without it, up to fp16 rounding
    torch.manual_seed(0)
    fp32 = MLP()
    plain = xtrain.compile(fp32, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(fp32.parameters(), lr=0.1))
    expected = [plain(*b)["loss"] for b in (batches[0], batches[2], batches[3])]
    got = [outs[0]["loss"], outs[2]["loss"], outs[3]["loss"]]
    np.testing.assert_allclose(got, expected, rtol=5e-3)
    assert {str(v.dtype) for v in step.state.params.values()} == {"float32"}


# -- activation checkpointing ----------------------------------------------------------------
def remat_note(step) -> tuple[int, int]:
    """(temporaries with remat, without) from the report's note."""
    (note,) = [n for n in step.report(compare=True).notes if n.startswith("activation checkpointing")]
    found = re.search(r"temporaries (\d+) B per device vs (\d+) B without \(saves (-?\d+) B\)", note)
    on, off, saved = map(int, found.groups())
    assert saved == off - on
    return on, off


@pytest.mark.e2e
def test_remat_full_and_selective_lower_peak_temporaries_and_keep_parity():
    torch.manual_seed(0)
    model, batches = GPT(layers=3, d=32, seq=16), token_batches(n=4, batch=32)
    reference = torch_reference(model, adamw, batches)
    asked = set()

    def policy(prim, *avals, **params):  # a residual policy of one's own: the Plan(remat=...) hook
        asked.add(str(prim))
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable(prim, *avals, **params)

    temps = {}
    for remat, keep in (("full", ()), ("selective", ("blocks.*.attn",)), (policy, ())):
        candidate = copy.deepcopy(model)
        plan = xtrain.Plan(remat=remat, remat_keep=keep)
        step = xtrain.compile(candidate, xtrain.Mesh(data=8), optimizer=adamw(candidate.parameters()), plan=plan)
        losses = [step(*b)["loss"] for b in batches]
        assert_parity(ParityResult(losses, reference[0], step.state_dict(), reference[1], 5e-5))
        temps[plan.remat.value] = remat_note(step)
    (full, off), (selective, off_again), (saved_dots, off_third) = temps["full"], temps["selective"], temps["policy"]
    assert off == off_again == off_third
    # keeping the attention activations costs memory that full recomputation saves; the policy
    # keeps the projections' outputs (2-D products) but not the attention scores (batched)
    assert full < selective < off, temps
    assert full < saved_dots < off and "dot_general" in asked, (temps, asked)


@pytest.mark.e2e
def test_remat_under_zero3_recomputes_the_layers_and_gathers_their_weights_again():
    """ZeRO-3 checkpoints the whole step to gather weights again in the backward pass; JAX's
    outermost checkpoint policy decides for everything inside it, so that must not override
    the layers' remat policy (it did: remat='full' then saved every activation)."""
    from test_regather import backward_scan_gathers

    torch.manual_seed(0)
    model, batches = GPT(layers=3, d=32, seq=16), token_batches(n=4, batch=32)
    reference = torch_reference(model, adamw, batches)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()),
                          plan=xtrain.Plan(zero=3, remat="full"))
    losses = [step(*b)["loss"] for b in batches]
    assert_parity(ParityResult(losses, reference[0], step.state_dict(), reference[1], 5e-5))
    on, off = remat_note(step)
    assert on < 0.7 * off, (on, off)
    # the backward scan still gathers each layer's weights again, in one flat all-gather
    assert backward_scan_gathers(step, batches[0]) == [sum(p.numel() for p in model.blocks[0].parameters())]


@pytest.mark.e2e
def test_remat_without_a_layer_scan_is_an_error():
    model = MLP()  # no numbered sibling modules at all: refused at compile
    with pytest.raises(errors.PlanError, match=r"remat='full' checkpoints each layer of the model's repeated blocks, but "
                                         r"MLP has no numbered sibling modules \(blocks.0, blocks.1, ...\) to repeat; "
                                         r"use remat='off'"):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), plan=xtrain.Plan(remat="full"))
    # numbered blocks that are not one family: known only from the trace, at the first step
    stack = torch.nn.Sequential(torch.nn.Linear(12, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12))
    step = xtrain.compile(stack, xtrain.Mesh(data=8), optimizer=adamw(stack.parameters()),
                          plan=xtrain.Plan(remat="full"), loss_fn=lambda m, x: m(x).sum())
    with pytest.raises(errors.PlanError, match=r"remat='full' checkpoints each layer of the model's repeated blocks, but "
                                         r"Sequential has none \(.*\); use remat='off'"):
        step(torch.ones(8, 12))
    with pytest.raises(PlanError, match=r"Plan\(remat='some'\) must be one of \['off', 'full', 'dots'"):
        xtrain.Plan(remat="some")
    with pytest.raises(PlanError, match=r"pass the JAX checkpoint policy itself"):
        xtrain.Plan(remat="policy")
    with pytest.raises(PlanError, match=r"a policy callable decides what stays on the device"):
        xtrain.Plan(remat=jax.checkpoint_policies.dots_saveable, offload="activations")
    with pytest.raises(PlanError, match=r"remat_keep=\(\)\): remat='selective' needs remat_keep"):
        xtrain.Plan(remat="selective")
    with pytest.raises(UnsupportedError, match=r"Plan\(remat='full'\) checkpoints each layer of the explicit lowering"):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()),
                       plan=xtrain.Plan(remat="full"), lowering="xla")
