"""Trace options travel with the plan and the step, never on the user's module (issue 35, item 3).

A Megatron plan of a grouped-query Llama whose key/value heads tensor=2 does not divide traces
attention with keys and values repeated per query head, and with sequence-parallel marks on the
blocks. Those choices are the plan's (`plan.trace`); the front end installs them only while it
traces, so the module is unchanged afterwards and a later data-parallel compile of the same
module traces torch's own attention.
"""
import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import xtrain
from xtrain import plans
from xtrain.ir.trace_options import SequenceParallel, TraceOptions
from xtrain.sharding.plan import Plan

from test_hf_models import VOCAB, lm_batches, lm_loss

pytestmark = pytest.mark.e2e  # compiles and runs steps of an HF Llama


def gqa_llama():
    # 6 query heads over 3 key/value heads: tensor=2 splits the queries only (keys/values repeated)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, max_position_embeddings=32, bos_token_id=0, eos_token_id=0))


def snapshot(module: torch.nn.Module) -> dict:
    """Per submodule: its hooks (every table) and its attribute names."""
    tables = ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
    return {path: ({t: dict(getattr(m, t)) for t in tables}, sorted(m.__dict__))
            for path, m in module.named_modules()}


def ddp_program(model, batch, plan=None) -> str:
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=lm_loss, plan=plan)
    return str(step.program(*batch))


def test_megatron_leaves_the_module_as_it_was_and_ddp_after_it_traces_torchs_attention():
    model, batch = gqa_llama(), lm_batches(n=1, batch=8, seq=16)[0]
    before, ddp_before = snapshot(model), ddp_program(model, batch)
    plan = plans.megatron(model, dict(data=4, tensor=2), sequence_parallel=True)
    step = xtrain.compile(model, xtrain.Mesh(data=4, tensor=2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          plan=plan, loss_fn=lm_loss)
    assert snapshot(model) == before  # planning (pending) leaves nothing
    step(*batch)
    assert snapshot(model) == before  # nor deriving the rules, compiling, tracing and one step
    trace = step.plan.trace
    assert trace.head_split == 2 and trace.sequence_parallel.blocks == ("model.layers.0", "model.layers.1")
    assert "trace: query heads split 2 ways" in str(step.plan)
    assert ddp_program(model, batch) == ddp_before  # the later DDP compile: no k/v repeat, no marks
    assert snapshot(model) == before


def test_the_plans_trace_options_reach_the_trace():
    """The same DDP compile under a head split traces another program (keys/values repeated): the
    comparison above can fail."""
    model, batch = gqa_llama(), lm_batches(n=1, batch=8, seq=16)[0]
    plain = ddp_program(model, batch)
    split = ddp_program(model, batch, Plan(trace=TraceOptions(head_split=2)))
    assert split != plain
    assert ddp_program(model, batch) == plain


def test_trace_options_are_printable_plain_data():
    sp = SequenceParallel(blocks=["a.0", "a.1"], spec=["data", "tensor", None])
    trace = TraceOptions(head_split=2, sequence_parallel=sp)
    assert sp.blocks == ("a.0", "a.1") and sp.spec == ("data", "tensor", None)
    assert str(TraceOptions()) == "" and TraceOptions().is_default
    assert str(trace) == ("query heads split 2 ways (keys/values repeated where that cuts GQA groups); sequence "
                          "parallel ('data', 'tensor', None) at the inputs and outputs of 2 blocks")
    plan = Plan(trace=trace)
    ring = "the sequence is split over 'context' (ring attention runs the blockwise kernel)"
    assert plan.trace_options(dict(data=4, context=2), "explicit") == dataclasses.replace(
        trace, no_nki=ring, no_cudnn=ring)
    ulysses = dataclasses.replace(plan, context="ulysses").trace_options(dict(data=4, context=2), "explicit")
    assert ulysses == dataclasses.replace(trace, ulysses=2)  # cuDNN and NKI see whole sequences
    assert "heads split 2 ways over 'context' (Ulysses)" in str(ulysses)
    assert plan.trace_options(dict(data=8), "xla").no_nki.startswith("lowering='xla'")
    assert plan.trace_options(dict(data=8), "explicit") == trace
