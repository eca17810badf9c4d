"""The layer scan's gradients all-reduced inside the backward pass (GradSync.in_backward): one
bucket per layer where the backward scan produces it, counted with a whole iteration of compute
to hide behind; training equal to torch and to the post-backward sync; a bad batch on one device
still skips the step on every device; by default only layers with at least LAYER_BYTES of
gradients sync this way. Under ZeRO-2 the tensors it splits are reduce-scattered there instead
(one bucket per layer), the update taking the blocks as they are."""
import functools

import pytest
import torch

import xtrain
from xtrain import plans
from xtrain.errors import BatchIndexError
from xtrain.lowering import gradient_sync
from xtrain.testing import assert_parity, run_parity

from models import GPT, token_batches

pytestmark = pytest.mark.e2e

LAYERS = 4
IN_BACKWARD = "xtrain.grad_sync.in_backward"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


@functools.cache
def compiled(in_backward, layers=LAYERS, d=32):
    torch.manual_seed(0)
    model = GPT(layers=layers, d=d)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), scan_layers=True,
                          grad_sync=xtrain.GradSync(in_backward=in_backward))
    losses = [step(*b)["loss"] for b in token_batches(n=4)]
    return model, step, losses


def test_each_layer_is_one_all_reduce_inside_the_backward_scan():
    model, step, _ = compiled(True)
    rep = step.report()
    per_layer = [c for c in rep.collectives if IN_BACKWARD in c.source]
    layer_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert [(c.kind, c.axes, c.payload_bytes) for c in per_layer] == [("all-reduce", ("data",), layer_bytes)] * LAYERS
    # the rest (embeddings, final norm) leave after the backward pass in one bucket
    after = [c for c in rep.collectives if "xtrain.grad_sync.bucket" in c.source]
    assert len(after) == 1 and after[0].payload_bytes + LAYERS * layer_bytes == \
        sum(p.numel() * 4 for p in model.parameters())
    # a layer's gradients feed no loop carry: the next iteration's compute hides them
    assert all(c.overlap_flops > 0 for c in per_layer)
    plain = [c for c in compiled(False)[1].report().collectives if "xtrain.grad_sync" in c.source]
    assert len(plain) == 1 and plain[0].overlap_flops == 0


def test_in_backward_sync_trains_like_torch_and_like_the_post_backward_sync():
    torch.manual_seed(0)
    assert_parity(run_parity(GPT(layers=LAYERS), sgd, token_batches(n=4), xtrain.Mesh(data=8), scan_layers=True,
                             grad_sync=xtrain.GradSync(in_backward=True)))
    assert compiled(True)[2] == compiled(False)[2]


def test_a_bad_index_on_one_device_skips_the_step_everywhere():
    _, step, _ = compiled(True)
    x, y = token_batches(n=1, seed=5)[0]
    y[-1, 3] = 999  # only the last device's rows
    before = step.state_dict()
    with pytest.raises(BatchIndexError, match="The update was skipped"):
        step(x, y)
    assert all(torch.equal(before[k], v) for k, v in step.state_dict().items())
    assert any("xtrain.input_checks.any_device" in c.source for c in step.report().collectives)


def test_by_default_only_layers_of_a_mebibyte_sync_inside_the_backward_pass():
    assert not gradient_sync.per_layer(xtrain.GradSync(), gradient_sync.LAYER_BYTES - 1)
    assert gradient_sync.per_layer(xtrain.GradSync(), gradient_sync.LAYER_BYTES)
    assert gradient_sync.per_layer(xtrain.GradSync(in_backward=True), 4)
    assert not gradient_sync.per_layer(xtrain.GradSync(in_backward=False), 1 << 30)
    assert not gradient_sync.reduces_in_backward(xtrain.GradSync(comm_dtype="int8"), 1)
    assert not gradient_sync.reduces_in_backward(xtrain.GradSync(), accumulate=2)
    model, step, _ = compiled(None, layers=2, d=160)  # 12 d^2 weights: 1.2 MB of gradients per layer
    assert sum(p.numel() * 4 for p in model.blocks[0].parameters()) >= gradient_sync.LAYER_BYTES
    assert sum(IN_BACKWARD in c.source for c in step.report().collectives) == 2
    _, small, _ = compiled(None)
    assert not any(IN_BACKWARD in c.source for c in small.report().collectives)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


