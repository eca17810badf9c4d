"""xtrain.Segments: a fused dimension split per segment (device i holds the i-th slice of every
segment), stored interleaved on the mesh and in torch's order everywhere else. A hand-written plan
on a tiny fused MLP, whose fused output is both sliced apart (local per segment) and read whole (a
softmax over it: gathered back to torch's order), trains with parity under both lowerings."""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import xtrain
from xtrain.errors import PlanError
from xtrain.sharding.segments import Segments, to_stored, to_torch
from xtrain.testing import assert_parity, run_parity

MESH = dict(data=4, tensor=2)
FUSED = Segments("tensor", (8, 16))


class FusedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 24)    # [a (8) | b (16)]
        self.down = nn.Linear(16, 16)

    def forward(self, x, y):
        h = self.up(x)
        a, b = h.split([8, 16], dim=-1)
        whole = torch.softmax(h, dim=-1)[..., :4].sum(-1, keepdim=True)  # reads the fused output whole
        out = self.down(b * torch.sigmoid(b)) + a.sum(-1, keepdim=True) + whole
        return ((out - y) ** 2).mean()


def plan():
    return xtrain.Plan(params={"up.weight": (FUSED, None), "up.bias": (FUSED,), "down.weight": (None, "tensor")})


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, 16, generator=g), torch.randn(8, 4, 16, generator=g)) for _ in range(4)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@pytest.mark.unit
def test_stored_order_interleaves_the_segments_and_inverts():
    x = np.arange(24)
    stored = to_stored(x, (FUSED,), {"tensor": 2})
    # device 0: a[0:4], b[0:8]; device 1: a[4:8], b[8:16]
    assert stored.tolist() == [*range(0, 4), *range(8, 16), *range(4, 8), *range(16, 24)]
    assert to_torch(stored, (FUSED,), {"tensor": 2}).tolist() == x.tolist()


@pytest.mark.e2e
@pytest.mark.parametrize("lowering", ["explicit", "xla"])
def test_a_per_segment_plan_trains_with_parity(lowering):
    torch.manual_seed(0)
    model = FusedMLP()
    result = run_parity(model, sgd, data(), xtrain.Mesh(**MESH), plan=plan(), lowering=lowering)
    assert_parity(result)
    if lowering == "explicit":
        step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=plan())
        report = step.report(*data()[0])
        assert any("split per segment (8, 16)" in n and "gathered" in n for n in report.notes), report.notes
        # state_dict is torch's order: the fresh step's tensors are the module's own
        state = step.state_dict()
        assert all(torch.equal(torch.as_tensor(state[k]), v) for k, v in model.state_dict().items())


@pytest.mark.e2e
@pytest.mark.parametrize("sizes,message", [((8, 8), "adds up to 16, but the dimension has size 24"),
                                           ((9, 15), "segments [9, 15] of Segments('tensor', (9, 15)) are not divisible")])
def test_segments_that_do_not_fit_are_refused(sizes, message):
    model = FusedMLP()
    bad = xtrain.Plan(params={"up.weight": (Segments("tensor", sizes), None)})
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=bad)


@pytest.mark.e2e
@pytest.mark.parametrize("change", [dict(offload="optimizer"), dict(zero=2)])
def test_optimizer_state_follows_the_stored_order(change):
    # the momentum is stored like its parameter: in host memory (reordered on the device), or split
    # further over data by ZeRO-2 on the other dimension
    torch.manual_seed(0)
    model = FusedMLP()
    assert_parity(run_parity(model, sgd, data(), xtrain.Mesh(**MESH), plan=dataclasses.replace(plan(), **change)))
