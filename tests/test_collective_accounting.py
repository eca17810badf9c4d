"""What the explicit lowering emits, counted from its own program (not XLA's optimized HLO)."""
import functools
import math

import pytest
import torch
from torch import nn

import xtrain
from xtrain.testing import assert_parity, run_parity

from models import CNN, GPT, MLP, cnn_batches, mlp_batches, token_batches

pytestmark = pytest.mark.e2e

GRAD_SYNC = "xtrain.grad_sync"


def param_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


@functools.cache
def compiled(name, bucket_bytes=25 * 2**20, comm_dtype=None):
    make_model, make_batches = {"mlp": (MLP, mlp_batches), "cnn": (CNN, cnn_batches), "gpt": (GPT, token_batches)}[name]
    torch.manual_seed(0)
    model = make_model()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          grad_sync=xtrain.GradSync(bucket_bytes=bucket_bytes, comm_dtype=comm_dtype))
    step(*make_batches(1)[0])
    return model, step


def report(name, bucket_bytes=25 * 2**20, comm_dtype=None):
    model, step = compiled(name, bucket_bytes, comm_dtype)
    return model, step.report()


def grad_collectives(rep):
    return [c for c in rep.collectives if GRAD_SYNC in c.source]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_gradient_payload_equals_parameter_bytes(name):
    model, rep = report(name)
    grads = grad_collectives(rep)
    assert sum(c.payload_bytes for c in grads) == param_bytes(model)
    assert all(c.kind == "all-reduce" and c.axes == ("data",) for c in grads)
    # besides gradients: only the scalar loss (and the count of tokens it averages over)
    others = [c for c in rep.collectives if GRAD_SYNC not in c.source]
    assert all(c.payload_bytes == 4 for c in others) and len(others) <= 2, others


def test_batchnorm_adds_only_batch_statistics_all_reduces():
    model, rep = report("cnn")
    others = [c for c in rep.collectives if GRAD_SYNC not in c.source and c.payload_bytes > 4]
    assert others and all(c.kind == "all-reduce" for c in others)
    # every non-scalar extra collective serves a BatchNorm layer (forward stats or their backward)
    assert all(c.source.startswith(("bn1", "bn2")) for c in others), [c.source for c in others]
    channels = model.bn1.num_features
    assert all(c.payload_bytes == channels * 4 for c in others)


def test_bucketing_sets_the_number_of_gradient_collectives():
    model, step = compiled("gpt", bucket_bytes=None)
    _, bucketed = report("gpt", bucket_bytes=16 * 1024)
    tensors = len(list(model.parameters()))
    # unbucketed: one per stored tensor (the blocks' tensors are stored stacked, one per position)
    assert len(grad_collectives(step.report())) == len(step.state.params) < tensors
    n = len(grad_collectives(bucketed))
    # greedy buckets: about param bytes / bucket size, a tensor larger than a bucket alone
    assert math.ceil(param_bytes(model) / (16 * 1024)) <= n <= 2 * math.ceil(param_bytes(model) / (16 * 1024))
    assert n < tensors / 3
    assert sum(c.payload_bytes for c in grad_collectives(bucketed)) == param_bytes(model)


def test_bf16_gradient_communication_halves_the_payload():
    model, rep = report("mlp", comm_dtype="bfloat16")
    assert sum(c.payload_bytes for c in grad_collectives(rep)) == param_bytes(model) // 2


def test_bf16_gradient_communication_trains_close_to_fp32():
    torch.manual_seed(0)
    model, batches = MLP(), mlp_batches()
    result = run_parity(model, lambda p: torch.optim.SGD(p, lr=0.1), batches, xtrain.Mesh(data=8),
                        grad_sync=xtrain.GradSync(comm_dtype="bfloat16"))
    # bf16 keeps 8 bits of mantissa: losses agree to ~1e-3, not to the fp32 bar
    assert result.loss_rel_diff < 1e-2
    assert max(result.param_diffs().values()) < 1e-2


def test_wire_bytes_follow_ring_algorithms():
    _, rep = report("gpt")
    for c in rep.collectives:
        n = c.group_size
        assert n == 8
        assert c.wire_bytes == pytest.approx(2 * (n - 1) / n * c.payload_bytes)
    text = str(rep)
    assert "all-reduce" in text and "wire bytes per axis: data:" in text


class UsesCholesky(nn.Module):
    """A Cholesky factorization of per-sample matrices: a factorization xtrain keeps whole (no
    partition rule), reached by the batch-split activations under data parallelism."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.head = nn.Linear(9, 5)

    def forward(self, x, y):
        m = torch.tanh(self.fc(x)).reshape(-1, 3, 4)
        spd = m @ m.transpose(1, 2) + torch.diag_embed(torch.full_like(m[..., 0], 4.0))
        return nn.functional.cross_entropy(self.head(torch.linalg.cholesky(spd).reshape(-1, 9)), y)


def test_op_without_rule_raises_by_default_and_replicates_when_the_plan_says():
    """The first step raises UnsupportedOpError (op, module, split, bytes, the fix); with
    Plan(fallback="replicate") it trains with parity, and the report's collectives table and
    the cost model's collectives mark the fallback's gathers."""
    from xtrain.cost import program as program_mod, search
    from xtrain.errors import UnsupportedOpError

    torch.manual_seed(0)
    model, batches = UsesCholesky(), mlp_batches()
    make_opt = lambda p: torch.optim.SGD(p, lr=0.1)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=make_opt(model.parameters()))
    with pytest.raises(UnsupportedOpError, match=r"no partition rule for cholesky .*split \[data, -, -\].*fallback='replicate'"):
        step(*batches[0])
    plan = xtrain.Plan(fallback="replicate")
    assert_parity(run_parity(model, make_opt, batches, xtrain.Mesh(data=8), plan=plan))
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=make_opt(model.parameters()), plan=plan)
    report = step.report(*batches[0])
    assert any("no partition rule for cholesky" in n and "<top level>" in n for n in report.notes), report.notes
    marked = [c for c in report.collectives if c.fallback]
    assert marked and {c.kind for c in marked} == {"all-gather"} and "FALLBACK cholesky" in str(report)
    traced = program_mod.abstract_step(step.trainable, {"data": 8}, plan, tuple(b.numpy() for b in batches[0]))
    charged = [c for c in search.step_cost(traced, {"data": 8}, 8).collectives if c.fallback == "cholesky"]
    assert sum(c.payload_bytes for c in charged) == sum(c.payload_bytes for c in marked)
