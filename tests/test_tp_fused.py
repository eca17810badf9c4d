"""Megatron plans derived from the graph (xtrain.plans.megatron) on fused projections and state-space
mixers: ModernBERT's fused Wqkv reshaped into (q | k | v, heads, head_dim) splits per segment by
heads, Mamba's in/out projections and d_inner channels split like an MLP. Each trains with parity
on Mesh(data=4, tensor=2) and leaves at most 5% of its parameters whole."""
import functools

import pytest
import torch
import transformers as tf

import xtrain
from test_pipeline import train
from tp_models import VOCAB, batches, lm_loss
from xtrain import plans
from xtrain.testing import assert_parity, torch_reference

MESH = dict(data=4, tensor=2)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def modernbert():
    return tf.ModernBertForMaskedLM(tf.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        global_attn_every_n_layers=3, local_attention=8, max_position_embeddings=64, embedding_dropout=0.0,
        mlp_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0,
        sep_token_id=0))


MODELS = {"modernbert": modernbert}


@functools.cache
def case(name):
    torch.manual_seed(0)
    model, data = MODELS[name](), batches()
    return model, data, plans.megatron(model, MESH, example=data[0], loss_fn=lm_loss)


@pytest.mark.unit
def test_modernbert_fused_wqkv_splits_per_segment_by_heads():
    _, _, plan = case("modernbert")
    qkv = xtrain.Segments(("tensor",), (32, 32, 32))
    assert plan.params["model.layers.*.attn.Wqkv.weight"] == (qkv, None)
    assert plan.params["model.layers.*.attn.Wo.weight"] == (None, "tensor")
    assert ("model.layers.*.attn.Wo contracts the 4 heads of model.layers.*.attn.Wqkv's output: model.layers.*.attn."
            "Wqkv column-parallel, model.layers.*.attn.Wo row-parallel over tensor=2 (2 of 4 heads per device)") \
        in plan.notes


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(MODELS))
def test_parity_and_sharded(name):
    model, data, plan = case(name)
    plans.assert_sharded(plan, model, MESH, max_replicated=0.05)
    result, step = train(model, sgd, data, MESH, plan, torch_reference(model, sgd, data, lm_loss), loss_fn=lm_loss)
    assert_parity(result)
    # the per-segment splits stay local: nothing is gathered back to torch's order
    assert not [n for n in step.report().notes if "without a per-segment rule" in n]
