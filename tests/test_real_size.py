"""Real-size planning without weights: models built on the meta device (torch.device("meta") or
xtrain.checkpoint.meta_params()) plan through the search from shapes alone, the model is traced
once per batch signature for a whole search, and a `verify` hook (the target compiler's word)
can overrule the cost model's fit."""
import collections
import contextlib
import dataclasses
import time

import jax
import numpy as np
import pytest
import torch
import transformers

import xtrain
from xtrain.cost import hardware, program, search
from xtrain.frontend.torch_module import wrap
from xtrain.ir.replay import MODEL_TRACE_EVENT
from xtrain.lowering.assembly import TRACE_EVENT

C = search.Candidate
LM = lambda m, ids, labels: m(input_ids=ids, labels=labels).loss


def llama_config(**dims) -> transformers.LlamaConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaConfig(**{**base, **dims})


@contextlib.contextmanager
def counted():
    events = collections.Counter()
    listen = lambda event, **_: events.update([event])
    jax.monitoring.register_event_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(listen)


def planned(module, batch, candidates, target="p5.48xlarge:1", **kw):
    t = wrap(module, torch.optim.AdamW(module.parameters()), loss_fn=LM)
    profile, devices = hardware.target(target)
    return search.search(t.model, t.tx, batch, profile, devices, structure=t.structure, candidate_list=candidates,
                         **kw)


@pytest.mark.e2e
@pytest.mark.parametrize("build", ["meta_device", "meta_params"])
def test_a_model_without_weights_plans_and_is_traced_once_for_the_whole_search(build):
    scope = torch.device("meta") if build == "meta_device" else xtrain.checkpoint.meta_params()
    with scope:
        module = transformers.LlamaForCausalLM(llama_config())
    batch = (np.zeros((16, 16), np.int64),) * 2
    plans = [C(data=8), C(data=8, zero=3), C(data=4, tensor=2)]
    with counted() as events:
        result = planned(module, batch, plans)
    assert all(r.prediction is not None for r in result.rows), str(result)
    assert result.best is not None
    assert events[TRACE_EVENT] == len(plans)      # each candidate's step is its own program...
    assert events[MODEL_TRACE_EVENT] == 1         # ...over one trace of the model, replayed
    assert all(p.is_meta for p in module.parameters())  # nothing materialised
    if build == "meta_device":
        assert all(b.is_meta for b in module.buffers())


@pytest.mark.e2e
def test_a_pipeline_search_traces_the_model_once_per_microbatch_shape():
    with xtrain.checkpoint.meta_params():
        module = transformers.LlamaForCausalLM(llama_config())
    batch = (np.zeros((16, 16), np.int64),) * 2
    plans = [C(data=4, pipe=2, microbatches=2), C(data=2, pipe=2, microbatches=4, tensor=2)]
    with counted() as events:
        planned(module, batch, plans)
    # the whole batch (the search's model facts), 16 / (4 x 2) and 16 / (2 x 4) rows
    assert events[MODEL_TRACE_EVENT] == 3, dict(events)


@pytest.mark.e2e
def test_pipelines_on_two_meshes_replay_one_trace_of_the_microbatch():
    with xtrain.checkpoint.meta_params():
        module = transformers.LlamaForCausalLM(llama_config())
    batch = (np.zeros((16, 16), np.int64),) * 2
    # the same microbatch (16 / 2 = 8 rows) on two meshes, in bf16: the kept trace's derivative-rule
    # thunks (custom_vjp / custom_jvp) were first called under the first pipeline's mesh and handed
    # it to the second, whose lowering failed
    plans = [C(data=4, pipe=2, microbatches=2, precision="bf16"),
             C(data=2, pipe=2, microbatches=2, tensor=2, precision="bf16")]
    with counted() as events:
        result = planned(module, batch, plans)
    assert all(r.prediction is not None for r in result.rows), str(result)
    # the whole batch in fp32 (the search's model facts) and in bf16, and the microbatch once for both meshes
    assert events[MODEL_TRACE_EVENT] == 3, dict(events)


