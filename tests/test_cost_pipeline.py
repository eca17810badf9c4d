"""Pipeline candidates in the plan search: enumerated for models with repeated blocks only,
lowered by the pipeline step itself (its bubble ticks are in the program's compute), refused
with a reason when the batch or the layer count does not allow them, never picked past the
device's memory, and a picked pipeline plan trains like torch."""
import collections
import copy
import dataclasses
import functools

import numpy as np
import pytest
import torch

import xtrain
from xtrain.errors import PlanError
from xtrain.frontend.structure import describe
from xtrain.frontend.torch_module import wrap
from xtrain.cost import hardware, search
from xtrain.cost.search import Candidate
from xtrain.testing import assert_parity
from xtrain.testing.parity import ParityResult

from models import GPT, MLP
from test_zero import adamw, gpt_case  # GPT(layers=2), its batches and torch reference

DEVICES = 4
PROFILE = hardware.profile("trn1.32xlarge")  # cited numbers: predictions do not depend on this host's load


@functools.cache
def wrapped(kind="gpt"):
    torch.manual_seed(0)
    model = GPT(layers=2) if kind == "gpt" else MLP()
    trainable = wrap(model, adamw(model.parameters()))
    net, tx = trainable.model, trainable.tx
    return model, net, tx


def gpt_batch(rows=8):
    x = np.zeros((rows, 16), np.int32)
    return (x, x)


@functools.cache
def gpt_search(memory=None, family=None):
    """The default search (`family`: only the candidates whose names start so, and the plain
    data-parallel ones)."""
    model, net, tx = wrapped()
    profile = PROFILE.with_memory(memory) if memory else PROFILE
    listed = None if family is None else [r.candidate for r in gpt_search().rows
                                          if r.candidate.name.startswith((family, "dp4"))]
    return search.search(net, tx, gpt_batch(), profile, DEVICES, structure=describe(model), candidate_list=listed)


def rows_by_name(result):
    return {r.candidate.name: r for r in result.rows}


@pytest.mark.e2e
@pytest.mark.slow
def test_search_lists_pipeline_candidates_for_repeated_blocks_and_none_without():
    result = gpt_search()
    piped = [r for r in result.rows if r.candidate.pipe > 1]
    assert {r.candidate.pipe for r in piped} == {2}                # 2 blocks: at most 2 stages
    assert {r.candidate.zero for r in piped} == {0, 1}             # the pipeline step's ZeRO stages
    assert {r.candidate.schedule for r in piped} == {"gpipe", "1f1b"}  # Trainium: no zero bubble (it branches)
    lowered = [r for r in piped if r.prediction is not None]
    assert {(r.candidate.data, r.candidate.tensor, r.candidate.microbatches) for r in lowered} == {
        (2, 1, 2), (2, 1, 4), (1, 2, 2), (1, 2, 4), (1, 2, 8)}      # batch 8 = data x m x rows
    text = str(result)
    assert "dp2xpp2 gpipe m4" in text and "33.3%" in text and "20.0%" in text   # bubble (p-1)/(m+p-1)
    for r in lowered:
        p = r.prediction
        assert p.step_s > 0 and 0 < p.mfu < 1 and p.memory_bytes > 0
        assert p.tokens_per_s == pytest.approx(8 * 16 / p.step_s)
    model, net, tx = wrapped("mlp")
    x = (np.zeros((8, 12), np.float32), np.zeros((8,), np.int64))
    plain = search.search(net, tx, x, PROFILE, DEVICES, structure=describe(model))
    assert plain.rows and all(r.candidate.pipe == 1 for r in plain.rows)


@pytest.mark.e2e
def test_pipeline_prediction_holds_the_bubble_in_its_compute():
    """The lockstep program runs m + p - 1 ticks each way: its FLOPs grow with the bubble.
    At a fixed batch, m=2 (3 ticks of 2 rows) does 6/5 of m=4's (5 ticks of 1 row) matmuls."""
    rows = rows_by_name(gpt_search())
    m2, m4 = rows["dp2xpp2 gpipe m2"], rows["dp2xpp2 gpipe m4"]
    assert m2.cost.flops.matmul / m4.cost.flops.matmul == pytest.approx((3 * 2) / (5 * 1), rel=1e-6)
    for row, m in ((m2, 2), (m4, 4)):
        p = row.prediction
        assert row.cost.pipeline.bubble_fraction == pytest.approx(1 / (m + 1))
        assert p.bubble_s == pytest.approx(p.compute_s / (m + 1))    # part of compute, not added again
        assert p.step_s == pytest.approx(p.compute_s + p.exposed_comm_s)
        # the gradient sync waits for the last microbatch: none of it hides under compute (overlap 0.5)
        assert p.exposed_comm_s == pytest.approx(sum(p.comm_s.values()))
        kinds = {(c.kind, c.axes) for c in row.cost.collectives}
        assert ("collective-permute", ("pipe",)) in kinds           # activations between stages
    # lockstep work beyond the plain plan's (bubble ticks; every stage runs the head each tick),
    # which MFU does not count as model FLOPs
    assert m4.cost.flops.matmul > rows["dp4"].cost.flops.matmul
    assert m4.prediction.mfu < m4.cost.flops.matmul / m4.prediction.step_s / PROFILE.matmul_flops_per_s("float32")


