"""HF transformers causal LMs (tiny configs, random init, no download) train with xtrain and
match single-device torch (the parity standard)."""
import functools

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import xtrain
from xtrain.testing import assert_parity, run_parity, torch_reference

pytestmark = pytest.mark.e2e

# Odd vocabulary: a size that no mesh axis divides shows up any dimension mix-up.
VOCAB = 101
MESHES = {"data8": dict(data=8), "data2": dict(data=2, rest=4)}


def lm_loss(model, ids, labels):
    # HF models take keyword arguments; the batch xtrain passes is positional.
    return model(input_ids=ids, labels=labels).loss


def lm_batches(n=4, batch=8, seq=16, seed=5):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
        out.append((ids, ids))  # HF shifts the labels itself
    return out


def gpt2():
    # Dropout off: the parity standard compares deterministic training.
    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama():
    # Grouped-query attention: 4 query heads share 2 key/value heads.
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        bos_token_id=0, eos_token_id=0))


def sgd(params):
    # GPT-2's fused c_attn carries key biases whose exact gradient is zero; Adam would turn
    # their rounding noise into lr-sized flips (parity standard), SGD keeps it proportional.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def adamw(params):
    # Llama has no biases, so every gradient is well above rounding noise: AdamW is fair.
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


CASES = {"gpt2": (gpt2, sgd), "llama": (llama, adamw)}


@functools.cache
def case(name):
    make_model, make_opt = CASES[name]
    torch.manual_seed(0)
    model, batches = make_model(), lm_batches()
    return model, make_opt, batches, torch_reference(model, make_opt, batches, lm_loss)


@pytest.mark.parametrize("name,mesh", [("gpt2", "data8"), ("gpt2", "data2"), ("llama", "data8")])
def test_hf_parity(name, mesh):
    model, make_opt, batches, reference = case(name)
    result = run_parity(model, make_opt, batches, xtrain.Mesh(**MESHES[mesh]), loss_fn=lm_loss,
                        reference=reference)
    assert_parity(result)


def test_gpt2_tied_embeddings_stay_tied_and_load_strict():
    model, _, batches, _ = case("gpt2")
    trained = GPT2LMHeadModel(model.config)
    trained.load_state_dict(model.state_dict())
    step = xtrain.compile(trained, xtrain.Mesh(data=8), optimizer=sgd(trained.parameters()), loss_fn=lm_loss)
    for batch in batches:
        step(*batch)
    state = step.state_dict()
    assert set(state) == set(model.state_dict())
    assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
    assert not torch.equal(state["transformer.wte.weight"], model.state_dict()["transformer.wte.weight"])
    fresh = gpt2()
    fresh.load_state_dict(state, strict=True)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(fresh.lm_head.weight, state["lm_head.weight"])