@pytest.mark.e2e
def test_a_50b_parameter_model_on_the_meta_device_plans_in_seconds():
    """200 GB of fp32 weights, planned on a machine with a tenth of that: only shapes are read.
    A candidate whose state alone cannot fit is refused without a trace."""
    config = llama_config(vocab_size=128256, hidden_size=32768, intermediate_size=131072, num_attention_heads=64,
                          num_key_value_heads=8, num_hidden_layers=3)
    with torch.device("meta"):
        module = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in module.parameters())
    assert params > 50e9
    start = time.perf_counter()
    with counted() as events:
        result = planned(module, (np.zeros((64, 16), np.int64),) * 2,
                         [C(data=64), C(data=64, zero=1), C(data=64, zero=3), C(data=8, tensor=8, zero=1)],
                         target="p5.48xlarge:8")
    elapsed = time.perf_counter() - start
    rows = {r.candidate.name: r for r in result.rows}
    # replicated: 4 B of weights, 4 of gradients and 8 of AdamW moments per parameter on every GPU
    for name in ("dp64", "dp64 zero1"):  # ZeRO-1 still holds whole weights and gradients: 8 B x 54e9 > 80 GiB
        assert rows[name].prediction is None and rows[name].reason.startswith(search.STATE_ALONE), rows[name]
    assert search.listing.size(16 * params) in rows["dp64"].reason  # AdamW: 8 B per parameter, the rest 4 + 4
    zero3, tp = rows["dp64 zero3"].prediction, rows["dp8xtp8 zero1"].prediction
    # traced and costed (a whole 17B-parameter layer gathered at once does not fit either; its floor does)
    assert zero3 is not None and zero3.memory_bytes >= 16 * params / 64
    assert tp is not None and tp.memory_bytes >= (8 * params + 8 * params / 8) / 8
    assert events[TRACE_EVENT] == 2                # only the two candidates that could fit are traced
    assert elapsed < 180, elapsed
    assert all(p.is_meta for p in module.parameters())


@pytest.mark.e2e
def test_a_candidate_the_compiler_says_does_not_fit_is_never_picked():
    with xtrain.checkpoint.meta_params():
        module = transformers.LlamaForCausalLM(llama_config())
    batch = (np.zeros((16, 16), np.int64),) * 2
    plans = [C(data=8), C(data=8, zero=1), C(data=8, zero=3)]
    asked = []

    def verify(row, plan):  # a stand-in compiler that rejects every plan without ZeRO-3
        asked.append((row.candidate.name, plan.zero))
        fits = plan.zero == 3
        return search.Verified(fits=fits, memory_bytes=row.prediction.memory_bytes * (1 if fits else 10 ** 6))

    result = planned(module, batch, plans, verify=verify, verify_top=1)
    plain = search.pick([dataclasses.replace(r, verified=None) for r in result.rows])
    assert plain.candidate.zero != 3                        # the cost model alone prefers another
    assert result.best.candidate.zero == 3 and result.best.verified.fits
    assert [z for _, z in asked][-1] == 3 and len(asked) <= len(plans)
    assert "compiled:" in str(result) and "does NOT fit" in str(result)


@pytest.mark.unit
def test_the_state_floor_divides_what_each_plan_splits():
    """Candidate.state_floor: weights P, gradients P, optimizer O bytes; ZeRO-1/2/3 split O, then the
    gradients, then the weights over data; tensor, pipeline and expert degrees divide everything
    (a lower bound); an offloaded optimizer state is not on the device."""
    P, O = 4 * 10**9, 8 * 10**9
    assert C(data=8).state_floor(P, O) == 2 * P + O
    assert C(data=8, zero=1).state_floor(P, O) == 2 * P + O // 8
    assert C(data=8, zero=2).state_floor(P, O) == P + (P + O) // 8
    assert C(data=8, zero=3).state_floor(P, O) == (2 * P + O) // 8
    assert C(data=2, tensor=4, zero=1).state_floor(P, O) == (2 * P + O // 2) // 4
    assert C(data=4, pipe=2, microbatches=2).state_floor(P, O) == (2 * P + O) // 2
    assert C(data=8, offload="optimizer").state_floor(P, O) == 2 * P
    assert C(data=8, remat=True).state_floor(P, O) == C(data=8).state_floor(P, O)  # remat saves activations only


@pytest.mark.unit
def test_state_totals_read_the_optimizers_own_state():
    with torch.device("meta"):
        module = transformers.LlamaForCausalLM(llama_config())
    n = sum(p.numel() for p in module.parameters())
    adamw = wrap(module, torch.optim.AdamW(module.parameters()), loss_fn=LM)
    sgd = wrap(module, torch.optim.SGD(module.parameters(), lr=0.1), loss_fn=LM)
    params, moments = program.state_totals(adamw.model, adamw.tx)
    assert params == 4 * n and 8 * n <= moments <= 8 * n + 64    # two fp32 moments (and a step count)
    assert program.state_totals(sgd.model, sgd.tx)[1] <= 64       # plain SGD keeps no per-parameter state
