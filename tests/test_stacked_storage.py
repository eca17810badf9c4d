"""Block parameters stored stacked per block position: the emitted program (and so the compile)
stays the same size whatever the depth, the user still sees per-layer names, checkpoints load
across the two layouts, and families that may not share one array stay per layer."""
import functools

import numpy as np
import pytest
import torch
from jax.extend import core as jcore

import xtrain
from xtrain import plans
from xtrain.ir.stacked import Stacking, is_stacked, member
from xtrain.testing import assert_parity, run_parity, torch_reference

from models import GPT, token_batches


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def equations(closed) -> int:
    def count(jaxpr):
        return sum(1 + sum(count(sub) for sub in jcore.jaxprs_in_params(e.params)) for e in jaxpr.eqns)
    return count(closed.jaxpr)


@functools.cache
def gpt_step(layers: int, scan_layers: bool = True, mesh=(("data", 8),)):
    torch.manual_seed(0)
    model = GPT(layers=layers)
    return model, xtrain.compile(model, xtrain.Mesh(**dict(mesh)), optimizer=sgd(model.parameters()),
                                 scan_layers=scan_layers)


def program_size(name: str, layers: int, scan_layers: bool = True) -> int:
    """Equations of the emitted training program (nothing is compiled or run)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from test_hf_models import VOCAB, lm_batches, lm_loss

    torch.manual_seed(0)
    if name == "gpt":
        model, loss_fn, batch = GPT(layers=layers), None, token_batches(1)[0]
    elif name == "hf_gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32))
        loss_fn, batch = lm_loss, lm_batches(1)[0]
    else:
        model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=32))
        loss_fn, batch = lm_loss, lm_batches(1)[0]
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          loss_fn=loss_fn, scan_layers=scan_layers)
    return equations(step.program(*batch))


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["gpt", "hf_gpt2", "hf_llama"])
def test_program_size_is_flat_in_depth(name):
    """What keeps compile time flat in depth (issue 3; benchmarks/compile_depth.py times it):
    8 layers emit exactly the program 2 layers do. Unrolled, the program grows with depth."""
    assert program_size(name, 2) == program_size(name, 8)
    if name == "gpt":
        assert program_size(name, 8, scan_layers=False) > program_size(name, 2, scan_layers=False)


@pytest.mark.e2e
def test_state_is_stacked_and_the_user_sees_layers():
    model, step = gpt_step(4)
    q = step.state.params["blocks.*.attn.q.weight"]
    assert q.shape == (4, 32, 32) and step.param_specs["blocks.*.attn.q.weight"] == (None,)
    assert "blocks.0.attn.q.weight" not in step.state.params and "tok.weight" in step.state.params
    state = step.state_dict()
    assert state.keys() == model.state_dict().keys()
    np.testing.assert_array_equal(state["blocks.2.attn.q.weight"].numpy(), np.asarray(q[2]))
    families = len(step.layout.stacking.groups)
    assert f"{families} block parameter families stored stacked (4 layers each); the layer scan reads {families} " \
           "of them in place" in str(step.report(*token_batches(1)[0]))


@pytest.mark.e2e
@pytest.mark.parametrize("saved_stacked", [True, False], ids=["stacked->per-layer", "per-layer->stacked"])
def test_checkpoints_load_across_layouts(tmp_path, saved_stacked):
    batches = token_batches(n=4)
    torch.manual_seed(0)
    model = GPT(layers=2)
    reference = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model.parameters()),
                               scan_layers=saved_stacked)
    for b in batches[:2]:
        reference(*b)
    reference.save(tmp_path / "ckpt")
    expected = [reference(*b)["loss"] for b in batches[2:]]
    torch.manual_seed(1)  # other initial weights: the load must replace them all
    other = GPT(layers=2)
    target = xtrain.compile(other, xtrain.Mesh(data=4, tensor=2), optimizer=sgd(other.parameters()),
                            plan=plans.megatron(other, xtrain.Mesh(data=4, tensor=2), example=batches[0]),
                            scan_layers=not saved_stacked)
    assert any(is_stacked(n) for n in (target.state.params if not saved_stacked
                                                                else reference.state.params))
    target.load(tmp_path / "ckpt")
    got = [target(*b)["loss"] for b in batches[2:]]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    mine, theirs = target.state_dict(), reference.state_dict()
    assert max(float((mine[k] - theirs[k]).abs().max()) for k in mine) <= 1e-5


@pytest.mark.e2e
def test_families_split_across_param_groups_stay_per_layer():
    """Layer 0 and layer 1 in different optimizer groups (different lr): they cannot share one
    stacked array; training still matches torch."""
    torch.manual_seed(0)
    model = GPT(layers=2)

    def groups(params):
        params = list(params)
        first = {id(p) for p in model.blocks[0].parameters()}
        return torch.optim.SGD([{"params": [p for p in params if id(p) in first], "lr": 0.05},
                                {"params": [p for p in params if id(p) not in first]}], lr=0.2, momentum=0.9)

    reference = torch_reference(model, groups, token_batches(4))
    result = run_parity(model, groups, token_batches(4), xtrain.Mesh(data=8), reference=reference)
    assert_parity(result)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=groups(model.parameters()))
    assert "blocks.0.attn.q.weight" in step.state.params and not any("*" in n for n in step.state.params)


@pytest.mark.unit
def test_stacking_finds_only_complete_agreeing_families():
    names = ["h.0.w", "h.1.w", "h.2.w", "h.0.b", "h.2.b", "x.0.v", "x.1.v", "top.w"]
    agree = lambda n: "odd" if n == "x.1.v" else "same"
    stacking = Stacking.find(names, agree)
    assert dict(stacking.groups) == {"h.*.w": ("h.0.w", "h.1.w", "h.2.w")}
    assert stacking.stored_names(names) == ["h.*.w", "h.0.b", "h.2.b", "x.0.v", "x.1.v", "top.w"]
    assert member("h.*.w", 2) == "h.2.w" and member("top.w", 2) == "top.w"
    values = {n: np.full((2,), i) for i, n in enumerate(names)}
    assert stacking.unstack_dict(stacking.stack_dict(values)).keys() == values.keys()
