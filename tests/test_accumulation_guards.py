"""Gradient accumulation equals the large batch; the recompilation guard; NaN detection."""
import copy

import numpy as np
import pytest
import torch
from torch import nn

import xtrain
from xtrain.errors import InputError, OptionsError
from xtrain.testing import assert_parity, run_parity

from models import GPT, MLP, mlp_batches, token_batches


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


# -- accumulation --------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("lowering", ["explicit", "xla"])
def test_accumulating_four_micro_batches_equals_the_large_batch(lowering):
    """Global batch 64 on data=8 as 4 micro-batches of 16 vs torch's one batch of 64."""
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches(n=4, batch=64)
    result = run_parity(model, sgd, batches, xtrain.Mesh(data=8), accumulate=4, lowering=lowering)
    assert_parity(result)


@pytest.mark.e2e
def test_accumulation_on_gpt_with_tensor_parallel():
    torch.manual_seed(0)
    model, batches = GPT(layers=2), token_batches(n=4, batch=32)
    plan = xtrain.plans.megatron(model, dict(data=4, tensor=2))
    assert_parity(run_parity(model, sgd, batches, xtrain.Mesh(data=4, tensor=2), plan=plan, accumulate=2))


@pytest.mark.unit
def test_accumulation_needs_a_batch_that_splits_per_device():
    model = MLP()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), accumulate=3)
    with pytest.raises(InputError, match=r"batch argument 0 has shape \(16, 12\): global batch 16 does not split "
                                         r"into accumulate=3 micro-batches on each of 8 data-parallel devices; "
                                         r"use a global batch that is a multiple of 24"):
        step(*mlp_batches(n=1)[0])


@pytest.mark.unit
def test_accumulate_must_be_a_positive_integer():
    with pytest.raises(OptionsError, match=r"accumulate=0 must be an integer >= 1"):
        xtrain.compile(MLP(), xtrain.Mesh(data=8), optimizer=sgd(MLP().parameters()), accumulate=0)


# -- recompilation guard ---------------------------------------------------------------------
@pytest.mark.e2e
def test_a_new_batch_shape_is_refused_naming_the_input():
    model = GPT(layers=1)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))
    x, y = token_batches(n=1)[0]
    step(x, y)
    with pytest.raises(InputError) as err:
        step(x[:, :8], y[:, :8])
    assert str(err.value) == (
        "this step would recompile: the batch differs from the one it was compiled for (batch argument 0: "
        "shape (16, 16) dtype int32 -> shape (16, 8) dtype int32; batch argument 1: shape (16, 16) dtype "
        "int32 -> shape (16, 8) dtype int32). Pad or bucket batches to a fixed set of shapes, or pass "
        "xtrain.compile(..., allow_recompile=True) to compile one step per shape (or allow_recompile=N for N "
        "shapes, e.g. N buckets)")
    assert step.step_count == 1, "the refused call must not train"


@pytest.mark.e2e
def test_a_dtype_change_is_named_and_allow_recompile_lets_it_through():
    model = MLP()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))
    x, y = mlp_batches(n=1)[0]
    step(x, y)
    with pytest.raises(InputError, match=r"batch argument 1: shape \(16,\) dtype int32 -> shape \(16,\) dtype float32"):
        step(x, y.float())
    other = MLP()
    allowed = xtrain.compile(other, xtrain.Mesh(data=8), optimizer=sgd(other.parameters()), allow_recompile=True)
    allowed(x, y)
    allowed(x[:8], y[:8])
    assert allowed.compilations == 2
    third = MLP()
    two = xtrain.compile(third, xtrain.Mesh(data=8), optimizer=sgd(third.parameters()), allow_recompile=2)
    two(x, y), two(x[:8], y[:8]), two(x, y)
    with pytest.raises(InputError, match=r"already has its 2 \(allow_recompile=2\) \(batch argument 0: shape "
                                         r"\(16, 12\) dtype float32 -> shape \(24, 12\)"):
        two(torch.cat([x, x[:8]]), torch.cat([y, y[:8]]))


# -- NaN detection ---------------------------------------------------------------------------
class Sqrt(nn.Module):
    def forward(self, h):
        return torch.sqrt(h)  # NaN for negative inputs


class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.root, self.head = nn.Linear(12, 32), Sqrt(), nn.Linear(32, 5)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.root(self.fc1(x))), y)


@pytest.mark.e2e
def test_detect_nan_names_the_module_and_skips_the_update():
    torch.manual_seed(0)
    model = Fragile()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), detect_nan=True)
    before = step.state_dict()
    with pytest.raises(FloatingPointError) as err:
        step(*mlp_batches(n=1)[0])
    assert "first non-finite tensor: output of sqrt (shape (16, 32)) in module 'root'" in str(err.value)
    assert "The update was skipped" in str(err.value)
    after = step.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite step changed the parameters"


@pytest.mark.e2e
def test_detect_nan_is_on_by_default_finite_steps_pass_and_it_can_be_turned_off():
    torch.manual_seed(0)
    model = MLP()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))
    out = step(*mlp_batches(n=1)[0])
    assert out["skipped"] is False and np.isfinite(out["grad_norm"])
    fragile = Fragile()
    default = xtrain.compile(fragile, xtrain.Mesh(data=8), optimizer=sgd(fragile.parameters()))
    with pytest.raises(FloatingPointError, match="in module 'root'"):
        default(*mlp_batches(n=1)[0])
    plain = xtrain.compile(fragile, xtrain.Mesh(data=8), optimizer=sgd(fragile.parameters()), detect_nan=False,
                           check_inputs=False)
    out = plain(*mlp_batches(n=1)[0])
    assert np.isnan(out["loss"]) and "skipped" not in out  # no check, no skip: NaN flows on


# -- losses over a varying number of terms -------------------------------------------------------
IGNORE = -100


class MaskedMLP(MLP):
    """Classifier whose labels may be IGNORE; returns the mean, or (sum, count) when asked."""

    def __init__(self, pair: bool):
        super().__init__()
        self.pair = pair

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.fc2(torch.nn.functional.gelu(self.fc1(x)))))
        total = torch.nn.functional.cross_entropy(logits, y, ignore_index=IGNORE, reduction="sum")
        count = (y != IGNORE).sum()
        return (total, count) if self.pair else total / count


def masked_batches(n=4, batch=64):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        x, y = torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)
        y[torch.rand(batch, generator=g) < torch.linspace(0.9, 0.0, batch)] = IGNORE  # uneven per micro-batch
        out.append((x, y))
    return out


def torch_masked_reference(model, batches):
    model = copy.deepcopy(model)
    opt = sgd(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        total, count = model(x, y)
        loss = total / count
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.e2e
def test_sum_and_count_loss_accumulates_exactly_with_uneven_counts():
    torch.manual_seed(0)
    pair = MaskedMLP(pair=True)
    batches = masked_batches()
    reference = torch_masked_reference(pair, batches)
    result = run_parity(pair, sgd, batches, xtrain.Mesh(data=8), accumulate=4, reference=reference)
    assert_parity(result)
    # the same model returning its mean is not exact here: the micro-batches' counts differ
    mean = MaskedMLP(pair=False)
    mean.load_state_dict(pair.state_dict())
    biased = run_parity(mean, sgd, batches, xtrain.Mesh(data=8), accumulate=4, reference=reference)
    assert biased.loss_rel_diff > 1e-3, biased.loss_rel_diff
