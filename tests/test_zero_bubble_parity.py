"""zbh1 and zbv train like one device (HF Llama, Mesh(data=2, pipe=4), 8 microbatches; the parity
standard, AdamW), runs each stage's forward, input-gradient and weight-gradient matmuls once per
microbatch (no masked or recomputed matmuls, unlike 1F1B's lockstep executor), and says so in
its report."""
import copy
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import xtrain
from xtrain import observe
from xtrain.lowering.pipeline.zero_bubble import stage_matmul_flops
from xtrain.testing import assert_parity, torch_reference
from xtrain.testing.parity import ParityResult

from test_hf_models import VOCAB, adamw, lm_batches, lm_loss

pytestmark = pytest.mark.e2e


def llama(layers: int = 4):
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


def _trained(schedule: str, layers: int):
    """An HF Llama trained 4 AdamW steps by `schedule` on Mesh(data=2, pipe=4), 8 microbatches,
    checked against torch under the parity standard, and its eval loss against torch's."""
    torch.manual_seed(0)
    model, batches = llama(layers), lm_batches(n=4, batch=16)
    reference = torch_reference(model, adamw, batches, lm_loss)
    candidate = copy.deepcopy(model)
    plan = xtrain.Plan().with_pipeline(stages=4, microbatches=8, schedule=schedule)
    step = xtrain.compile(candidate, xtrain.Mesh(data=2, pipe=4), optimizer=adamw(candidate.parameters()), plan=plan,
                          loss_fn=lm_loss)
    losses = [step(*b)["loss"] for b in batches]
    assert_parity(ParityResult(losses, reference[0], step.state_dict(), reference[1], 5e-5))
    trained = llama(layers)
    trained.load_state_dict(reference[1])
    with torch.no_grad():
        expected = lm_loss(trained.eval(), *batches[0]).item()
    assert abs(step.eval(*batches[0])["loss"] - expected) <= 1e-5 * expected
    return model, step, batches


def test_zbh1_matches_torch_and_runs_each_matmul_once():
    model, step, batches = _trained("zbh1", 4)  # eval runs the GPipe forward loop over the same stages

    # per stage, the matmuls its ticks' branches run: one F, B and W per microbatch. Summed over
    # the stages that is the model's training FLOPs of one data shard's batch, plus only the
    # padding of the stage function (no masked forward, no recompute)
    per_stage = stage_matmul_flops(step.program(), step.built.table)
    model_flops = observe.model_flops(step, *batches[0]) / 2  # one of the two data shards
    assert sum(per_stage) <= 1.1 * model_flops
    assert sum(per_stage) >= 0.9 * model_flops

    text = str(step.report())
    assert "pipeline: zbh1, 4 stages x 8 microbatches, 27 ticks, bubble 11.1%" in text
    assert "a tick runs one F, B or W per stage (lax.switch)" in text
    # memory: what 1F1B needs plus the buffers that keep residuals from F to W (the report's figure)
    held = re.search(r"buffers for (\d+) microbatches, a scratch slot and the tick's own: ([\d.]+) MiB per device",
                     text)
    assert held and int(held.group(1)) == max(step.built.table.held(s) for s in range(4))
    other = copy.deepcopy(model)
    one_f_one_b = xtrain.compile(other, xtrain.Mesh(data=2, pipe=4), optimizer=adamw(other.parameters()),
                                 loss_fn=lm_loss,
                                 plan=xtrain.Plan().with_pipeline(stages=4, microbatches=8, schedule="1f1b"))
    temporaries = lambda s: s.compiled(*batches[0]).memory_analysis().temp_size_in_bytes
    assert temporaries(step) <= temporaries(one_f_one_b) + float(held.group(2)) * 2**20


def test_zbv_matches_torch_and_runs_each_matmul_once():
    """zbv on Mesh(data=2, pipe=4): an 8-layer HF Llama as 8 virtual stages laid out as a V (stage
    s holds layers s and 7 - s; the loss on stage 0), 8 microbatches: the parity standard against
    torch, eval through the same table, one F, B and W per (microbatch, chunk) and no masked
    matmuls, and a bubble below zbh1's in the report."""
    _, step, batches = _trained("zbv", 8)
    per_stage = stage_matmul_flops(step.program(), step.built.table)
    model_flops = observe.model_flops(step, *batches[0]) / 2
    assert 0.9 * model_flops <= sum(per_stage) <= 1.1 * model_flops
    text = str(step.report())
    assert "pipeline: zbv, 4 stages x 8 microbatches x 2 chunks, 51 ticks, bubble 5.9%" in text
    assert "stage 0 chunk 1: model.layers.7..model.layers.7, epilogue (head, loss)" in text
