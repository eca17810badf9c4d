"""LARS and LAMB (xtrain.optim): the torch classes against an independent reference (optax's
lars / lamb), and xtrain against eager torch with the same class on HF GPT-2 and Llama under
data parallel, FSDP and Megatron (layer scan on), ZeRO-1 with a padded pipeline stage; the
trust ratios' norm reductions in the report."""
import copy
import functools
import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import xtrain
from models import GPT, token_batches
from test_hf_models import gpt2, llama, lm_batches, lm_loss
from xtrain import plans
from xtrain.errors import OptionsError, UnsupportedError
from xtrain.ir import trust_ratio
from xtrain.optim import LAMB, LARS, exclude_from_adaptation
from xtrain.testing import assert_parity, torch_reference
from xtrain.testing.parity import PARAM_ATOL, ParityResult

TP2 = dict(data=4, tensor=2)


# -- the torch classes against optax's lars / lamb (the papers' rules, written independently) --
def _run_torch(cls, start, grads, **options):
    params = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in start.items()}
    optimizer = cls(params.values(), **options)
    for g in grads:
        for k, p in params.items():
            p.grad = torch.tensor(g[k])
        optimizer.step()
    return {k: p.detach().numpy() for k, p in params.items()}


def _run_optax(tx, start, grads):
    params = {k: jnp.asarray(v) for k, v in start.items()}
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update({k: jnp.asarray(v) for k, v in g.items()}, state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.e2e
@pytest.mark.parametrize("cls,options,reference", [
    (LAMB, dict(lr=0.01, weight_decay=0.1), optax.lamb(0.01, weight_decay=0.1)),
    (LARS, dict(lr=0.5, weight_decay=0.1, trust_coefficient=0.01, nesterov=True),
     optax.lars(0.5, weight_decay=0.1, trust_coefficient=0.01, nesterov=True)),
], ids=["lamb", "lars-nesterov"])
def test_torch_classes_match_optax(cls, options, reference):
    rng = np.random.default_rng(0)
    shapes = {"w": (5, 7), "b": (7,), "zero": (3,)}  # a zero parameter: trust ratio 1 (0/0 handled)
    start = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    start["zero"][:] = 0
    grads = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()} for _ in range(3)]
    ours, theirs = _run_torch(cls, start, grads, **options), _run_optax(reference, start, grads)
    for k in shapes:
        np.testing.assert_allclose(ours[k], theirs[k], atol=1e-6, err_msg=k)


@pytest.mark.unit
def test_trust_ratio_is_per_layer_of_a_stacked_array_and_zero_rows_stay_zero():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 4, 5)).astype(np.float32)  # (L, ...): row 2 is a padding row
    w[2] = 0
    u = rng.standard_normal((3, 4, 5)).astype(np.float32)
    u[2] = 0
    tx = trust_ratio.scale_by_trust_ratio(trust_coefficient=0.5)
    out, _ = tx.update({"blocks.*.w": jnp.asarray(u)}, tx.init(None), {"blocks.*.w": jnp.asarray(w)})
    scaled = np.asarray(out["blocks.*.w"])
    for k in range(2):  # each layer by its own norms, as torch's per-layer parameters
        np.testing.assert_allclose(scaled[k], u[k] * 0.5 * np.linalg.norm(w[k]) / np.linalg.norm(u[k]), rtol=1e-6)
    assert np.all(scaled[2] == 0) and np.all(np.isfinite(scaled))


# -- xtrain against eager torch with the same class ---------------------------------------------
def _groups(parameters, weight_decay):
    """What exclude_from_adaptation gives (tested below), over bare parameters: 1-D ones (biases,
    norm weights) neither adapted nor decayed."""
    parameters = list(parameters)
    return [{"params": [p for p in parameters if p.ndim > 1], "weight_decay": weight_decay},
            {"params": [p for p in parameters if p.ndim <= 1], "weight_decay": 0.0, "adapt": False}]


OPTIMIZERS = {"lamb": lambda ps: LAMB(_groups(ps, 0.01), lr=1e-2),
              "lars": lambda ps: LARS(_groups(ps, 1e-4), lr=2.0, trust_coefficient=0.02)}


