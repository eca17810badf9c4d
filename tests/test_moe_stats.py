"""Around the MoE layers' parity (tests/test_moe.py): per-step tokens per expert (step()'s
outputs and the Monitor's log, checked against torch's router on the same batch), the optional
token-dropping capacity factor (outside the parity tests: it changes what the model computes),
the Neuron checker on an expert-parallel program, and expert-parallel candidates of the plan search."""
import copy
import dataclasses
import math

import pytest
import torch

import xtrain
from neuron_support import conformance, emulate
from xtrain.cost import hardware, search
from xtrain.cost import model as cost_model
from xtrain.errors import PlanError, UnsupportedError
from xtrain.frontend.structure import describe
from xtrain.frontend.torch_module import wrap
from xtrain.step import host_batch
from test_moe import CASES, EXPERTS, TOP_K, case, lm_batches, qwen3_moe, routing, with_routing_margin


def torch_expert_tokens(model, loss_fn, batch, paths):
    """Tokens per expert of each MoE layer as torch's routers pick them on `batch`."""
    picks = routing(copy.deepcopy(model), loss_fn, [batch])
    return {p: torch.bincount(idx.reshape(-1), minlength=EXPERTS).tolist() for p, (_, idx) in zip(paths, picks)}


@pytest.mark.e2e
def test_step_returns_tokens_per_expert_and_the_monitor_logs_their_balance(tmp_path):
    """step(...)["expert_tokens"] under expert parallel (each device counts its own tokens,
    summed): per MoE layer, the (token, expert) pairs torch's router sends to each expert on the
    same batch; the Monitor logs them with the max and mean over experts and max / mean."""
    model, make_opt, loss_fn, batches, _ = case("moe")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=2, expert=4), optimizer=make_opt(m.parameters()), loss_fn=loss_fn)
    monitor = xtrain.observe.Monitor(step, metrics=tmp_path / "m.jsonl", progress=False, flops_per_step=1.0)
    with monitor.step() as rec:
        rec.update(step(*batches[0]))
    monitor.close()
    expected = torch_expert_tokens(model, loss_fn, batches[0], ["blocks.0.experts", "blocks.1.experts"])
    logged = xtrain.observe.read_metrics(tmp_path / "m.jsonl")[0]
    assert logged["expert_tokens"] == expected
    counts = [torch.tensor(c, dtype=torch.float64) for c in expected.values()]
    assert sum(map(sum, expected.values())) == batches[0][0].numel() * TOP_K * 2
    assert logged["expert_tokens_max"] == max(float(c.max()) for c in counts)
    assert logged["expert_tokens_mean"] == pytest.approx(float(torch.stack(counts).mean()))
    assert logged["expert_imbalance"] == pytest.approx(max(float(c.max() / c.mean()) for c in counts))
    assert logged["expert_imbalance"] > 1.05, "a balanced batch would not show that the ratio is computed"


@pytest.mark.e2e
def test_expert_tokens_from_a_layer_scan_summed_over_micro_batches():
    """Mixtral with its layers as one layer scan and 2 micro-batches: the counts leave the scan
    per layer and add up over the micro-batches to torch's on the whole batch."""
    model, make_opt, loss_fn, _, _ = case("mixtral")
    m, batch = copy.deepcopy(model), lm_batches(n=1, batch=16, seed=9)[0]
    step = xtrain.compile(m, xtrain.Mesh(data=8), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          scan_layers=True, accumulate=2)
    out = step(*batch)
    assert any("run as one layer scan" in n for n in step.report().notes)
    paths = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert {p: c.tolist() for p, c in out["expert_tokens"].items()} == torch_expert_tokens(model, loss_fn, batch, paths)


@pytest.mark.e2e
def test_expert_tokens_under_the_pipeline_schedules():
    """Qwen3-MoE on 2 stages x 2 microbatches, 1F1B and zbh1 with expert parallel inside the
    stages and GPipe over data=4: each layer's counts come from its stage, only from the ticks
    that run a real forward (not the bubble's, nor a backward tick's recomputation), summed over
    the microbatches and the devices: torch's router counts on the same batch."""
    model, make_opt, loss_fn, batches, _ = case("qwen3_moe")
    paths = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    expected = torch_expert_tokens(model, loss_fn, batches[0], paths)
    assert sum(map(sum, expected.values())) == batches[0][0].numel() * TOP_K * 2
    for mesh, schedule in ((xtrain.Mesh(pipe=2, data=2, expert=2), "1f1b"), (xtrain.Mesh(pipe=2, data=4), "gpipe"),
                           (xtrain.Mesh(pipe=2, data=2, expert=2), "zbh1")):
        m = copy.deepcopy(model)
        step = xtrain.compile(m, mesh, optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                              plan=xtrain.Plan().with_pipeline(2, 2, schedule=schedule))
        out = step(*batches[0])
        assert {p: c.tolist() for p, c in out["expert_tokens"].items()} == expected, schedule


