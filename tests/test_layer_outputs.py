"""Per-layer outputs of repeated blocks: a value each layer computes that is read after the
blocks (HF Mixtral's router logits, which its load-balancing loss reads once the layers are
done) leaves the layer scan as a per-layer output, and the model trains as torch does (the
parity standard) as one layer scan. A model whose own loop adds up such a term between the
layers (tests/test_moe.py's MoE) has that side computation moved after the blocks. The
pipeline, whose stages pass on only the residual stream, refuses per-layer outputs naming the
value and its module."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import xtrain
from xtrain.errors import UnsupportedError
from xtrain.testing import assert_parity, run_parity

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


def test_pipeline_refuses_per_layer_outputs_naming_the_value_and_module():
    model, make_opt, loss_fn, batches, _ = case("mixtral")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(pipe=2, data=4), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          plan=xtrain.Plan().with_pipeline(stages=2, microbatches=2))
    with pytest.raises(UnsupportedError, match=r"pipeline parallelism of .*: the result of op \w+ in "
                                               r"model\.layers\.0\.mlp\.gate \(float32\[\d+,4\]\) is read after the blocks "
                                               r"model\.layers\.0 \.\. model\.layers\.1, once per layer .* "
                                               r"output_router_logits=False"):
        step(*batches[0])
