"""Per-layer outputs of repeated blocks: a value each layer computes that is read after the
blocks (HF Mixtral's router logits, which its load-balancing loss reads once the layers are
done) leaves the layer scan as a per-layer output, and the model trains as torch does (the
parity standard) as one layer scan. A model whose own loop adds up such a term between the
layers (tests/test_moe.py's MoE) has that side computation moved after the blocks. In a
pipeline the per-layer outputs travel with the activation to the last stage's loss."""
import copy

import numpy as np

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xtrain
from xtrain.testing import ParityResult, assert_parity, run_parity

from models import mlp_batches
from test_moe import case, sgd

pytestmark = pytest.mark.e2e

PER_LAYER = "value(s) each layer computes are read after the blocks and leave them per layer"


def notes_of(model, make_opt, loss_fn, batch, mesh, plan, scan):
    m = copy.deepcopy(model)
    step = xtrain.compile(m, mesh, optimizer=make_opt(m.parameters()), loss_fn=loss_fn, plan=plan, scan_layers=scan)
    return step.report(*batch).notes


@pytest.mark.parametrize("layout", ["data8", "megatron", "unrolled"])
def test_router_logits_leave_the_layer_scan_and_training_matches_torch(layout):
    """Mixtral with output_router_logits: both layers' router logits (64 tokens x 4 experts
    each) are read by the load-balancing loss after the layers; one layer scan (or, with
    scan_layers=False, the same blocks one after another), torch's training."""
    model, make_opt, loss_fn, batches, reference = case("mixtral")
    mesh = xtrain.Mesh(data=4, tensor=2) if layout == "megatron" else xtrain.Mesh(data=8)
    plan = xtrain.plans.megatron(model, mesh, example=batches[0], loss_fn=loss_fn) if layout == "megatron" else None
    scan = layout != "unrolled"
    notes = notes_of(model, make_opt, loss_fn, batches[0], mesh, plan, scan)
    how = "as one layer scan (scan_layers=True)" if scan else "unrolled, one after another (scan_layers=False)"
    assert f"repeated blocks (2 layers) run {how}" in notes, notes
    collected = [n for n in notes if PER_LAYER in n]
    assert len(collected) == 1 and "model.layers.0.mlp.gate" in collected[0], notes
    assert_parity(run_parity(model, make_opt, batches, mesh, plan=plan, loss_fn=loss_fn, reference=reference,
                             scan_layers=scan))


def test_a_load_balancing_term_summed_between_the_layers_moves_after_the_layer_scan():
    """The MoE written in tests/test_moe.py adds each layer's balance term inside its own layer
    loop; the blocks still run as one layer scan (the term reads the per-layer router logits
    after it) and train as torch does."""
    model, make_opt, loss_fn, batches, reference = case("moe")
    mesh = xtrain.Mesh(data=8)
    notes = notes_of(model, make_opt, loss_fn, batches[0], mesh, None, True)
    assert "repeated blocks (2 layers) run as one layer scan (scan_layers=True)" in notes, notes
    assert any(PER_LAYER in n and "blocks.0.gate (float32[64,4])" in n for n in notes), notes
    assert_parity(run_parity(model, make_opt, batches, mesh, loss_fn=loss_fn, reference=reference, scan_layers=True))


class EveryLayer(nn.Module):
    """3 identical layers; the loss also reads the hidden states of the first two (the residual
    stream, which the next layer reads as well)."""

    def __init__(self, d=12):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(d, 5)

    def forward(self, x, y):
        states = []
        for block in self.blocks:
            x = block(x)
            states.append(x)
        return F.cross_entropy(self.head(x), y) + 0.1 * sum((h * h).mean() for h in states[:-1])


def test_every_layers_hidden_states_leave_the_layer_scan():
    torch.manual_seed(0)
    model, batches = EveryLayer(), mlp_batches(n=4)
    notes = notes_of(model, sgd, None, batches[0], xtrain.Mesh(data=8), None, True)
    assert "repeated blocks (3 layers) run as one layer scan (scan_layers=True)" in notes, notes
    assert any(PER_LAYER in n and "blocks.0.1 (float32[16,12])" in n for n in notes), notes
    assert_parity(run_parity(model, sgd, batches, xtrain.Mesh(data=8), scan_layers=True))