@pytest.mark.e2e
def test_expert_tokens_under_the_interleaved_schedule_with_padding_slots():
    """5 layers in 2 x 2 chunks (one chunk holds 2 layers, the others 1 and a padding slot):
    each layer's counts reach its own module path, the padding slots count nothing."""
    _, make_opt, loss_fn = CASES["qwen3_moe"]
    torch.manual_seed(0)
    model, batch = with_routing_margin(qwen3_moe(layers=5)), lm_batches(n=1)[0]
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(pipe=2, data=4), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          plan=xtrain.Plan().with_pipeline(2, 2, schedule="interleaved", virtual_stages=2))
    out = step(*batch)
    paths = [f"model.layers.{k}.mlp.experts" for k in range(5)]
    assert {p: c.tolist() for p, c in out["expert_tokens"].items()} == torch_expert_tokens(model, loss_fn, batch, paths)


def overflow(idx, devices, capacity):
    """Pairs past `capacity` per expert when each device routes its own rows of `idx` (N, k)."""
    per_device = idx.reshape(devices, -1)
    return sum(int((torch.bincount(p, minlength=EXPERTS) - capacity).clamp(min=0).sum()) for p in per_device)


@pytest.mark.e2e
def test_capacity_factor_drops_the_pairs_past_each_experts_capacity():
    """Plan(capacity_factor=1.0): each device's 8 tokens x top-2 = 16 pairs, capacity
    ceil(16 / 4 experts x 1.0) = 4 per expert. The first MoE layer (the same input as torch's)
    drops the overflow of torch's routing per device; the report shows the capacity; expert
    parallel's all-to-all buffers shrink to it (4 peers x 4 rows); data=8 drops the same pairs
    (the same loss); a factor with room for every pair drops none (torch's loss)."""
    model, make_opt, loss_fn, batches, (reference_losses, _) = case("moe")
    (_, idx), _ = routing(copy.deepcopy(model), loss_fn, batches[:1])[:2]
    losses = []
    for factor, mesh in ((1.0, xtrain.Mesh(data=2, expert=4)), (1.0, xtrain.Mesh(data=8)),
                         (4.0, xtrain.Mesh(data=2, expert=4))):
        m = copy.deepcopy(model)
        step = xtrain.compile(m, mesh, optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                              plan=xtrain.Plan(capacity_factor=factor), scan_layers=False)  # a note per layer
        out = step(*batches[0])
        losses.append(out["loss"])
        capacity = math.ceil(8 * TOP_K / EXPERTS * factor)
        assert int(out["expert_dropped"]["blocks.0.experts"]) == overflow(idx, 8, capacity)
        notes = step.report().notes
        assert len([n for n in notes if f"takes at most {capacity} of a device's 8 tokens x top_k 2 pairs" in n]) == 2
    assert overflow(idx, 8, 4) > 0
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and losses[0] != pytest.approx(reference_losses[0], rel=1e-4)
    assert losses[2] == pytest.approx(reference_losses[0], rel=1e-5)


@pytest.mark.e2e
def test_capacity_shrinks_the_all_to_all_buffers():
    model, make_opt, loss_fn, batches, _ = case("moe")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=2, expert=4), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          plan=xtrain.Plan(capacity_factor=1.0), scan_layers=False)  # each layer's all-to-alls
    step(*batches[0])
    moved = [c.payload_bytes for c in step.report().collectives
             if c.kind == "all-to-all" and "transpose" not in c.source]
    assert sorted(moved) == [4 * 4 * 32 * 4] * 2 + [4 * 4 * 33 * 4] * 2  # peers x capacity rows x (hidden + id)
    assert any("a capacity of 4 rows per peer (4 per expert)" in n for n in step.report().notes)


@pytest.mark.unit
def test_capacity_factor_must_be_positive():
    with pytest.raises(PlanError, match=r"Plan\(capacity_factor=0\): give a positive factor"):
        xtrain.Plan(capacity_factor=0)