@pytest.mark.unit
def test_pipeline_memory_divides_the_block_parameters_over_stages():
    """Each stage stores its own layers (and their optimizer state); embeddings and head stay on
    every stage."""
    rows = rows_by_name(gpt_search())
    model, _, _ = wrapped()
    blocks = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("blocks."))
    dp, pp = rows["dp4"].cost.memory, rows["dp2xpp2 gpipe m2"].cost.memory
    assert pp.parameters == dp.parameters - blocks // 2
    assert pp.optimizer == dp.optimizer - blocks  # AdamW: two moments per parameter
    assert rows["dp2xpp2 gpipe m2 zero1"].cost.memory.optimizer == pytest.approx(pp.optimizer / 2, rel=0.05)


@pytest.mark.unit
def test_unusable_pipelines_are_listed_with_the_reason():
    model, net, tx = wrapped()
    listed = [Candidate(data=1, pipe=4), Candidate(data=2, pipe=2, microbatches=8), Candidate(data=2, pipe=2, zero=2)]
    result = search.search(net, tx, gpt_batch(), PROFILE, DEVICES, structure=describe(model), candidate_list=listed)
    reasons = [r.reason for r in result.rows]
    assert reasons[0] == "the model has 2 repeated blocks, fewer than pipe=4 stages"
    assert reasons[1] == "global batch 8 is not divisible by data=2 x microbatches=8 = 16"
    assert reasons[2].startswith("cannot lower: pipeline parallelism supports ZeRO stage 0 or 1")
    assert result.best is None and "pick: none" in str(result)
    # without the layer count, the lowering itself says why
    row = search.evaluate(net, tx, describe(model), listed[0], gpt_batch(), PROFILE)
    assert "cannot lower: Pipeline: 4 stages but the model has only 2 repeated blocks" in row.reason
    mlp, mlp_net, mlp_tx = wrapped("mlp")
    x = (np.zeros((8, 12), np.float32), np.zeros((8,), np.int64))
    none = search.search(mlp_net, mlp_tx, x, PROFILE, DEVICES, structure=describe(mlp), candidate_list=[Candidate(data=2, pipe=2)])
    assert none.rows[0].reason == "no repeated blocks (blocks.0, blocks.1, ...) to cut into pipeline stages"


@pytest.mark.unit
def test_candidate_and_enumeration_errors():
    with pytest.raises(PlanError, match=r"pipe_degrees=\(3,\): \[3\] do not divide the 4 devices"):
        search.candidates(4, PROFILE, pipe_degrees=(3,))
    with pytest.raises(PlanError, match="microbatches and schedule belong to a pipeline; set pipe >= 2"):
        Candidate(data=4, microbatches=4)
    with pytest.raises(PlanError, match="1F1B always recomputes"):
        Candidate(data=2, pipe=2, schedule="1f1b", remat=True)
    assert search.pipeline_degrees(8, layers=4) == [2, 4] and search.pipeline_degrees(8, layers=0) == []
    plan = Candidate(data=2, pipe=2, microbatches=4, remat=True).plan()
    assert plan.pipeline.checkpoint and plan.pipeline.schedule == "gpipe" and plan.remat.value == "off"


@pytest.mark.e2e
@pytest.mark.slow
def test_short_memory_lowers_1f1b_and_never_picks_what_does_not_fit():
    base = rows_by_name(gpt_search())
    gpipe = base["dp2xpp2 gpipe m2"].prediction.memory_bytes
    limit = gpipe - 1                                             # GPipe m2 no longer fits
    result = gpt_search(memory=limit, family="dp2xpp2 ")          # its pipeline family and data parallel
    rows = rows_by_name(result)
    assert not rows["dp2xpp2 gpipe m2"].prediction.fits
    one_f = rows["dp2xpp2 1f1b m2"].prediction                    # short of memory: 1F1B is lowered
    assert one_f is not None and one_f.memory_bytes < gpipe
    assert rows["dp2xpp2 gpipe m2 remat"].prediction is not None
    assert result.best is not None and result.best.prediction.memory_bytes <= limit
    assert all(r.prediction.memory_bytes <= limit for r in result.rows if r.usable)


