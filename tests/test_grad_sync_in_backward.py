"""The layer scan's gradients all-reduced inside the backward pass (GradSync.in_backward): one
bucket per layer where the backward scan produces it, counted with a whole iteration of compute
to hide behind; training equal to torch and to the post-backward sync; a bad batch on one device
still skips the step on every device; by default only layers with at least LAYER_BYTES of
gradients sync this way."""
import functools

import pytest
import torch

import xtrain
from xtrain.lowering import gradient_sync
from xtrain.testing import assert_parity, run_parity

from models import GPT, token_batches

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
    with pytest.raises(IndexError, match="The update was skipped"):
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
