"""ZeRO stages 1-3: parity with torch, the collectives each stage emits, and memory."""
import copy
import functools
import re

import numpy as np

import pytest
import torch
from torch import nn

import xtrain
from xtrain import plans
from xtrain.testing import assert_parity, run_parity, torch_reference

from models import GPT, token_batches

pytestmark = pytest.mark.e2e


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


@functools.cache
def gpt_case():
    torch.manual_seed(0)
    model, batches = GPT(layers=2), token_batches()
    return model, batches, torch_reference(model, adamw, batches)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_matches_torch(stage):
    model, batches, reference = gpt_case()
    assert_parity(run_parity(model, adamw, batches, xtrain.Mesh(data=8), plan=xtrain.Plan(zero=stage),
                             reference=reference))


def test_tensor_parallel_with_zero3_matches_torch_in_both_lowerings():
    model, batches, reference = gpt_case()
    mesh = dict(data=4, tensor=2)
    plan = xtrain.Plan(params=plans.megatron(model, mesh, example=batches[0]).params, zero=3)
    explicit = run_parity(model, adamw, batches, xtrain.Mesh(**mesh), plan=plan, reference=reference)
    xla = run_parity(model, adamw, batches, xtrain.Mesh(**mesh), plan=plan, reference=reference, lowering="xla")
    assert_parity(explicit)
    assert_parity(xla)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_zero2_unrolled_match_torch(stage):
    # what scan_layers="auto" runs with one device per process: per-layer tensors, many of them
    # in one bucket
    model, batches, reference = gpt_case()
    assert_parity(run_parity(model, adamw, batches, xtrain.Mesh(data=8), plan=xtrain.Plan(zero=stage),
                             reference=reference, scan_layers=False))


@pytest.mark.parametrize("stage", [1, 2])
def test_tensor_parallel_with_zero1_and_zero2_matches_torch(stage):
    # Megatron splits weights on the tensor axis; ZeRO cuts each local block again over data,
    # on whichever dimension is left: the bucketed collectives reassemble blocks of any dim
    model, batches, reference = gpt_case()
    mesh = dict(data=4, tensor=2)
    plan = xtrain.Plan(params=plans.megatron(model, mesh, example=batches[0]).params, zero=stage)
    assert_parity(run_parity(model, adamw, batches, xtrain.Mesh(**mesh), plan=plan, reference=reference))