@pytest.mark.e2e
def test_a_picked_pipeline_plan_is_costed_as_compiled_and_trains_like_torch():
    """The search's public knob (candidate_list) restricted to pipelines: the pick is compiled
    from its Candidate (mesh and plan, as plan='auto' does). Its program has the FLOPs and
    collectives the search lowered for an abstract mesh, XLA's memory analysis is close to the
    graph estimate, and it trains like torch."""
    model, batches, reference = gpt_case()                       # global batch 16, AdamW
    trainable = wrap(model, adamw(model.parameters()))
    net, tx = trainable.model, trainable.tx
    listed = [Candidate(data=4, pipe=2, microbatches=2), Candidate(data=4, pipe=2, microbatches=4, zero=1),
              Candidate(data=2, tensor=2, pipe=2, microbatches=4)]
    x, y = (b.numpy() for b in batches[0])
    result = search.search(net, tx, (x, y), PROFILE, 8, structure=describe(model), candidate_list=listed)
    best = result.best.candidate
    assert best.pipe == 2, str(result)
    candidate = copy.deepcopy(model)
    step = xtrain.compile(candidate, xtrain.Mesh(**best.mesh), optimizer=adamw(candidate.parameters()),
                          plan=best.plan(describe(candidate)))
    compiled = search.compiled_step_cost(step, x, y)
    assert compiled.flops.matmul == result.best.cost.flops.matmul
    assert sorted((c.kind, c.axes, c.payload_bytes) for c in compiled.collectives) == \
        sorted((c.kind, c.axes, c.payload_bytes) for c in result.best.cost.collectives)
    assert 0.8 < result.best.cost.memory.total / compiled.memory.total < 1.6   # graph vs XLA (measured ~1.2)
    losses = [step(*b)["loss"] for b in batches]
    assert_parity(ParityResult(losses, reference[0], step.state_dict(), reference[1], 5e-5))


@pytest.mark.e2e
def test_plan_auto_leaves_pipelines_out_when_accumulating():
    """The pipeline step refuses accumulate > 1 (its microbatches accumulate already), so
    plan='auto' does not offer it a pipeline (the search then runs with pipe_degrees=(1,))."""
    model, _, _ = gpt_case()
    plain = xtrain.compile(model, optimizer=adamw(model.parameters()), plan="auto")
    accumulating = xtrain.compile(model, optimizer=adamw(model.parameters()), plan="auto", accumulate=2)
    assert plain._searches_pipelines and not accumulating._searches_pipelines


@functools.cache
def long_llama(seq):
    """HF Llama, 2 layers (one per stage at pipe=2), SDPA attention: ring attention under `context`."""
    from test_long_sequence import llama, lm_loss

    torch.manual_seed(0)
    model = llama(layers=2, positions=seq)
    trainable = wrap(model, adamw(model.parameters()), lm_loss)
    return trainable.model, trainable.tx, describe(model)


def _permutes(row, axis: str) -> collections.Counter:
    """(payload bytes, module) -> count of the row's permutes over `axis`."""
    return collections.Counter((c.payload_bytes, c.source.split(" [")[0]) for c in row.cost.collectives
                               if c.kind == "collective-permute" and c.axes == (axis,))