@pytest.mark.e2e
def test_neuron_checker_applies_its_replica_group_rule_to_the_all_to_alls():
    """The expert-parallel program on one trn1.32xlarge: every collective conforms (the
    all-to-alls over 'expert' are 4 neighbouring cores; the routers' top-k is one lax.top_k, no
    float sort). A target allowing only pairs of cores finds exactly the all-to-alls over
    expert=4 (with the rest of its collectives over more than 2 cores), named with their MoE layer."""
    model, make_opt, loss_fn, batches, _ = case("moe")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(data=2, expert=4), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          scan_layers=False)  # each layer's all-to-alls in the program
    assert emulate.check_step(step, *batches[0], cluster=emulate.virtual_cluster("trn1.32xlarge")) == []
    compiled = step.compiled(*batches[0])
    pairs = conformance.Target(name="pairs-only", devices_per_node=8, group_sizes=(1, 2), max_replica_groups=None)
    found = conformance.check(compiled.as_text(), pairs, device_ids=emulate.device_order(compiled))
    moved = [f for f in found if f.op.startswith("all-to-all")]
    assert len(moved) == 8, found  # 2 layers x (dispatch, combine) x (forward, backward)
    assert all(f.rule == "replica-groups" and ".experts/all_to_all" in f.source and "group [0, 1, 2, 3]" in f.message
               for f in moved), moved


@pytest.mark.unit
def test_plan_search_lists_expert_parallel_candidates_for_moe_models_only():
    """Expert degrees dividing the devices and the experts (4) for the MoE model, none for a
    dense one; an expert-parallel candidate lowers with its 8 all-to-alls over 'expert', costed
    on the link that axis maps to (inside a node of 8; across nodes of 2 devices)."""
    model, make_opt, loss_fn, batches, _ = case("moe")
    m = copy.deepcopy(model)
    trainable = wrap(m, make_opt(m.parameters()), loss_fn)
    experts = sorted(trainable.experts)
    assert search.expert_degrees(trainable.model, experts, 8) == [1, 2, 4]
    profile = hardware.emulated(8)
    names = {c.name for c in search.candidates(8, profile, pipe_degrees=(1,), expert_degrees=[1, 2, 4])}
    assert {"dp4xep2", "dp2xep4", "dp2xep2xtp2", "dp8", "dp4xtp2"} <= names
    dense = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    dense_trainable = wrap(dense, torch.optim.SGD(dense.parameters(), lr=0.1), lambda mod, x: mod(x).sum())
    assert search.expert_degrees(dense_trainable.model, sorted(dense_trainable.experts), 8) == [1]
    result = search.search(trainable.model, trainable.tx, host_batch(batches[0]), profile, 8, structure=describe(m),
                           experts=experts, candidate_list=[search.Candidate(data=2, expert=4)])
    (row,) = result.rows
    assert row.usable and row.candidate.mesh == {"data": 2, "expert": 4}, row
    moved = [c for c in row.cost.collectives if c.kind == "all-to-all"]
    assert len(moved) == 8 and all(c.axes == ("expert",) for c in moved)
    one_node = cost_model.communication(dataclasses.replace(row.cost, collectives=moved), profile)[0]
    nodes_of_2 = dataclasses.replace(profile, devices_per_node=2)
    across = cost_model.communication(dataclasses.replace(row.cost, collectives=moved), nodes_of_2)[0]
    assert one_node[cost_model.INTER] == 0 < one_node[cost_model.INTRA]
    assert across[cost_model.INTRA] == 0 < across[cost_model.INTER]


@pytest.mark.e2e
def test_plan_search_costs_expert_parallel_inside_pipeline_stages_as_compiled():
    """Qwen3-MoE: the default candidates on 8 devices include expert parallel inside 2 pipeline
    stages; the search's cost of dp2xpp2xep2 1F1B m2 (lowered for an abstract mesh) has the
    compiled step's FLOPs and collectives, its all-to-alls over `expert` with their bytes. On the
    p4d's GPUs the same candidate is built for CUDA: its ragged all-to-alls move the routed rows,
    half of what the fixed buffers for 2 peers move."""
    model, make_opt, loss_fn, batches, _ = case("qwen3_moe")
    profile = hardware.profile("p4d.24xlarge")
    names = {c.name for c in search.candidates(8, profile, pipe_degrees=(1, 2), expert_degrees=[1, 2])}
    assert {"dp2xpp2xep2 gpipe m2", "dp2xpp2xep2 1f1b m4", "dp1xpp2xep2xtp2 gpipe m2"} <= names, sorted(names)
    candidate = search.Candidate(data=2, pipe=2, expert=2, microbatches=2, schedule="1f1b")
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(**candidate.mesh), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          plan=candidate.plan())
    batch = host_batch(batches[0])
    t = step.trainable
    evaluate = lambda on: search.evaluate(t.model, t.tx, t.structure, candidate, batch, on, layers=2,
                                          experts=sorted(t.experts))
    row = evaluate(hardware.emulated(8))  # built for CPU, as the step compiled here
    compiled = search.compiled_step_cost(step, *batch)
    assert row.usable and row.cost.flops.matmul == compiled.flops.matmul, row
    key = lambda c: (c.kind, c.axes, c.payload_bytes)
    assert sorted(map(key, row.cost.collectives)) == sorted(map(key, compiled.collectives))
    moved = [c for c in row.cost.collectives if c.kind == "all-to-all"]
    assert moved and all(c.axes == ("expert",) and c.payload_bytes > 0 for c in moved)
    on_gpus = evaluate(profile)
    assert "dp2xpp2xep2 1f1b m2" in str(search.SearchResult("p4d", profile, [on_gpus], on_gpus))
    ragged = [c for c in on_gpus.cost.collectives if c.kind == "all-to-all"]
    assert 2 * sum(c.payload_bytes for c in ragged) == sum(c.payload_bytes for c in moved)