@functools.cache
def zero2(in_backward, d=32):
    torch.manual_seed(0)
    model = GPT(layers=LAYERS, d=d)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), scan_layers=True,
                          plan=xtrain.Plan(zero=2), grad_sync=xtrain.GradSync(in_backward=in_backward))
    losses = [step(*b)["loss"] for b in token_batches(n=4)]
    return model, step, losses


def test_zero2_reduce_scatters_each_layer_inside_the_backward_scan():
    model, step, losses = zero2(True)
    collectives = step.report().collectives
    per_layer = [c for c in collectives if IN_BACKWARD in c.source]
    layer_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())  # every tensor splits over 8
    assert [(c.kind, c.axes, c.payload_bytes) for c in per_layer] == \
        [("reduce-scatter", ("data",), layer_bytes)] * LAYERS
    assert all(c.overlap_flops > 0 for c in per_layer)
    # after the backward pass only the embeddings and final norm are reduce-scattered, once
    after = [c for c in collectives if c.kind == "reduce-scatter" and IN_BACKWARD not in c.source]
    assert [c.payload_bytes + LAYERS * layer_bytes for c in after] == [sum(p.numel() * 4 for p in model.parameters())]
    assert not any("xtrain.grad_sync.bucket" in c.source for c in collectives)  # nothing all-reduced
    assert losses == zero2(False)[2]
    plain = [c for c in zero2(False)[1].report().collectives if c.kind == "reduce-scatter"]
    assert len(plain) == 1 and plain[0].overlap_flops == 0


def test_zero2_in_backward_trains_like_torch():
    torch.manual_seed(0)
    assert_parity(run_parity(GPT(layers=LAYERS), adamw, token_batches(n=4), xtrain.Mesh(data=8), scan_layers=True,
                             plan=xtrain.Plan(zero=2), grad_sync=xtrain.GradSync(in_backward=True)))


def test_zero2_in_backward_with_tensor_parallel_weights_trains_like_torch():
    # a layer's tensor-parallel shards and its replicated tensors vary over other axes: two buckets
    torch.manual_seed(0)
    model, batches, mesh = GPT(layers=LAYERS), token_batches(n=4), xtrain.Mesh(data=4, tensor=2)
    plan = xtrain.Plan(params=plans.megatron(model, mesh, example=batches[0]).params, zero=2)
    assert_parity(run_parity(model, adamw, batches, mesh, plan=plan, scan_layers=True,
                             grad_sync=xtrain.GradSync(in_backward=True)))


def test_zero2_tensors_no_dim_of_which_splits_are_all_reduced_in_the_backward_scan_instead():
    # d=36: the (36,) vectors and 36x36 weights have no dim 8 divides; ZeRO-2 keeps their optimizer
    # state whole and their gradients are all-reduced, each layer's in one bucket beside its
    # reduce-scatter of the MLP weights and bias (144 rows)
    model, step, losses = zero2(True, d=36)
    per_layer = [c for c in step.report().collectives if IN_BACKWARD in c.source]
    scattered = [p for p in model.blocks[0].parameters() if any(s % 8 == 0 for s in p.shape)]
    scattered_bytes = sum(p.numel() * 4 for p in scattered)
    layer_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    assert len(scattered) == 3 and sorted((c.kind, c.payload_bytes) for c in per_layer) == \
        [("all-reduce", layer_bytes - scattered_bytes)] * LAYERS + [("reduce-scatter", scattered_bytes)] * LAYERS
    # the all-reduced tensors meet other tensors in their buckets than after the backward pass:
    # the same sums, added in another order
    assert losses == pytest.approx(zero2(False, d=36)[2], rel=1e-6)
