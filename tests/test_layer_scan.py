"""Repeated blocks are lowered as one scan with L iterations, and training still matches torch."""
import dataclasses
import functools

import pytest
import torch
from jax.extend import core as jcore
from torch import nn
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import xtrain
from xtrain import errors
from xtrain.ir import stacked
from xtrain.sharding import layout
from xtrain.testing import assert_parity, run_parity

from models import GPT, token_batches
from test_hf_models import VOCAB, lm_batches, lm_loss

LAYERS = 4


def scan_lengths(closed) -> list[int]:
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if str(eqn.primitive) == "scan":
                found.append(eqn.params["length"])
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return found


def sgd(params):
    # SGD: a deep model's smallest gradients sit near rounding noise, which Adam would turn
    # into lr-sized sign flips on any layout (the parity standard).
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def hf_gpt2():
    return GPT2LMHeadModel(GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def hf_llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32))


def hf_bert():
    return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=32,
                                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


MODELS = {
    "gpt": (lambda: GPT(layers=LAYERS), None, token_batches, "blocks"),
    "hf_gpt2": (hf_gpt2, lm_loss, lm_batches, "transformer.h"),
    "hf_llama": (hf_llama, lm_loss, lm_batches, "model.layers"),
    "hf_bert": (hf_bert, lm_loss, lm_batches, "bert.encoder.layer"),
}


@functools.cache
def compiled(name, scan_layers=True):
    make, loss_fn, batches, _ = MODELS[name]
    torch.manual_seed(0)
    model = make()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), loss_fn=loss_fn,
                          scan_layers=scan_layers)
    return model, step, batches(4)


@pytest.mark.e2e
@pytest.mark.parametrize("name", MODELS)
def test_blocks_become_one_scan_and_training_matches_torch(name):
    model, step, batches = compiled(name)
    prefix = MODELS[name][3]
    # the forward scan and its transpose in the backward pass, each with L iterations
    assert scan_lengths(step.program(*batches[0])) == [LAYERS, LAYERS]
    assert [(r.prefix, r.length) for r in step.lowered.findings.repeated] == [(prefix, LAYERS)]
    assert_parity(run_parity(model, sgd, batches, xtrain.Mesh(data=8), loss_fn=MODELS[name][1], scan_layers=True))


@pytest.mark.e2e
def test_scan_layers_off_unrolls():
    _, step, batches = compiled("gpt", scan_layers=False)
    assert scan_lengths(step.program(*batches[0])) == []


def dot_shapes(closed) -> list[tuple]:
    """(lhs shape, rhs shape, dimension numbers) of every dot_general of a program."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if str(eqn.primitive) == "dot_general":
                found.append((eqn.invars[0].aval.shape, eqn.invars[1].aval.shape, eqn.params["dimension_numbers"]))
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return found


@pytest.mark.e2e
def test_linear_layers_multiply_tokens_flattened():
    """An activation (B, T, D) times a weight runs as (B*T, D) x weight, so the backward's
    weight gradient is a 2-D product contracting the tokens: XLA:CPU reads the output gradient
    in place. On (B, T, D) it copied the gradient transposed, re-computing in each copy the
    elementwise ops that produced it (e.g. GPT unrolled: 18 of 61 ms per step)."""
    model, step, batches = compiled("gpt", scan_layers=False)
    dots = dot_shapes(step.program(*batches[0]))
    weights = [(lhs, rhs, dn) for lhs, rhs, dn in dots if len(rhs) == 2 and not dn[1][0]]
    assert weights and all(len(lhs) == 2 for lhs, _, _ in weights), weights
    tokens = batches[0][0].numel() // 8  # each device's B*T
    gradients = [(lhs, rhs) for lhs, rhs, ((lc, rc), _) in dots
                 if len(lhs) == len(rhs) == 2 and lc == (0,) and rc == (0,) and lhs[0] == tokens]
    assert len(gradients) >= sum(isinstance(m, nn.Linear) for m in model.modules()), gradients


def all_gather_sources(closed) -> list[str]:
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if str(eqn.primitive) == "all_gather":
                found.append(str(eqn.source_info.name_stack))
            for sub in jcore.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed.jaxpr)
    return found


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["gpt", "hf_llama"])
def test_unrolled_blocks_gather_each_layer_flat_and_train_like_torch(name):
    """scan_layers=False: no loop and per-layer storage, but still the repeated blocks'
    lowering: under ZeRO-3 one flat all-gather per layer in the forward pass and one again in
    the backward pass, and per-layer remat."""
    make, loss_fn, batches, prefix = MODELS[name]
    torch.manual_seed(0)
    model, data = make(), batches(4)
    mesh = dict(data=8)
    plan = dataclasses.replace(xtrain.plans.fsdp(model, mesh), remat="full")
    step = xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=sgd(model.parameters()), loss_fn=loss_fn, plan=plan,
                          scan_layers=False)
    program = step.program(*data[0])
    assert scan_lengths(program) == []
    assert [(r.prefix, r.length) for r in step.lowered.findings.repeated] == [(prefix, LAYERS)]
    assert not any("*" in n for n in step.state.params)  # stored per layer
    flat = [s for s in all_gather_sources(program) if "zero3_flat_gather" in s]
    assert len(flat) == 2 * LAYERS, flat
    assert_parity(run_parity(model, sgd, data, xtrain.Mesh(**mesh), plan=plan, loss_fn=loss_fn, scan_layers=False))


@pytest.mark.e2e
def test_unrolled_zero3_keeps_one_layer_gathered_like_the_scan():
    """XLA fuses reads of small weights (norm weights, biases) into the backward pass; sharing
    the flat buffer with the matrices, they kept every layer's whole buffer alive (2.5x the
    scan's temporaries). The unrolled lowering gathers the vectors apart."""
    from xtrain.lowering.report import memory_of

    torch.manual_seed(0)
    model, batch = GPT(layers=4, d=128), token_batches(n=1, batch=8)[0]
    plan = xtrain.Plan(zero=3)
    temporaries = {}
    for scan in (True, False):
        step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), plan=plan,
                              scan_layers=scan)
        temporaries[scan] = memory_of(step.compiled(batch[0], batch[1]))["temporaries"]
    assert temporaries[False] < 1.35 * temporaries[True], temporaries


