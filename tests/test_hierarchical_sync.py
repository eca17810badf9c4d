"""Hierarchical gradient all-reduce when the batch spans two mesh axes (node x local):
reduce-scatter over local, all-reduce of the shard over node, all-gather over local."""
import functools

import pytest
import torch

import xtrain
from xtrain import plans
from xtrain.errors import OptionsError
from xtrain.testing import assert_parity, run_parity

from models import GPT, token_batches

pytestmark = pytest.mark.e2e

GRAD_SYNC = "xtrain.grad_sync"
MESH = dict(node=2, local=4)
PLAN = xtrain.Plan(batch=(("node", "local"),))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@functools.cache
def grad_collectives(hierarchical, bucket_bytes=25 * 2**20):
    torch.manual_seed(0)
    model = GPT()
    step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=PLAN,
                          grad_sync=xtrain.GradSync(hierarchical=hierarchical, bucket_bytes=bucket_bytes))
    step(*token_batches(n=1)[0])
    rep = step.report()
    params = sum(p.numel() * 4 for p in model.parameters())
    return [c for c in rep.collectives if GRAD_SYNC in c.source], rep, params


def test_hierarchical_sync_matches_torch():
    torch.manual_seed(0)
    assert_parity(run_parity(GPT(), sgd, token_batches(), xtrain.Mesh(**MESH), plan=PLAN))


def test_hybrid_plan_with_hierarchical_sync_matches_torch():
    torch.manual_seed(0)
    model = GPT()
    plan = plans.hybrid(model, MESH, shard_axis="local")
    assert_parity(run_parity(model, sgd, token_batches(), xtrain.Mesh(**MESH), plan=plan))


@pytest.mark.parametrize("bucket_bytes", [25 * 2**20, 16 * 1024])
def test_each_bucket_is_reduce_scatter_local_all_reduce_node_all_gather_local(bucket_bytes):
    grads, _, params = grad_collectives(True, bucket_bytes)
    assert len(grads) % 3 == 0 and len(grads) > 0
    buckets = [grads[i:i + 3] for i in range(0, len(grads), 3)]
    padded = 0
    for scatter, reduce, gather in buckets:
        assert (scatter.kind, scatter.axes) == ("reduce-scatter", ("local",))
        assert (reduce.kind, reduce.axes) == ("all-reduce", ("node",))
        assert (gather.kind, gather.axes) == ("all-gather", ("local",))
        assert scatter.payload_bytes % (4 * 4) == 0  # padded to a multiple of local=4 elements
        assert reduce.payload_bytes * 4 == scatter.payload_bytes == gather.payload_bytes
        padded += scatter.payload_bytes
    assert params <= padded < params + len(buckets) * 4 * 4
    if bucket_bytes < params:
        assert len(buckets) > 1


def test_node_axis_carries_one_local_th_of_a_flat_all_reduce():
    grads, rep, params = grad_collectives(True)
    flat, flat_rep, _ = grad_collectives(False)
    assert [(c.kind, c.axes) for c in flat] == [("all-reduce", ("node", "local"))] * len(flat)
    assert sum(c.payload_bytes for c in flat) == params
    node_wire = sum(c.wire_bytes for c in grads if c.axes == ("node",))
    padded = sum(c.payload_bytes for c in grads if c.kind == "reduce-scatter")
    # a flat ring all-reduce of the whole buffer over node=2 sends 2(n-1)/n P = P per device
    assert node_wire == pytest.approx(padded / MESH["local"])
    assert node_wire == pytest.approx(sum(c.payload_bytes for c in flat) / MESH["local"], rel=1e-3)
    assert "node" in rep.bytes_per_axis() and "local" in rep.bytes_per_axis()


def test_one_gradient_axis_keeps_the_flat_all_reduce():
    torch.manual_seed(0)
    model = GPT()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))
    step(*token_batches(n=1)[0])
    grads = [c for c in step.report().collectives if GRAD_SYNC in c.source]
    assert grads and all(c.kind == "all-reduce" and c.axes == ("data",) for c in grads)


def test_inner_axes_must_exist():
    torch.manual_seed(0)
    model = GPT()
    with pytest.raises(OptionsError, match=r"GradSync.inner_axes=\('gpu',\).*no axis 'gpu'"):
        xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()), plan=PLAN,
                       grad_sync=xtrain.GradSync(inner_axes=("gpu",)))