@pytest.mark.unit
def test_exclude_from_adaptation_groups_biases_and_norms_apart():
    model = GPT()
    adapted, excluded = exclude_from_adaptation(model, weight_decay=0.1)
    assert excluded == {"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0, "adapt": False}
    assert adapted["weight_decay"] == 0.1 and all(p.ndim == 2 for p in adapted["params"])
    assert len(adapted["params"]) + len(excluded["params"]) == len(list(model.parameters()))


@functools.cache
def case(model_name, optimizer):
    torch.manual_seed(0)
    if model_name == "gpt":
        model, batches, loss_fn = GPT(layers=3), token_batches(4, batch=16), None
    else:
        model, batches, loss_fn = {"gpt2": gpt2, "llama": llama}[model_name](), lm_batches(), lm_loss
    make = OPTIMIZERS[optimizer]
    return model, make, batches, loss_fn, torch_reference(model, make, batches, loss_fn)


def train(model_name, optimizer, mesh, plan):
    model, make, batches, loss_fn, reference = case(model_name, optimizer)
    candidate = copy.deepcopy(model)
    opt = make(candidate.parameters())
    step = xtrain.compile(candidate, xtrain.Mesh(**mesh), optimizer=opt, plan=plan, loss_fn=loss_fn,
                          scan_layers=True)
    losses = [step(*b)["loss"] for b in batches]
    result = ParityResult(losses, reference[0], step.state_dict(), reference[1], PARAM_ATOL[type(opt).__name__])
    assert_parity(result)
    return step


def _norm_reductions(step) -> dict[str, int]:
    """Mesh axes -> all-reduces of trust-ratio norms in the report."""
    found = {}
    for line in str(step.report()).splitlines():
        if "trust_ratio.norms" in line:
            axes = line.split()[1]
            found[axes] = found.get(axes, 0) + 1
    return found


# Every model meets every layout and every optimizer every layout (a Latin square, not all 12).
@pytest.mark.e2e
@pytest.mark.parametrize("model_name,optimizer,layout", [
    ("gpt2", "lamb", "data8"), ("llama", "lars", "data8"),
    ("gpt2", "lars", "fsdp"), ("llama", "lamb", "fsdp"),
    ("gpt2", "lamb", "megatron"), ("llama", "lars", "megatron"),
])
def test_parity_with_torch_on_hf_models(model_name, optimizer, layout):
    model = case(model_name, optimizer)[0]
    mesh = TP2 if layout == "megatron" else dict(data=8)
    plan = {"data8": lambda: None, "fsdp": lambda: plans.fsdp(model, mesh),
            "megatron": lambda: plans.megatron(model, mesh)}[layout]()
    step = train(model_name, optimizer, mesh, plan)
    assert step.scan_layers and step.layout.stacking  # per-layer ratios of stacked (L, ...) arrays
    if (model_name, layout) == ("gpt2", "megatron"):  # tensor-parallel shards' norms summed over `tensor` only
        assert set(_norm_reductions(step)) == {"tensor"}


@pytest.mark.e2e
def test_zero1_pipeline_with_a_padding_row_matches_torch_and_reports_the_norms():
    plan = xtrain.Plan(zero=1).with_pipeline(stages=2, microbatches=4, schedule="gpipe")  # 3 layers on 2 stages
    step = train("gpt", "lamb", dict(pipe=2, data=4), plan)
    rows = step.layout.stacking.rows_of("blocks.*.attn.q.weight")
    assert None in rows  # the stage with fewer layers holds a zero row: 0/0 is ratio 1, its update 0
    # ZeRO-1 slices summed over data (stage-local block rows and the shared tensors apart)
    assert set(_norm_reductions(step)) == {"data"}


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.e2e
def test_another_packages_lamb_is_refused_by_its_own_name():
    class Lamb(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, dict(lr=1e-3))
    LookAlike = type("LAMB", (Lamb,), {})
    model = GPT()
    with pytest.raises(UnsupportedError, match=re.escape(
            "optimizer test_large_batch.LAMB is not supported by xtrain; supported: torch.optim.SGD, "
            "torch.optim.Adam, torch.optim.AdamW, xtrain.optim.LARS, xtrain.optim.LAMB")):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=LookAlike(model.parameters()))


@pytest.mark.unit
def test_bad_options_name_the_fix():
    params = GPT().parameters()
    with pytest.raises(OptionsError, match=re.escape("nesterov=True is invalid: Nesterov momentum needs momentum > 0")):
        LARS(params, momentum=0.0, nesterov=True)
    with pytest.raises(OptionsError, match=re.escape("betas=(0.9, 1.0) is invalid: use two decays in [0, 1)")):
        LAMB(params, betas=(0.9, 1.0))