class Halved(EveryLayer):
    """The loop halves the residual stream between layers: the next layer reads that, so it
    cannot move after the blocks."""

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x) * 0.5
        return F.cross_entropy(self.head(x), y)


def test_a_term_between_the_layers_that_the_next_layer_reads_stays_in_place():
    torch.manual_seed(0)
    model, batches = Halved(), mlp_batches(n=4)
    notes = notes_of(model, sgd, None, batches[0], xtrain.Mesh(data=8), None, True)
    assert any("the 3 numbered layers run as traced" in n for n in notes), notes
    assert_parity(run_parity(model, sgd, batches, xtrain.Mesh(data=8), scan_layers=True))


def accumulated(model, make_opt, loss_fn, batches, microbatches: int, rows_per_device: int):
    """torch on one device accumulating gradients over the pipeline's microbatches. The pipeline
    splits each device's rows (rows_per_device consecutive rows of the batch) into `microbatches`,
    so microbatch i holds row i of every device's block; a loss term over all layers of a
    microbatch (Mixtral's load balancing, not a sum over tokens) is computed per microbatch, as
    torch accumulating those rows computes it."""
    model = copy.deepcopy(model).train()
    optimizer = make_opt(model.parameters())
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        rows = torch.arange(batch[0].shape[0]).reshape(-1, rows_per_device)
        total = 0.0
        for i in range(microbatches):
            part = rows[:, i::microbatches].reshape(-1)
            loss = loss_fn(model, *[x[part] for x in batch]) / microbatches
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def pipelined(name, schedule, **plan):
    model, make_opt, loss_fn, batches, whole = case(name)
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=2, pipe=2, expert=2), optimizer=make_opt(m.parameters()),
                          loss_fn=loss_fn, plan=xtrain.Plan(**plan).with_pipeline(stages=2, microbatches=2,
                                                                                   schedule=schedule))
    outs = [step(*b) for b in batches]
    want = accumulated(model, make_opt, loss_fn, batches, 2, 2)  # 8 rows over data x expert = 4 devices
    return ParityResult([o["loss"] for o in outs], want[0], step.state_dict(), want[1], 5e-5), step, outs, whole


@pytest.mark.parametrize("name,schedule", [("mixtral", "gpipe"), ("mixtral", "zbh1"), ("moe", "1f1b")])
def test_per_layer_outputs_travel_through_pipeline_stages(name, schedule):
    """Mixtral's router logits (its load-balancing loss reads every layer's) and the MoE written
    here (its loop adds each layer's auxiliary term) on Mesh(data=2, pipe=2, expert=2): each stage
    writes its layers' values into buffers that travel with the activation, the last stage's loss
    reads them, and their gradients travel back. Training matches torch accumulating the same
    microbatches (the parity standard); the whole batch's loss differs (the term is per microbatch)."""
    result, step, _, whole = pipelined(name, schedule)
    assert_parity(result)
    assert any("travel with the activation to the last stage" in n for n in step.report().notes)
    assert abs(result.losses[0] - whole[0][0]) > 1e-4 * abs(whole[0][0])  # not torch's whole-batch loss


def test_capacity_inside_stages_with_router_logits():
    """Plan(capacity_factor) with Mixtral's router logits in a pipeline: a factor with room for every
    pair (4 experts, top-2: 2.0) drops none and trains as torch does; 1.25 drops pairs every step."""
    roomy, _, outs, _ = pipelined("mixtral", "1f1b", capacity_factor=2.0)
    assert_parity(roomy)
    assert all(int(sum(o["expert_dropped"].values())) == 0 for o in outs)
    tight, _, outs, _ = pipelined("mixtral", "1f1b", capacity_factor=1.25)
    assert all(int(sum(o["expert_dropped"].values())) > 0 for o in outs)
    assert all(np.isfinite(tight.losses)) and tight.losses != pytest.approx(roomy.losses, rel=1e-5)  # the drops count