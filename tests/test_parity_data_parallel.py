"""Data parallel through xtrain equals single-device torch (the parity standard)."""
import functools

import pytest
import torch

import xtrain
from xtrain.testing import assert_parity, run_parity, torch_reference

from models import CNN, GPT, MLP, cnn_batches, mlp_batches, token_batches

pytestmark = pytest.mark.e2e

MESHES = {"data8": dict(data=8), "data2": dict(data=2, rest=4), "data1": dict(data=1, rest=8)}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)


CASES = {
    # The CNN uses SGD: conv biases before BatchNorm get rounding-noise gradients, which Adam
    # would turn into lr-sized sign flips (see the parity standard).
    "mlp": (MLP, adamw, mlp_batches),
    "cnn_batchnorm": (CNN, sgd, cnn_batches),
    "gpt": (GPT, adamw, token_batches),
}


@functools.cache
def case(name):
    make_model, make_opt, make_batches = CASES[name]
    torch.manual_seed(0)
    model, batches = make_model(), make_batches()
    return model, make_opt, batches, torch_reference(model, make_opt, batches)


@functools.cache
def trained(name, mesh, lowering):
    model, make_opt, batches, reference = case(name)
    # Mesh(data=2, rest=4): the batch splits over data only, the other axis replicates.
    return run_parity(model, make_opt, batches, xtrain.Mesh(**MESHES[mesh]), reference=reference,
                      lowering=lowering)


@pytest.mark.parametrize("lowering", ["explicit", "xla"])
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("name", CASES)
def test_parity(name, mesh, lowering):
    assert_parity(trained(name, mesh, lowering))


@pytest.mark.parametrize("name", CASES)
def test_explicit_and_xla_lowerings_agree(name):
    explicit, xla = trained(name, "data8", "explicit"), trained(name, "data8", "xla")
    assert max(abs(a - b) / abs(b) for a, b in zip(explicit.losses, xla.losses)) <= 1e-5
    for key, value in xla.state.items():
        if value.is_floating_point():
            assert float((explicit.state[key] - value).abs().max()) <= explicit.param_atol, key
