"""Ulysses and hybrid context parallelism (Plan(context="ulysses"), xtrain.ContextParallel(ulysses=U)):
the sequence split over `context` becomes a head split for attention by four all-to-alls (q, k,
v, the output back), or, in groups of U devices, a ring over the groups. Parity with single-device
torch for HF Llama and Mistral (grouped-query heads, fewer key/value heads than the group: they are
repeated), padded GPT-2, attention dropout drawing data parallel's masks, and clear errors."""
import copy
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import xtrain
from xtrain import plans
from xtrain.cost import hardware, search
from xtrain.cost.candidates import Candidate
from xtrain.errors import PlanError
from xtrain.frontend.structure import describe
from xtrain.frontend.torch_module import wrap
from xtrain.ir import attention as markers
from xtrain.step import host_batch
from xtrain.testing import ParityResult, assert_parity, torch_reference
from test_context_parallel import SEQ, gpt2, reference, train
from test_cudnn_attention import on_cuda  # noqa: F401 (a fixture; the module lowers cuDNN's primitives on CPU)
from test_long_sequence import VOCAB, adamw, batches, llama, lm_loss, padded_loss

BYTES = 4  # fp32


def mistral(seq=SEQ):
    """4 query heads over 2 key/value heads, a sliding window of a quarter of the sequence."""
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=seq, sliding_window=seq // 4, bos_token_id=0,
        eos_token_id=0))


def attention_all_to_alls(step, path):
    """(kind of pass, payload bytes) of the all-to-alls over `context` emitted for attention at `path`."""
    return [("backward" if c.source.split("[", 1)[-1].startswith("transpose") else "forward", c.payload_bytes)
            for c in step.report().collectives
            if c.kind == "all-to-all" and c.axes == ("context",) and c.source.startswith(path + " ")]


def ring_permutes(step, path) -> int:
    return sum(1 for c in step.report().collectives
               if c.kind == "collective-permute" and c.axes == ("context",) and c.source.startswith(path + " "))


def _mistral_parity(mesh, context, seq=SEQ):
    torch.manual_seed(0)
    model = mistral(seq)
    data = batches(seq, False, n=4, batch=8)
    want = torch_reference(model, adamw, data, lm_loss)
    m = copy.deepcopy(model)
    step = xtrain.compile(m, mesh, optimizer=adamw(m.parameters()), loss_fn=lm_loss, plan=xtrain.Plan(context=context))
    losses = [step(*b)["loss"] for b in data]
    return ParityResult(losses, want[0], step.state_dict(), want[1], 5e-5), step