@pytest.mark.e2e
def test_context_inside_pipeline_stages_is_costed_per_stage():
    """dp2 x pp2 x cp2 (m2, 1 row per device and microbatch) beside the pipeline without context
    at the same rows per data shard (dp4 x pp2, m2) and context without a pipeline at the same rows
    per attention call (dp4 x cp2): the stage boundary carries half the activations (the sequence
    is split); each of the m + p - 1 = 3 lockstep ticks rings the stage's one layer, as the
    unpipelined program rings each of its 2 layers; activations per device shrink with context."""
    seq, profile = 256, hardware.profile("p4d.24xlarge")
    net, tx, structure = long_llama(seq)
    lower = lambda c, rows: search.evaluate(net, tx, structure, c, (np.zeros((rows, seq), np.int64),), profile,
                                            layers=2)
    both = lower(Candidate(data=2, pipe=2, context=2, microbatches=2), 4)
    piped = lower(Candidate(data=4, pipe=2, microbatches=2), 8)
    ring = lower(Candidate(data=4, context=2), 4)
    assert both.prediction is not None and both.usable, both.reason
    boundary, whole = _permutes(both, "pipe"), _permutes(piped, "pipe")
    assert sorted(boundary.elements()) == sorted((b // 2, m) for b, m in whole.elements()) and boundary
    attention = lambda row: collections.Counter({k: n for k, n in _permutes(row, "context").items()
                                                 if k[1].endswith("self_attn")})
    per_layer = {k: n // 2 for k, n in attention(ring).items()}
    assert attention(both) == {k: 3 * n for k, n in per_layer.items()} and per_layer
    assert both.cost.pipeline.bubble_fraction == piped.cost.pipeline.bubble_fraction == pytest.approx(1 / 3)
    assert both.cost.memory.activations <= 0.5 * piped.cost.memory.activations
    p = both.prediction  # a pipeline hides no communication: the ring is exposed with the rest
    assert p.exposed_comm_s == pytest.approx(sum(p.comm_s.values())) and p.step_s > p.compute_s


@pytest.mark.unit
def test_search_lists_context_inside_pipelines_for_long_sequences(monkeypatch):
    """The default candidates (plan='auto', `xtrain plan`) of 8 devices: context x pipeline points
    at 4096 tokens, no context point at 1024 (the lowering is stubbed: only the list is read)."""
    listed = []

    def stub(model, tx, structure, candidate, *args, **kwargs):
        listed.append(candidate)
        return search.Row(candidate=candidate, reason="not lowered here")

    monkeypatch.setattr(search, "evaluate", stub)
    profile = hardware.profile("p4d.24xlarge")
    for seq in (1024, 4096):
        net, tx, structure = long_llama(seq)
        listed.clear()
        result = search.search(net, tx, (np.zeros((8, seq), np.int64),), profile, 8, structure=structure)
        assert {r.candidate for r in result.rows} == set(listed) and result.best is None
        context = {(c.data, c.pipe, c.context, c.tensor) for c in listed if c.context > 1}
        if seq == 1024:
            assert not context, context
        else:  # (data, pipe, context, tensor)
            assert {(2, 2, 2, 1), (1, 2, 4, 1), (1, 2, 2, 2), (4, 1, 2, 1)} <= context, context


@pytest.mark.e2e
def test_zero_bubble_candidates_are_costed_on_gpus_and_left_out_on_trainium():
    from xtrain.cost.candidates import candidates

    gpu = hardware.profile("p4d.24xlarge")
    listed = candidates(DEVICES, gpu, pipe_degrees=(2,), microbatches=(4,), zero_stages=(0,))
    assert {"zbh1", "zbv"} <= {c.schedule for c in listed}
    assert not {"zbh1", "zbv"} & {c.schedule for c in candidates(DEVICES, PROFILE, pipe_degrees=(2,))}
    model, net, tx = wrapped()
    rows = {c.schedule: search.evaluate(net, tx, describe(model), c, gpt_batch(), gpu)
            for c in listed if c.pipe == 2 and c.data == 2 and not c.remat}
    zero, gpipe = rows["zbh1"], rows["gpipe"]
    assert not zero.candidate.saves_memory_only and zero.prediction is not None   # lowered: it can be faster
    assert zero.cost.pipeline.bubble_fraction == pytest.approx(1 / 13)             # 3m + p - 1 = 13 ticks
    assert gpipe.cost.pipeline.bubble_fraction == pytest.approx(1 / 5)
    assert zero.prediction.memory_bytes > 0 and zero.prediction.step_s > 0
    # zbv runs two chunks per stage: this GPT's 2 layers cannot fill 2 x 2, which the row says
    assert rows["zbv"].prediction is None and "zbv runs two per pipeline stage" in rows["zbv"].reason
    model4 = GPT(layers=4)
    trainable = wrap(model4, adamw(model4.parameters()))
    v, h = (search.evaluate(trainable.model, trainable.tx, describe(model4),
                            dataclasses.replace(zero.candidate, schedule=s), gpt_batch(), gpu) for s in ("zbv", "zbh1"))
    assert v.cost.pipeline.bubble_fraction == pytest.approx(1 / 25)  # 2 chunks x 3m = 24 half-stage ticks of 25
    assert h.cost.pipeline.bubble_fraction == pytest.approx(1 / 13)
    assert v.prediction.memory_bytes > 0 and v.prediction.step_s > 0
    # the search lowers a zbh1 candidate only where its GPipe form, without its bubble, could win
    listed = [c for c in listed if c.pipe == 1 or (c.data == 2 and not c.remat and c.schedule != "1f1b")]
    result = search.search(net, tx, gpt_batch(), gpu, DEVICES, structure=describe(model), candidate_list=listed)
    by = {r.candidate.schedule if r.candidate.pipe > 1 else r.candidate.name: r for r in result.rows}
    fastest = min(r.prediction.step_s for r in result.rows if r.usable and r.candidate.schedule != "zbh1")
    could_win = by["gpipe"].prediction.step_s * (1 - by["gpipe"].cost.pipeline.bubble_fraction) < fastest
    assert (by["zbh1"].prediction is not None) == could_win
    assert could_win or by["zbh1"].reason.startswith("not lowered: its GPipe form, even without its bubble")
    unpruned = search.search(net, tx, gpt_batch(), gpu, DEVICES, structure=describe(model), candidate_list=listed,
                             prune_remat=False)
    assert all(r.prediction is not None for r in unpruned.rows if r.candidate.schedule == "zbh1")

