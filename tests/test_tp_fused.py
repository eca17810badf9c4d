"""Megatron plans derived from the graph (xtrain.plans.megatron) on fused projections and state-space
mixers: ModernBERT's fused Wqkv reshaped into (q | k | v, heads, head_dim) splits per segment by
heads, Falcon's multi-query query_key_value splits its query heads and keeps the key/value heads
whole, Bloom's ALiBi attention over batch x heads merged into one dim keeps its heads split, Mamba's
in/out projections and d_inner channels split like an MLP. Each trains with parity
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


def mamba():  # the pure-torch path (no CUDA kernels): in_proj (x | z), a depthwise conv, x_proj, dt_proj, out_proj
    return tf.MambaForCausalLM(tf.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_mambapy=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def falcon():  # multi-query attention through one fused query_key_value: (4 query heads | k | v) x head_dim 8
    return tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


def bloom():  # ALiBi attention over batch x heads merged into one dim (baddbmm, bmm)
    return tf.BloomForCausalLM(tf.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0,
                                              attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


def falcon_alibi():  # RefinedWeb-style Falcon: ALiBi over merged batch x heads, q | k | v interleaved per head, biases
    return tf.FalconForCausalLM(tf.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
        new_decoder_architecture=False, parallel_attn=False, bias=True, alibi=True, hidden_dropout=0.0,
        attention_dropout=0.0, bos_token_id=0, eos_token_id=0))


MODELS = {"modernbert": modernbert, "mamba": mamba, "falcon": falcon, "bloom": bloom, "falcon_alibi": falcon_alibi}


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


@pytest.mark.unit
def test_mamba_mixer_splits_like_an_mlp():
    """in_proj's x | z per segment, the depthwise conv and the per-channel state parameters
    (A_log through -exp, D, dt_proj's bias) with the channels, x_proj and out_proj row-parallel."""
    _, _, plan = case("mamba")
    mixer = {k.removeprefix("backbone.layers.*.mixer."): v for k, v in plan.params.items() if ".mixer." in k}
    assert mixer == {"in_proj.weight": (xtrain.Segments(("tensor",), (64, 64)), None),
                     "conv1d.weight": ("tensor", None, None), "conv1d.bias": ("tensor",),
                     "dt_proj.weight": ("tensor", None), "dt_proj.bias": ("tensor",), "A_log": ("tensor", None),
                     "D": ("tensor",), "x_proj.weight": (None, "tensor"), "out_proj.weight": (None, "tensor")}


@pytest.mark.unit
def test_falcon_multi_query_keeps_key_value_heads_whole():
    """Falcon's fused query_key_value (4 query heads | 1 key head | 1 value head): the query heads
    split, the key and value heads stored as one segment and gathered after the product."""
    _, _, plan = case("falcon")
    assert plan.params["transformer.h.*.self_attention.query_key_value.weight"] == (
        xtrain.Segments(("tensor",), (32, 16)), None)
    assert plan.params["transformer.h.*.self_attention.dense.weight"] == (None, "tensor")
    assert any("segments of [4, 1, 1] heads" in n and "stored together as [32, 16]" in n for n in plan.notes)
    assert any("(2 of 4 heads per device)" in n for n in plan.notes)


@pytest.mark.unit
def test_bloom_splits_heads_through_batch_times_heads():
    """Bloom's attention merges (batch, heads) into one dim for baddbmm with the ALiBi bias and
    bmm, and splits it back: the heads' split passes through, so query_key_value is
    column-parallel (its q, k, v interleaved per head: a contiguous split) and dense row-parallel."""
    _, _, plan = case("bloom")
    assert plan.params["transformer.h.*.self_attention.query_key_value.weight"] == ("tensor", None)
    assert plan.params["transformer.h.*.self_attention.query_key_value.bias"] == ("tensor",)
    assert plan.params["transformer.h.*.self_attention.dense.weight"] == (None, "tensor")


@functools.cache
def trained(name):
    model, data, plan = case(name)
    return train(model, sgd, data, MESH, plan, torch_reference(model, sgd, data, lm_loss), loss_fn=lm_loss)


@pytest.mark.e2e
@pytest.mark.parametrize("name", list(MODELS))
def test_parity_and_sharded(name):
    model, data, plan = case(name)
    plans.assert_sharded(plan, model, MESH, max_replicated=0.05)
    result, step = trained(name)
    assert_parity(result)
    # the per-segment splits stay local: nothing is gathered back to torch's order
    assert not [n for n in step.report().notes if "without a per-segment rule" in n]


@pytest.mark.e2e
def test_falcon_moves_only_the_key_value_heads():
    """Per layer: one all-gather of the key and value heads forward (2 heads x head_dim 8 x 16
    tokens x 2 local sequences x 4 bytes) and one reduce-scatter of their gradient backward,
    besides the column/row all-reduces; no gather of the query heads."""
    _, step = trained("falcon")
    moved = [(c.kind, c.payload_bytes) for c in step.report().collectives
             if c.axes == ("tensor",) and c.kind != "all-reduce" and "self_attention" in c.source]
    assert sorted(moved) == [("all-gather", 2048)] * 2 + [("reduce-scatter", 2048)] * 2


@pytest.mark.e2e
def test_bloom_attention_moves_only_its_row_parallel_sums():
    """Batch x heads merged stays split per segment (each device its batch rows' heads; the ALiBi
    bias taken locally): over tensor the attention moves only the row-parallel output's sum
    forward and the column input's gradient sum backward, per layer; nothing is gathered."""
    _, step = trained("bloom")
    moved = [(c.kind, c.payload_bytes) for c in step.report().collectives
             if c.axes == ("tensor",) and "self_attention" in c.source]
    assert sorted(moved) == [("all-reduce", 4096)] * 4
    assert not [n for n in step.report().notes if "split per segment" in n and "gathered" in n]