PATH = "model.layers.0.self_attn"


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_ulysses_trains_like_torch_with_four_all_to_alls_per_attention(name):
    """Mesh(data=2, context=4), 1024 tokens: 2 key/value heads for 4 devices are repeated twice,
    each device attends over the whole sequence for one query head. Forward: q, k, v in and the
    output back, each local tokens x heads x head dim x 4 bytes (k, v: the repeated heads);
    backward: their transposes. No ring permute."""
    mesh = xtrain.Mesh(data=2, context=4)
    if name == "llama":
        result, step = train("llama", False, mesh, SEQ, plan=lambda m, mesh: xtrain.Plan(context="ulysses"))
    else:
        result, step = _mistral_parity(mesh, "ulysses")
    assert_parity(result)
    local_tokens = (8 // 2) * (SEQ // 4)            # batch 8 over data=2, 1024 tokens over context=4
    payload = local_tokens * 4 * 8 * BYTES          # 4 heads (kv: 2 repeated twice) x head dim 8
    assert attention_all_to_alls(step, PATH) == [("forward", payload)] * 4 + [("backward", payload)] * 4
    assert ring_permutes(step, PATH) == 0
    assert [n for n in step.report().notes if "Ulysses" in n] == [
        f"attention in {PATH!r}: Ulysses over 'context'=4 (all-to-all to a head split; 1 key/value head per "
        "device, repeated)"]
    if name == "llama":  # the plan search's candidate, lowered for an abstract mesh, has these collectives
        batch = host_batch(reference("llama", False)[1][0])
        t = step.trainable
        row = search.evaluate(t.model, t.tx, t.structure, Candidate(data=2, context=4, ulysses=4), batch,
                              hardware.profile("p4d.24xlarge"), layers=1)
        key = lambda c: (c.kind, c.axes, c.payload_bytes)
        assert sorted(map(key, row.cost.collectives)) == sorted(map(key, search.compiled_step_cost(step, *batch)
                                                                    .collectives))


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_hybrid_ulysses_in_pairs_and_a_ring_of_four_trains_like_torch(name):
    """ContextParallel(ulysses=2) on Mesh(context=8): pairs of neighbouring devices trade heads (the
    2 key/value heads split, nothing repeated), a ring over the 4 pairs passes key/value chunks."""
    mesh, context = xtrain.Mesh(context=8), xtrain.ContextParallel(ulysses=2)
    if name == "llama":
        result, step = train("llama", False, mesh, SEQ, plan=lambda m, mesh: xtrain.Plan(context=context))
    else:
        result, step = _mistral_parity(mesh, context)
    assert_parity(result)
    local_tokens = 8 * (SEQ // 8)
    q_bytes, kv_bytes = local_tokens * 4 * 8 * BYTES, local_tokens * 2 * 8 * BYTES
    assert sorted(attention_all_to_alls(step, PATH)) == sorted(
        [(p, b) for p in ("forward", "backward") for b in (q_bytes, kv_bytes, kv_bytes, q_bytes)])
    ring = f"attention in {PATH!r}: Ulysses in groups of 2 x ring attention over 4 groups on 'context'=8 "
    if name == "llama":  # the ring of 4 groups: 3 steps of (K, V) forward, 3 of (K, V, dK, dV) back and
        # dK, dV home, and the causal load balancing's exchanges
        assert ring_permutes(step, PATH) >= 2 * 3 + 4 * 3 + 2
        notes = [ring + "(causal, load-balanced chunks)"]
    else:  # Mistral's window (a quarter) hides all but the own and the previous group's chunk: 1 step
        assert ring_permutes(step, PATH) == 2 * 1 + 4 * 1 + 2
        notes = [ring + "(2 of 4 ring steps skipped: the mask's static band hides their chunks)"]
    assert [n for n in step.report().notes if "Ulysses" in n] == notes


@pytest.mark.e2e
@pytest.mark.parametrize("where", ["tensor", "pipeline"])
def test_ulysses_composes_with_tensor_parallel_and_runs_inside_pipeline_stages(where):
    """Megatron heads over `tensor` (1 key/value head per device, repeated for the 2 devices of
    `context`), and a 2-stage pipeline whose stages each run their layer's attention as Ulysses."""
    if where == "tensor":
        mesh, layers = xtrain.Mesh(data=2, context=2, tensor=2), 1
        plan = lambda m, mesh: dataclasses.replace(plans.megatron(m, mesh), context="ulysses")
    else:
        candidate = Candidate(data=2, pipe=2, context=2, ulysses=2, microbatches=2)  # as the plan search lists it
        mesh, layers = xtrain.Mesh(**candidate.mesh), 2
        plan = lambda m, mesh: candidate.plan()
    result, step = train("llama", False, mesh, 128, plan=plan, layers=layers)
    assert_parity(result)
    repeated = ", repeated" if where == "tensor" else ""
    assert [n for n in step.report().notes if "Ulysses" in n] == [
        f"attention in {PATH!r}: Ulysses over 'context'=2 (all-to-all to a head split; 1 key/value head per "
        f"device{repeated})"]
    assert len(attention_all_to_alls(step, PATH)) >= 8
    if where == "pipeline":  # the search's cost of the candidate (abstract mesh) has the compiled step's collectives
        batch = host_batch(reference("llama", False, 128, 2)[1][0])
        t = step.trainable
        row = search.evaluate(t.model, t.tx, t.structure, candidate, batch, hardware.profile("p4d.24xlarge"), layers=2)
        key = lambda c: (c.kind, c.axes, c.payload_bytes)
        assert sorted(map(key, row.cost.collectives)) == sorted(map(key, search.compiled_step_cost(step, *batch)
                                                                    .collectives))
        assert any(c.kind == "all-to-all" and c.axes == ("context",) for c in row.cost.collectives)


@pytest.mark.e2e
def test_padded_gpt2_under_ulysses_trains_like_torch():
    """A padding mask (the same for every head) reaches each device whole over the keys."""
    result, step = train("gpt2", True, xtrain.Mesh(data=2, context=4), 256,
                         plan=lambda m, mesh: xtrain.Plan(context="ulysses"))
    assert_parity(result)
    assert len(attention_all_to_alls(step, "transformer.h.0.attn")) == 8


@pytest.mark.e2e
def test_attention_dropout_under_ulysses_draws_data_parallels_masks():
    """With attention dropout on, a head-split device draws the masks of the heads it holds:
    the losses are data=8's to float rounding."""
    torch.manual_seed(0)
    model = gpt2(128, attn_pdrop=0.2)
    model.train()
    data = batches(128, False, n=2, batch=8)
    losses = []
    for mesh, context in ((xtrain.Mesh(data=8), "ring"), (xtrain.Mesh(data=2, context=4), "ulysses"),
                          (xtrain.Mesh(data=2, context=4), xtrain.ContextParallel(ulysses=2))):
        m = copy.deepcopy(model)
        step = xtrain.compile(m, mesh, optimizer=adamw(m.parameters()), loss_fn=lm_loss,
                              plan=xtrain.Plan(context=context))
        losses.append([step(*b)["loss"] for b in data])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)
    without = torch_reference(model.eval(), adamw, data[:1], lm_loss)[0][0]
    assert abs(losses[0][0] - without) > 1e-4, (losses, without)  # dropout was on


@pytest.mark.unit
def test_context_parallel_settings():
    assert xtrain.Plan().context == xtrain.ContextParallel(ulysses=1)
    assert xtrain.Plan(context="ulysses").context.name == "ulysses"
    assert xtrain.ContextParallel(ulysses=2).degrees(8) == (2, 4)
    assert xtrain.Plan(context="ulysses").context.degrees(4) == (4, 1)
    with pytest.raises(PlanError, match=r"Plan\(context='tree'\) must be 'ring', 'ulysses' or"):
        xtrain.Plan(context="tree")
    with pytest.raises(PlanError, match=r"ContextParallel\(ulysses=0\): give the Ulysses group size"):
        xtrain.ContextParallel(ulysses=0)
    with pytest.raises(PlanError, match=r"ulysses=3\) on mesh axis 'context'=8: .* use one of \[1, 2, 4, 8\]"):
        xtrain.ContextParallel(ulysses=3).degrees(8)


@pytest.mark.e2e
def test_what_ulysses_refuses():
    """A mesh without `context`, and heads that do not split over the group (Llama's 2 key/value
    heads of 2 query heads each over 8 devices), are refused naming the fix."""
    model, data = llama(layers=1, positions=128), batches(128, False, n=1, batch=8)

    def first_step(mesh, context):
        m = copy.deepcopy(model)
        xtrain.compile(m, mesh, optimizer=adamw(m.parameters()), loss_fn=lm_loss,
                       plan=xtrain.Plan(context=context))(*data[0])

    with pytest.raises(PlanError, match=r"runs attention over the mesh axis 'context', which this mesh .* lacks"):
        first_step(xtrain.Mesh(data=8), "ulysses")
    with pytest.raises(PlanError, match=r"attention in 'model.layers.0.self_attn': Ulysses over 8 devices .* "
                                        r"this device holds 2 key/value heads x 2 query heads .* U in \[1, 2, 4\]"):
        first_step(xtrain.Mesh(context=8), "ulysses")
    with pytest.raises(PlanError, match=r"ContextParallel\(ulysses=3\) on mesh axis 'context'=8"):
        first_step(xtrain.Mesh(context=8), xtrain.ContextParallel(ulysses=3))


# -- the plan search: ring, Ulysses or both -------------------------------------------------------

def _wide_llama(kv_heads: int, seq: int):
    """8 query heads of dim 64 over `kv_heads` key/value heads, one layer: big enough that the
    attention's bytes and FLOPs, not the rest of the model, decide."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=512,
                                        num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=kv_heads,
                                        max_position_embeddings=seq, bos_token_id=0, eos_token_id=0))


def _search(kv_heads: int, seq: int, profile, padded: bool):
    model = _wide_llama(kv_heads, seq)
    trainable = wrap(model, adamw(model.parameters()), padded_loss if padded else lm_loss)
    listed = [Candidate(data=2, context=4, ulysses=u) for u in (1, 2, 4)]
    ids = np.zeros((2, seq), np.int32)                 # one sequence per data-parallel replica
    batch = (ids, np.ones_like(ids)) if padded else (ids,)
    return search.search(trainable.model, trainable.tx, batch, profile, 8, structure=describe(model),
                         candidate_list=listed)


def _attention_wire_bytes(row, kind: str) -> float:
    return sum(c.wire_bytes for c in row.cost.collectives
               if c.kind == kind and c.axes == ("context",) and c.source.startswith(PATH + " "))


def _worked(kv_heads: int, seq: int, padded: bool, profile) -> tuple[str, float, float]:
    """(the kind a person picks, the ring's K/V bytes, Ulysses' all-to-all bytes) per device and
    step, from the attention's shapes and the link, where the transfers dwarf the attention's
    compute (1 GB/s, 1024 tokens): n = 1024 / 4 local tokens, 8 query heads of dim 64, fp32.
    The ring passes (K, V) chunks of n x kv x 64 x 4 bytes: 3 steps x 2 forward, 3 x 4 backward
    and dK, dV home, 20 chunks (a causal mask adds the load balancing's exchanges: at least 20).
    Ulysses sends 3/4 of q, k, v and the output each way, forward and backward; k and v have at
    least 4 heads (repeated); a padding mask's rows (n x 1024 x 4 bytes) are gathered, 3/4 of them."""
    n, d, b, u = seq // 4, 64, 4, 4
    ring = 20 * n * kv_heads * d * b
    ulysses = 2 * (2 * n * 8 * d * b + 2 * n * max(kv_heads, u) * d * b) * (u - 1) / u
    mask = n * seq * 4 * (u - 1) / u if padded else 0
    link, latency = profile.intra_node_bytes_per_s, profile.intra_node_latency_s
    ring_s = ring / link + 20 * latency
    ulysses_s = (ulysses + mask) / link + 8 * (u - 1) * latency + (latency * (u - 1) if padded else 0)
    return ("ring" if ring_s < ulysses_s else "ulysses"), ring, ulysses


@pytest.mark.e2e
@pytest.mark.parametrize("kv_heads,padded", [(8, False), (1, True)])
def test_the_search_picks_ring_or_ulysses_as_the_worked_answer(kv_heads, padded):
    """Two points on a slow link (1 GB/s), 1024 tokens: causal, with as many key/value heads as
    query heads (the ring passes every head 20 times; Ulysses 3/4 of them 8 times: Ulysses), and
    padded (no causal balancing) with one key/value head (the ring's chunks are an eighth of
    Ulysses' q: the ring). The search's bytes for the attention are the worked ones."""
    profile = dataclasses.replace(hardware.profile("p4d.24xlarge"), intra_node_bytes_per_s=1e9)
    want, ring_bytes, ulysses_bytes = _worked(kv_heads, 1024, padded, profile)
    assert want == ("ulysses" if kv_heads == 8 else "ring")
    result = _search(kv_heads, 1024, profile, padded)
    rows = {r.candidate.ulysses: r for r in result.rows}
    assert all(r.prediction is not None for r in result.rows), str(result)
    assert _attention_wire_bytes(rows[4], "all-to-all") == pytest.approx(ulysses_bytes)
    assert _attention_wire_bytes(rows[4], "collective-permute") == 0
    if padded:
        assert _attention_wire_bytes(rows[1], "collective-permute") == pytest.approx(ring_bytes)
    else:
        assert _attention_wire_bytes(rows[1], "collective-permute") > ring_bytes   # + the balancing
    assert {1: "ring", 4: "ulysses"}.get(result.best.candidate.ulysses) == want, str(result)


@pytest.mark.unit
def test_context_collectives_hide_under_the_compute_beside_them():
    """The cost model credits a collective over `context` (or `expert`: MoE dispatch and combine)
    alone with profile.overlap of the matmul time that neither feeds nor consumes it, at most its
    own time; others get none."""
    import types

    from xtrain.cost.model import hidden_seconds
    from xtrain.lowering.report import Collective

    profile = hardware.profile("p4d.24xlarge")
    cost = types.SimpleNamespace(flops=types.SimpleNamespace(matmul_dtype="float32"))
    peak = profile.matmul_flops_per_s("float32")
    ring = Collective("collective-permute", ("context",), 1 << 20, "attn", 4, overlap_flops=peak * 1e-3)
    assert hidden_seconds(ring, 1.0, cost, profile) == pytest.approx(profile.overlap * 1e-3)
    assert hidden_seconds(ring, 1e-4, cost, profile) == 1e-4
    dispatch = dataclasses.replace(ring, kind="all-to-all", axes=("expert",))
    assert hidden_seconds(dispatch, 1.0, cost, profile) == pytest.approx(profile.overlap * 1e-3)
    for axes in (("tensor",), ("data", "expert")):
        assert hidden_seconds(dataclasses.replace(ring, axes=axes), 1.0, cost, profile) == 0.0


# -- cuDNN's fused kernel: whole sequences under Ulysses, never under the ring ----------------------

@pytest.mark.e2e
def test_on_cuda_the_ring_runs_the_blockwise_kernel_and_ulysses_runs_cudnn(on_cuda):
    """On CUDA (its backend stood in on CPU), bf16: with the sequence split over `context` the
    ring needs the blockwise kernel (cuDNN would take the whole sequence: a silent gather), and
    the site says why; under Ulysses each device runs cuDNN on whole sequences of its head block
    (q, k, v, out moved by all-to-alls), and no all-gather over `context` serves the attention."""
    from test_cudnn_attention import _llama
    from test_hf_models import lm_batches, lm_loss

    batch = lm_batches(n=1)[0]
    for context, kind in (("ring", markers.Implementation.BLOCKWISE), ("ulysses", markers.Implementation.CUDNN)):
        model = _llama(4, torch.bfloat16)
        step = xtrain.compile(model, xtrain.Mesh(data=2, context=4), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                              plan=xtrain.Plan(context=context), loss_fn=lm_loss)
        sites = markers.sites(step.program(*batch).jaxpr, step.model.module_paths())
        assert {s.implementation for s in sites.values()} == {kind}, sites
        if context == "ring":
            assert all("the sequence is split over 'context' (ring attention" in s.why for s in sites.values())
            continue
        found = step.report(*batch).collectives
        inside = [c for c in found if "self_attn" in c.source and "context" in c.axes]
        assert sum(c.kind == "all-to-all" for c in inside) >= 8 and not [c for c in inside if c.kind == "all-gather"]
        assert any("around cuDNN's fused kernel" in n for n in step.report(*batch).notes)


@pytest.mark.e2e
def test_cudnn_under_ulysses_trains_like_torch(on_cuda, monkeypatch):
    """The parity standard through the stand-in kernels (fp32): data=2 x context=4, each device
    lowers them on 4 samples' whole 16 tokens and one of the 4 heads."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    from test_cudnn_attention import LOWERED, _llama
    from test_hf_models import lm_batches, lm_loss
    from xtrain.frontend import sdpa
    from xtrain.testing import run_parity

    monkeypatch.setattr(sdpa, "_CUDNN_DTYPES", (jnp.float32,))
    monkeypatch.setattr(cudnn, "check_layout", lambda *a, **kw: None)
    model = _llama(4, torch.float32)
    LOWERED.clear()
    result = run_parity(model, lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), lm_batches(batch=8),
                        xtrain.Mesh(data=2, context=4), plan=xtrain.Plan(context="ulysses"), loss_fn=lm_loss)
    assert set(LOWERED) == {(4, 16, 1, 8)}, LOWERED
    assert_parity(result)
