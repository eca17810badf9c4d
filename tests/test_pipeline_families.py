"""Pipelines of repeated-block models whose layers are not all alike as traced: HF Gemma-3 under
sdpa at 16 tokens with a window of 8 (HF repeats keys and values per query head in the masked
sliding layers and groups them in the unmasked full layers), ModernBERT (alternating local and
global attention; layer 0 has no attention norm) and T5 (layer 0 of each stack computes the
position bias the others read; two stacks) train on two stages like torch."""
import functools

import pytest
import torch
import transformers as tf

import xtrain
from test_pipeline import train
from tp_models import VOCAB, batches, lm_loss
from xtrain.testing import assert_parity, torch_reference

MESH = dict(pipe=2, data=4)


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def gemma3():
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], bos_token_id=0, eos_token_id=0, pad_token_id=0))


def modernbert():
    return tf.ModernBertForMaskedLM(tf.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        global_attn_every_n_layers=2, local_attention=8, max_position_embeddings=64, embedding_dropout=0.0,
        mlp_dropout=0.0, attention_dropout=0.0, pad_token_id=0, bos_token_id=0, eos_token_id=0, cls_token_id=0,
        sep_token_id=0))


def t5():
    return tf.T5ForConditionalGeneration(tf.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=3, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


MODELS = {"gemma3": gemma3, "modernbert": modernbert, "t5": t5}


@functools.cache
def case(name):
    torch.manual_seed(0)
    model, data = MODELS[name](), batches(n=4, batch=8, seq=16)
    plan = xtrain.Plan().with_pipeline(stages=2, microbatches=2)
    return train(model, sgd, data, MESH, plan, torch_reference(model, sgd, data, lm_loss), loss_fn=lm_loss)


@pytest.mark.e2e
@pytest.mark.parametrize("name,family,layers", [("gemma3", "model.layers.0 .. model.layers.1", [1, 1]),
                                                ("modernbert", "model.layers.1 .. model.layers.2", [1, 1]),
                                                ("t5", "encoder.block.1 .. encoder.block.2", [1, 1])])
def test_pipeline_parity(name, family, layers):
    result, step = case(name)
    assert_parity(result)
    (blocks,) = step.lowered.findings.repeated
    assert blocks.span() == family
    assert list(step.lowered.findings.stage_layers) == layers