@pytest.mark.e2e
@pytest.mark.parametrize("bad", ["scan", 1, None])
def test_scan_layers_takes_a_bool_or_auto(bad):
    model = GPT()
    with pytest.raises(errors.OptionsError, match=r"scan_layers=.*: use True \(one scan over the repeated blocks\), False"):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), scan_layers=bad)


@pytest.mark.unit
def test_auto_unrolls_shallow_models_on_one_device_per_process():
    names = [f"blocks.{k}.attn.weight" for k in range(3)] + ["blocks.0.extra.bias", "head.weight"]
    deep = names + ["blocks.3.attn.weight"]
    assert layout.depth(names) == 3 and layout.depth(deep) == 4 and layout.depth(["head.weight"]) == 0
    assert layout.scan_layers_for("auto", names, "gpu", 1) is False
    assert layout.scan_layers_for("auto", names, "cpu", 1) is False
    assert layout.scan_layers_for("auto", deep, "cpu", 1) is True
    assert layout.scan_layers_for("auto", names, "cpu", 8) is True  # emulated devices share the cores
    assert layout.scan_layers_for("auto", names, "gpu", 8) is False
    assert layout.scan_layers_for(True, names, "gpu", 1) is True
    assert layout.scan_layers_for(False, deep, "cpu", 8) is False


@pytest.mark.e2e
def test_default_scans_on_this_emulated_host():
    model = GPT()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))
    assert step.scan_layers is True
    assert any(stacked.is_stacked(n) for n in step.state.params)
    batch = token_batches(n=1, batch=8)[0]
    assert "repeated blocks (2 layers) run as one layer scan (scan_layers='auto')" in step.report(*batch).notes
    unrolled = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()), scan_layers=False)
    assert "repeated blocks (2 layers) run unrolled, one after another (scan_layers=False)" in \
        unrolled.report(*batch).notes


class Uneven(nn.Module):
    """Two blocks of different widths: not repeated, so nothing may be scanned."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(12, 16), nn.Linear(16, 12)])
        self.head = nn.Linear(12, 5)

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return nn.functional.cross_entropy(self.head(x), y)


@pytest.mark.e2e
def test_blocks_that_differ_are_not_scanned():
    from models import mlp_batches

    torch.manual_seed(0)
    model, batches = Uneven(), mlp_batches()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()))
    step(*batches[0])
    assert step.lowered.findings.repeated == ()
    assert_parity(run_parity(model, sgd, batches, xtrain.Mesh(data=8)))