class Wide(nn.Module):
    """Every dimension divisible by 8, nothing tied: each parameter is used once, so each
    collective's payload is exactly its parameter's bytes."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)


def wide_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 16, generator=g), torch.randint(0, 8, (16,), generator=g)


@functools.cache
def wide_report(stage, bucket_bytes=25 * 2**20, precision="fp32"):
    torch.manual_seed(0)
    model = Wide()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          plan=xtrain.Plan(zero=stage, precision=precision),
                          grad_sync=xtrain.GradSync(bucket_bytes=bucket_bytes))
    step(*wide_batch())
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    tensors = len(list(model.parameters()))
    # leave out the scalar loss and its token count
    return [c for c in step.report().collectives if c.payload_bytes > 4], param_bytes, tensors


def kinds(collectives):
    out = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0) + c.payload_bytes
    return out


def test_ddp_all_reduces_the_parameter_bytes_once():
    collectives, param_bytes, _ = wide_report(0)
    assert kinds(collectives) == {"all-reduce": param_bytes}


def test_zero1_all_reduces_then_gathers_updated_parameters():
    collectives, param_bytes, _ = wide_report(1)
    assert kinds(collectives) == {"all-reduce": param_bytes, "all-gather": param_bytes}


def test_zero2_reduce_scatters_gradients():
    collectives, param_bytes, _ = wide_report(2)
    assert kinds(collectives) == {"reduce-scatter": param_bytes, "all-gather": param_bytes}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_zero2_move_one_bucket_per_collective_not_one_tensor(stage):
    collectives, _, tensors = wide_report(stage)
    counts = {k: sum(c.kind == k for c in collectives) for k in kinds(collectives)}
    assert tensors == 6 and counts == ({"all-reduce": 1, "all-gather": 1} if stage == 1 else
                                       {"reduce-scatter": 1, "all-gather": 1})
    # buckets of at most 64x64 fp32 (fc2.weight alone), filled in name order (gradients: the
    # reverse): fc1.bias+fc1.weight+fc2.bias / fc2.weight / head.bias+head.weight
    collectives, param_bytes, _ = wide_report(stage, bucket_bytes=64 * 64 * 4)
    gathers = [c.payload_bytes for c in collectives if c.kind == "all-gather"]
    assert sorted(gathers) == sorted([(64 + 64 * 16 + 64) * 4, 64 * 64 * 4, (8 + 8 * 64) * 4])
    if stage == 2:
        scatters = [c.payload_bytes for c in collectives if c.kind == "reduce-scatter"]
        assert sorted(scatters) == sorted(gathers) and sum(scatters) == param_bytes


def test_zero3_gathers_in_forward_and_again_in_backward_and_costs_1_5x_ddp():
    collectives, param_bytes, tensors = wide_report(3)
    # forward: every parameter once; backward: again every weight its backward reads, i.e.
    # fc2's and head's weight matrices: not fc1.weight (the input needs no gradient, so x @ W1
    # needs no W1 backward) nor the biases (a bias's gradient does not read the bias)
    regathered = (64 * 64 + 8 * 64) * 4
    assert kinds(collectives) == {"all-gather": param_bytes + regathered, "reduce-scatter": param_bytes}
    assert sum(c.kind == "all-gather" for c in collectives) == tensors + 2
    ddp, _, _ = wide_report(0)
    ratio = sum(c.wire_bytes for c in collectives) / sum(c.wire_bytes for c in ddp)
    # ring: ((n-1)/n (P + regathered) + (n-1)/n P) vs 2(n-1)/n P: 1.5x when all is re-gathered
    assert ratio == pytest.approx(1 + regathered / (2 * param_bytes))


@functools.cache
def peak_bytes(stage, data):
    torch.manual_seed(0)
    model = GPT(layers=4, d=128)
    mesh = xtrain.Mesh(data=data, rest=8 // data) if data < 8 else xtrain.Mesh(data=8)
    step = xtrain.compile(model, mesh, optimizer=adamw(model.parameters()), plan=xtrain.Plan(zero=stage))
    memory = step.report(*token_batches(n=1, batch=8)[0]).memory
    return memory["arguments"] + memory["temporaries"]


def test_zero3_peak_memory_falls_with_data_and_stays_below_zero1():
    peaks = [peak_bytes(3, n) for n in (2, 4, 8)]
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert peaks[2] < 0.7 * peak_bytes(1, 8), (peaks[2], peak_bytes(1, 8))


def test_zero3_under_bf16_gathers_and_scatters_matmul_weights_in_bf16():
    """bf16 compute casts each weight for its matmul: the cast runs on the shard, so the
    gather and its transpose (the gradient's reduce-scatter) move bf16, half of fp32's bytes;
    biases (added in float32) move as before."""
    collectives, param_bytes, _ = wide_report(3, precision="bf16")
    weights, regathered = (16 * 64 + 64 * 64 + 8 * 64) * 4, (64 * 64 + 8 * 64) * 4
    biases = param_bytes - weights
    assert kinds(collectives) == {"all-gather": weights // 2 + biases + regathered // 2,
                                  "reduce-scatter": weights // 2 + biases}


def zero3_gpt(precision):
    model, batches, _ = gpt_case()
    model = copy.deepcopy(model)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()),
                          plan=xtrain.Plan(zero=3, precision=precision))
    losses = np.array([step(*b)["loss"] for b in batches])
    collectives = step.report(*batches[0]).collectives
    # the layers' weight gathers (not the FP8 scales' amax: one float per device)
    gathers = [c.payload_bytes for c in collectives if c.kind == "all-gather" and "blocks" in c.source
               and c.payload_bytes > 4 * 8]
    scatters = [c.payload_bytes for c in collectives if c.kind == "reduce-scatter" and "blocks" in c.source]
    return losses, gathers, scatters, step


def test_zero3_layer_scan_gathers_weights_in_bf16_and_trains_as_fp32_does():
    """In the layer scan each layer's weights are one flat all-gather: under bf16 it carries the
    matrices in bf16 (their only use is the matmul's cast), the norm weights apart in fp32; the
    losses stay within bf16's tolerance of torch's fp32 ones (as in test_precision_remat)."""
    model, _, reference = gpt_case()
    (fp32_losses, fp32, _, _), (bf16_losses, bf16, scattered, step) = zero3_gpt("fp32"), zero3_gpt("bf16")
    layers, matrices = len(model.blocks), sum(p.numel() * 4 for n, p in model.named_parameters()
                                              if n.startswith("blocks.") and p.ndim == 2)
    vectors = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 1)
    # fp32: one flat gather per layer, forward and again in the backward; bf16: the matrices in
    # bf16 (forward and backward's re-gather), the vectors (norm weights, biases) apart in fp32,
    # gathered once here
    assert sum(fp32) == 2 * (matrices + vectors) and len(fp32) == 2 * layers, fp32
    assert sum(bf16) == 2 * matrices // 2 + vectors and len(bf16) == 3 * layers, bf16
    assert sum(scattered) == matrices // 2 + vectors, scattered  # the gradients: the gathers' transposes
    matrices_per_layer = sum(p.ndim == 2 for n, p in model.named_parameters() if n.startswith("blocks.0."))
    assert f"each layer gathers {matrices_per_layer} weights as bfloat16" in "\n".join(step.report().notes)
    np.testing.assert_allclose(fp32_losses, reference[0], rtol=1e-5)
    rel = np.abs(bf16_losses - np.asarray(reference[0])) / np.asarray(reference[0])
    assert 0 < rel.max() <= 2e-3, rel


def test_zero3_under_fp8_gathers_the_matmul_weights_as_e4m3():
    """An FP8 matmul quantizes its weight with the whole tensor's scale (its amax max-reduced
    over the shards): on the shard, so the gather moves the e4m3 bytes, a quarter of float32's,
    in the layer scan too (the flat gather leaves those weights to their matmuls); their
    gradients are reduce-scattered in fp8's wire dtype, bf16. The values
    are those quantizing the gathered weight gives: the first loss equals the data-parallel run's."""
    model, batches, _ = gpt_case()
    _, fp32, _, _ = zero3_gpt("fp32")
    fp8_losses, fp8, scattered, step = zero3_gpt("fp8")
    matrices = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2)
    vectors = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 1)
    assert sum(fp32) == 2 * (matrices + vectors)
    assert sum(fp8) == 2 * matrices // 4 + vectors, fp8  # forward and the backward's re-gather
    assert sum(scattered) == matrices // 2 + vectors, scattered  # gradients in the wire dtype, bf16
    assert "weights as e4m3 (their FP8 matmuls quantize the shards)" in "\n".join(step.report().notes)
    assert re.search(r"f8_e4m3fn\[[\d,]*\] = all_gather", str(step.program(*batches[0])))
    m = copy.deepcopy(model)
    ddp = xtrain.compile(m, xtrain.Mesh(data=8), optimizer=adamw(m.parameters()), plan=xtrain.Plan(precision="fp8"))
    ddp_losses = [ddp(*b)["loss"] for b in batches]
    # the first step's forward is the same arithmetic; then the gradients' sums differ in order
    # and wire dtype (DDP's all-reduce crosses in bf16), which FP8's rounding amplifies
    np.testing.assert_allclose(fp8_losses[0], ddp_losses[0], rtol=1e-6)
    np.testing.assert_allclose(fp8_losses, ddp_losses, rtol=5e-3)
