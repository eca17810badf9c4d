"""A torch.autograd.Function's own backward defines its gradient under xtrain, as in torch
(lowered as a JAX custom VJP): straight-through estimators, custom-gradient activations, and
Functions inside repeated blocks under the layer scan and FSDP, all against torch eager; what
cannot be honoured is refused naming the Function and its module."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xtrain
from xtrain.ir import TraceError
from xtrain.testing import assert_parity, run_parity

from models import mlp_batches
from test_layer_scan import scan_lengths


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: round in the forward, identity gradient (autodiff: zero)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class SoftClip(torch.autograd.Function):
    """clamp(x, -limit, limit) whose backward is a smooth surrogate (not clamp's 0/1 mask),
    with a saved tensor, a constant kept on ctx and needs_input_grad."""

    @staticmethod
    def forward(ctx, x, limit: float):
        ctx.save_for_backward(x)
        ctx.limit = limit
        return x.clamp(-limit, limit)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        surrogate = torch.sigmoid(4 * (ctx.limit - x.abs()))
        return (grad * surrogate if ctx.needs_input_grad[0] else None), None


class Gate(torch.autograd.Function):
    """x * w (w broadcast over rows) with a backward that returns w's gradient unreduced
    (torch sums a broadcast gradient down to the input's shape), set up in setup_context."""

    @staticmethod
    def forward(x, w):
        return x * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        return grad * w, grad * x


class Quantized(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.head(RoundSTE.apply(self.fc(x) * 4) / 4), y)


class Clipped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 16)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 16))
        self.head = nn.Linear(16, 5)

    def forward(self, x, y):
        return F.cross_entropy(self.head(Gate.apply(SoftClip.apply(self.fc(x) * 2, 1.0), self.gate)), y)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


@pytest.mark.e2e
def test_straight_through_estimator_gradients_equal_torchs():
    torch.manual_seed(0)
    model = Quantized()
    batches = mlp_batches(n=4)
    x, y = batches[0]
    model(x, y).backward()
    assert model.fc.weight.grad.abs().max() > 0.01  # the STE passes a gradient to fc
    model.zero_grad()
    assert_parity(run_parity(model, sgd, batches, xtrain.Mesh(data=8)))


@pytest.mark.e2e
def test_a_custom_gradient_activation_matches_torch():
    torch.manual_seed(0)
    assert_parity(run_parity(Clipped(), sgd, mlp_batches(n=4), xtrain.Mesh(data=8)))


@pytest.mark.e2e
def test_needs_input_grad_says_which_inputs_are_differentiated():
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            seen.append(ctx.needs_input_grad)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            return None, grad.sum(0)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(12))

        def forward(self, x, y):
            return Spy.apply(x, self.w).sum()

    model = Model()
    batch = mlp_batches(n=1)[0]
    model(*batch).backward()
    torch_flags = seen.pop()
    xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))(*batch)
    assert torch_flags == (False, True) and torch_flags in seen


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(SoftClip.apply(self.up(self.norm(x)), 0.5))


class Deep(nn.Module):
    def __init__(self, d=32, layers=4):
        super().__init__()
        self.embed = nn.Linear(12, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, 5)

    def forward(self, x, y):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h), y)


@pytest.mark.e2e
def test_a_function_in_repeated_blocks_under_the_layer_scan_and_fsdp_matches_torch():
    torch.manual_seed(0)
    model = Deep()
    batches = mlp_batches(n=4)
    mesh = xtrain.Mesh(data=8)
    result = run_parity(model, adamw, batches, mesh, plan=xtrain.plans.fsdp(model, mesh), scan_layers=True)
    assert_parity(result)
    step = xtrain.compile(model, mesh, optimizer=adamw(model.parameters()), plan=xtrain.plans.fsdp(model, mesh),
                          scan_layers=True)
    assert step.scan_layers and set(scan_lengths(step.program(*batches[0]))) == {4}
    assert not any("no partition rule" in note for note in step.report(*batches[0]).notes)


@pytest.mark.e2e
def test_a_function_under_megatron_tensor_parallelism_matches_torch():
    torch.manual_seed(0)
    model = Deep(layers=2)
    mesh = {"data": 4, "tensor": 2}
    plan = xtrain.plans.megatron(model, mesh, example=mlp_batches(n=1)[0])
    assert plan.param_specs({n: tuple(p.shape) for n, p in model.named_parameters()}, mesh)["blocks.0.up.weight"]
    assert_parity(run_parity(model, sgd, mlp_batches(n=4), xtrain.Mesh(**mesh), plan=plan))


# -- refusals ----------------------------------------------------------------------------------
class Wrapper(nn.Module):
    """Calls `body(self, x)` from module path 'inner.0'."""

    def __init__(self, body):
        super().__init__()
        self.inner = nn.Sequential(Caller(body))

    def forward(self, x, y):
        return self.inner(x).sum()


class Caller(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.body = body

    def forward(self, x):
        return self.body(self, self.fc(x))


class ReadsWeight(torch.autograd.Function):
    weight = None

    @staticmethod
    def forward(ctx, x):
        return x * ReadsWeight.weight

    @staticmethod
    def backward(ctx, grad):
        return grad


class Dirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class TooFew(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        return (grad,) * 0 or ()


class Counts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.sum(), 3

    @staticmethod
    def backward(ctx, grad, _):
        return grad


def closes_over(module, x):
    ReadsWeight.weight = module.fc.weight[0]
    return ReadsWeight.apply(x)


@pytest.mark.unit
@pytest.mark.parametrize("body,message", [
    (closes_over, r"ReadsWeight \(called in module 'inner\.0'\): forward reads tensors it was not passed \(closed "
                  r"over: a module's parameter.*pass every tensor it uses to ReadsWeight\.apply\(\.\.\.\)"),
    (lambda m, x: Dirty.apply(x), r"Dirty \(called in module 'inner\.0'\): forward changes an input in place "
                                  r"\(ctx\.mark_dirty\)"),
    (lambda m, x: TooFew.apply(x, 2.0), r"TooFew \(called in module 'inner\.0'\): backward returned 0 gradients but "
                                        r"forward takes 2 inputs"),
    (lambda m, x: Counts.apply(x)[0], r"Counts \(called in module 'inner\.0'\): forward returned a int as output 1"),
], ids=["closure", "mark_dirty", "gradient_count", "non_tensor_output"])
def test_a_function_that_cannot_be_honoured_is_refused_naming_it_and_its_module(body, message):
    model = Wrapper(body)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))
    with pytest.raises(TraceError, match=r"torch\.autograd\.Function .*" + message):
        step(*mlp_batches(n=1)[0])