@pytest.mark.e2e
def test_plan_search_costs_the_capacity():
    """search(capacity_factor=1.0) (xtrain plan --capacity-factor, or the script's plan's): the
    expert-parallel candidate's all-to-alls are costed at the capacity, as the compiled step moves
    them, fewer bytes than drop-free (in fixed buffers: a CPU host's, as compiled here; on GPUs a
    drop-free layer sends only its routed rows); its code carries the factor."""
    model, make_opt, loss_fn, batches, _ = case("moe")
    profile, batch = hardware.emulated(8), host_batch(batches[0])
    capped = search.Candidate(data=4, expert=2, capacity_factor=1.0)
    m = copy.deepcopy(model)
    step = xtrain.compile(m, xtrain.Mesh(**capped.mesh), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                          plan=capped.plan())
    t = step.trainable
    found = search.search(t.model, t.tx, batch, profile, 8, structure=t.structure, experts=sorted(t.experts),
                          candidate_list=[dataclasses.replace(capped, capacity_factor=None)], capacity_factor=1.0)
    row = found.rows[0]
    assert row.candidate == capped and "capacity_factor=1.0" in capped.code()
    key = lambda c: (c.kind, c.axes, c.payload_bytes)
    assert sorted(map(key, row.cost.collectives)) == sorted(map(key, search.compiled_step_cost(step, *batch).collectives))
    free = search.evaluate(t.model, t.tx, t.structure, dataclasses.replace(capped, capacity_factor=None), batch,
                           profile, layers=2, experts=sorted(t.experts))
    moved = lambda r: sum(c.payload_bytes for c in r.cost.collectives if c.kind == "all-to-all")
    assert 0 < moved(row) < moved(free)


@pytest.mark.e2e
def test_capacity_factor_outside_the_explicit_lowering_is_an_error():
    model, make_opt, loss_fn, batches, _ = case("moe")
    m = copy.deepcopy(model)
    capped = xtrain.Plan(capacity_factor=1.0)
    with pytest.raises(UnsupportedError, match=r"Plan\(capacity_factor=1.0\) drops MoE pairs in the explicit lowering"):
        xtrain.compile(m, xtrain.Mesh(data=8), optimizer=make_opt(m.parameters()), loss_fn=loss_fn, plan=capped,
                       lowering="xla")(*batches[0])


@pytest.mark.e2e
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_capacity_factor_inside_pipeline_stages_drops_what_data_parallel_drops(schedule):
    """Qwen3-MoE, Plan(capacity_factor=1.0) on 2 stages x 2 microbatches (GPipe over data=4;
    1F1B with expert parallel inside the stages, data=2 x expert=2): each device routes a
    microbatch of 1 of the 16 rows, as each device of the plan without a pipeline (data=8;
    data=4 x expert=2) routes its row, so the same pairs are dropped: the dropped counts, losses
    and parameters of 4 steps are that plan's (parity standard)."""
    from xtrain.testing import ParityResult, assert_parity

    model, make_opt, loss_fn, batches, _ = case("qwen3_moe")
    flat, piped = {"gpipe": (dict(data=8), dict(pipe=2, data=4)),
                   "1f1b": (dict(data=4, expert=2), dict(pipe=2, data=2, expert=2))}[schedule]
    runs = []
    for sizes, pipeline in ((flat, False), (piped, True)):
        m = copy.deepcopy(model)
        plan = xtrain.Plan(capacity_factor=1.0)
        step = xtrain.compile(m, xtrain.Mesh(**sizes), optimizer=make_opt(m.parameters()), loss_fn=loss_fn,
                              plan=plan.with_pipeline(2, 2, schedule=schedule) if pipeline else plan)
        outs = [step(*b) for b in batches]
        runs.append(([o["loss"] for o in outs], step.state_dict(),
                     [{p: int(c) for p, c in o["expert_dropped"].items()} for o in outs]))
    (want, want_state, want_dropped), (got, got_state, dropped) = runs
    assert dropped == want_dropped and sum(dropped[0].values()) > 0, (dropped, want_dropped)
    assert_parity(ParityResult(got, want, got_state, want_state, 5e-5))
