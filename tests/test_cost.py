"""Cost model: FLOPs (exact on known programs, the dense-transformer formula, XLA's cost
analysis), plan search (fit marking, picks), plan="auto" and Plan(remat=True) parity, `xtrain plan`."""
import copy
import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import xtrain
from xtrain import errors
from xtrain.errors import OptionsError, PlanError
from xtrain.frontend.structure import describe
from xtrain.frontend.torch_module import wrap
from xtrain.cost import hardware, search
from xtrain.ir.analysis import flops
from xtrain.cost.program import abstract_step, trainable_of
from xtrain.testing import assert_parity, run_parity

from models import GPT, MLP, mlp_batches
from test_zero import adamw, gpt_case  # one GPT case and torch reference, shared

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def wrapped_gpt(d=32, layers=2, vocab=64, seq=16):
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=d, layers=layers, seq=seq)
    trainable = wrap(model, adamw(model.parameters()))
    wrapped, tx = trainable.model, trainable.tx
    return model, wrapped, tx


def host_batch(batch=16, seq=16):
    x = np.zeros((batch, seq), np.int32)
    return (x, x)


# -- FLOPs ------------------------------------------------------------------------------------
@pytest.mark.unit
def test_flops_of_a_matmul_stack_are_exact_and_scans_count_per_iteration():
    b, k, n, layers = 8, 24, 40, 5

    def stack(x, w_in, ws):
        h = x @ w_in                                            # (b, k) @ (k, n)
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)  # layers x (b, n) @ (n, n)
        return h.sum()

    jaxpr = jax.make_jaxpr(stack)(jnp.ones((b, k)), jnp.ones((k, n)), jnp.ones((layers, n, n)))
    f = flops.count(jaxpr)
    assert f.dot == 2 * b * k * n + layers * 2 * b * n * n
    assert f.transcendental == layers * b * n           # one tanh per element per layer
    assert f.reduce == b * n
    grads = flops.count(jax.make_jaxpr(jax.grad(stack, argnums=(1, 2)))(
        jnp.ones((b, k)), jnp.ones((k, n)), jnp.ones((layers, n, n))))
    # backward: two matmuls per forward matmul, except the input gradient of the first one
    assert grads.dot == f.dot + (2 * b * k * n) + layers * 2 * (2 * b * n * n)


@pytest.mark.unit
def test_data_movement_is_counted_in_bytes_apart_from_flops():
    """A scan's stacked outputs are zero-filled, written and read back, its stacked inputs
    read; transposes and concatenations copy: memory traffic the step pays, not FLOPs."""
    b, n, layers = 4, 8, 3

    def program(x, ws):
        h, hs = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), h), x, ws)  # hs: (layers, b, n)
        return jnp.concatenate([h.T, h.T]), hs

    x, ws = jnp.ones((b, n)), jnp.ones((layers, n, n))
    f = flops.count(jax.make_jaxpr(program)(x, ws))
    stacked_out, stacked_in, one = 4 * layers * b * n, 4 * layers * n * n, 4 * b * n
    # read + written: two transposes of h, and the concatenation of twice its size
    assert f.moved_bytes == 3 * stacked_out + stacked_in + 2 * (2 * one) + 2 * (2 * one)
    assert f.total == layers * (2 * b * n * n + b * n)  # FLOPs: the matmuls and tanh only


@pytest.mark.unit
def test_flops_of_a_grouped_convolution_are_exact():
    x, w = jnp.ones((2, 6, 10, 10)), jnp.ones((8, 3, 3, 3))    # NCHW, OIHW, 2 groups
    jaxpr = jax.make_jaxpr(lambda x, w: jax.lax.conv_general_dilated(
        x, w, (1, 1), "VALID", feature_group_count=2))(x, w)
    out = 2 * 8 * 8 * 8                                        # (N, O, 8, 8)
    assert flops.count(jaxpr).conv == 2 * out * 3 * 3 * 3


@pytest.mark.e2e
def test_transformer_flops_match_six_n_plus_attention_within_5_percent():
    model, wrapped, tx = wrapped_gpt(d=64, layers=2, vocab=64, seq=32)
    batch, seq = 16, 32
    step = abstract_step(trainable_of(wrapped, tx), {"data": 8}, xtrain.Plan(), host_batch(batch, seq))
    per_device = flops.count(step.program).matmul
    params = sum(p.numel() for p in model.parameters())
    embeddings = model.tok.weight.numel() + model.pos.weight.numel()
    head = model.tok.weight.numel()                           # tied LM head: a matmul per token
    d, layers, tokens = 64, 2, batch * seq
    expected = 6 * (params - embeddings + head) * tokens + 12 * layers * d * seq * tokens
    assert abs(8 * per_device - expected) / expected < 0.05, (8 * per_device, expected)


@pytest.mark.e2e
def test_flops_agree_with_xla_cost_analysis_within_15_percent():
    """XLA counts a while loop's body once, so the layers are unrolled (scan_layers=False).
    XLA's count is higher: on CPU it expands erf/erfc (GELU) into polynomials and counts the
    additions of all-reduces; on this d=32 model elementwise work is a large share (~12% gap;
    ~6% on the d=64 example GPT)."""
    model, batches, _ = gpt_case()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), scan_layers=False)
    x, y = batches[0]
    ours = flops.count(step.program(x, y))
    xla = step.compiled(x, y).cost_analysis()["flops"]
    assert 0.7 * xla <= ours.dot <= xla
    assert abs(ours.total - xla) / xla < 0.15, (ours, xla)
    # the compiled step's cost: XLA's memory analysis, and the graph estimate of the same plan
    cost = search.compiled_step_cost(step, x, y)
    assert cost.memory.source == "xla" and cost.memory.parameters > 0
    _, wrapped, tx = wrapped_gpt()
    graph = search.step_cost(abstract_step(trainable_of(wrapped, tx), {"data": 8}, xtrain.Plan(), host_batch()),
                             {"data": 8}, 16 * 16)
    assert graph.memory.source == "graph"
    assert 0.25 < graph.memory.total / cost.memory.total < 4, (graph.memory, cost.memory)
    assert hardware.emulated(8).hbm_bytes > 0 and cost.flops.dot == ours.dot


# -- hardware ---------------------------------------------------------------------------------
@pytest.mark.unit
def test_peak_flops_by_device_kind_and_dtype():
    assert hardware.peak_flops("NVIDIA A100-SXM4-40GB", "bfloat16") == 312e12
    assert hardware.peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494e12
    assert hardware.peak_flops("trn1", "bf16") == 95e12
    assert hardware.peak_flops("cpu", "bf16") is None
    assert hardware.peak_flops("NVIDIA A100-SXM4-40GB", "int4") is None
    with pytest.raises(OptionsError, match="no hardware profile for 'trn9.fake'.*known: p4d.24xlarge"):
        hardware.profile("trn9.fake")


@pytest.mark.unit
def test_emulated_profile_is_calibrated_on_this_machine():
    p = hardware.emulated(8)
    assert p.name == "emulated-cpu:8" and p.overlap == 0.0
    assert p.peak_flops["fp32"] > 1e8 and p.intra_node_bytes_per_s > 1e6
    assert "time-sharing" in p.notes and "memory copies" in p.notes


# -- search -----------------------------------------------------------------------------------
@functools.cache
def emulated_search():
    model, wrapped, tx = wrapped_gpt()
    # no pipeline candidates here: tests/test_cost_pipeline.py searches those
    return search.search(wrapped, tx, host_batch(), hardware.emulated(8), 8, structure=describe(model), pipe_degrees=(1,))


@pytest.mark.e2e
@pytest.mark.parametrize("candidate", [None, search.Candidate(data=2, tensor=4, zero=2),
                                       search.Candidate(data=4, pipe=2, microbatches=2, remat=True)],
                         ids=["pick", "megatron-zero2", "pipeline"])
def test_the_pick_printed_as_code_compiles_and_trains(candidate):
    result = emulated_search()
    candidate = candidate or result.best.candidate
    assert f"pick: {result.best.candidate.name}, as code" in str(result)
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, layers=2, seq=16)
    batch = tuple(torch.from_numpy(a).long() for a in host_batch())
    scope = {"xtrain": xtrain, "model": model, "batch": batch}
    exec(candidate.code(), scope)  # what `xtrain plan` prints under the pick
    assert scope["mesh"].axes == candidate.mesh
    step = xtrain.compile(model, scope["mesh"], plan=scope["plan"], optimizer=adamw(model.parameters()))
    assert np.isfinite(float(step(*batch)["loss"]))


@pytest.mark.e2e
def test_search_lists_every_candidate_and_picks_a_fitting_one():
    result = emulated_search()
    names = [r.candidate.name for r in result.rows]
    for expected in ("dp8", "dp8 zero1", "dp8 zero3 remat", "dp4xtp2", "dp2xtp4 zero2", "dp1xtp8"):
        assert expected in names
    assert result.best is not None and result.best.usable
    text = str(result)
    assert f"pick: {result.best.candidate.name}" in text and "emulated-cpu:8" in text
    # memory-only variants that were not lowered are counted, listed only on request
    skipped = [r for r in result.rows if r.prediction is None and r.reason.startswith("not lowered:")]
    assert skipped and f"({len(skipped)} candidates not lowered" in text
    assert "not lowered: fits without remat" not in text and "not lowered: fits without remat" in result.listing(
        show_all=True)
    assert len([r for r in result.rows if r.prediction]) == 13       # 26 points; remat only lowered when short
    assert all(r.reason == search.SKIPPED_REMAT for r in result.rows if r.candidate.remat)
    for row in result.rows:
        if row.prediction is None:
            continue
        p = row.prediction
        assert p.step_s > 0 and p.tokens_per_s == pytest.approx(16 * 16 / p.step_s)
        assert 0 < p.mfu < 1


@pytest.mark.e2e
@pytest.mark.slow
def test_tiny_memory_marks_what_does_not_fit_and_never_picks_it():
    base = emulated_search()
    by_name = {r.candidate.name: r.prediction.memory_bytes for r in base.rows if r.prediction}
    limit = (by_name["dp8"] + min(by_name.values())) // 2       # DDP does not fit, something does
    model, wrapped, tx = wrapped_gpt()
    tiny = hardware.emulated(8).with_memory(limit)
    result = search.search(wrapped, tx, host_batch(), tiny, 8, structure=describe(model), pipe_degrees=(1,))
    rows = {r.candidate.name: r for r in result.rows}
    assert not rows["dp8"].prediction.fits and "NO" in str(result)
    assert "needs" in rows["dp8"].reason and "> " in rows["dp8"].reason
    assert rows["dp8 remat"].prediction is not None                  # short of memory: remat is lowered
    assert result.best.prediction.memory_bytes <= limit
    assert all(r.prediction.memory_bytes <= limit for r in result.rows if r.usable)
    nothing = search.search(wrapped, tx, host_batch(), tiny.with_memory(1024), 8, structure=describe(model),
                            candidate_list=[search.Candidate(data=8), search.Candidate(data=8, zero=3)])
    assert nothing.best is None and "none fits" in str(nothing)


@functools.cache
def trn1_search(memory=None, batch=16, seq=32):
    model, wrapped, tx = wrapped_gpt(d=64, layers=2, vocab=64, seq=32)
    profile = hardware.profile("trn1.2xlarge")
    profile = profile.with_memory(memory) if memory else profile
    return search.search(wrapped, tx, host_batch(batch, seq), profile, 2, structure=describe(model))


@pytest.mark.e2e
def test_trn1_picks_data_parallel_when_the_model_fits_easily():
    best = trn1_search().best.candidate
    assert (best.data, best.tensor, best.zero, best.remat) == (2, 1, 0, False)


@pytest.mark.e2e
@pytest.mark.slow
def test_trn1_picks_a_sharded_plan_when_one_core_cannot_hold_the_model():
    # The device is shrunk below the replicated training state (a trn1 NeuronCore's 16 GiB would
    # need a model too large to build here): no recomputation can save DDP, a sharded plan fits.
    # A short batch (one 8-token sequence per device) makes the state, not activations, the bulk.
    # ZeRO, tensor parallelism and pipeline stages each split the state; replicated, it cannot fit.
    model, wrapped, tx = wrapped_gpt(d=64, layers=2, vocab=64, seq=32)
    ddp = search.evaluate(wrapped, tx, describe(model), search.Candidate(data=2), host_batch(2, 8),
                          hardware.profile("trn1.2xlarge")).cost.memory
    limit = int(0.95 * (ddp.parameters + ddp.gradients + ddp.optimizer))
    result = trn1_search(memory=limit, batch=2, seq=8)
    best = result.best.candidate
    assert best.zero > 0 or best.tensor > 1 or best.pipe > 1, best
    assert result.best.prediction.memory_bytes <= limit


@pytest.mark.unit
def test_pipeline_bubble_is_the_schedule_tables_or_the_formula():
    from xtrain.cost.model import Pipeline

    assert Pipeline(stages=4, microbatches=8).bubble_fraction == pytest.approx(3 / 11)
    assert Pipeline(stages=4, microbatches=8, idle=0.1).bubble_fraction == 0.1   # e.g. interleaved
    with pytest.raises(PlanError, match=r"Pipeline\(idle=1.0\): the idle share must be in \[0, 1\)"):
        Pipeline(stages=2, microbatches=2, idle=1.0)


# -- training ---------------------------------------------------------------------------------
@pytest.mark.e2e
def test_plan_auto_trains_with_parity():
    model, batches, reference = gpt_case()
    result = run_parity(model, adamw, batches, xtrain.Mesh(data=-1), plan="auto", reference=reference)
    assert_parity(result)


@pytest.mark.e2e
def test_plan_auto_resumes_a_checkpoint_loaded_before_its_first_step(tmp_path):
    """Resume is the normal restart path: before plan='auto' has picked its plan (at the first
    step), load() checks the checkpoint and returns its extra, step_count is the checkpoint's,
    state_dict() is refused (the restored state does not exist yet) and the mesh is unknown; the
    first step restores the checkpoint onto the picked plan and trains on from it."""
    batches = mlp_batches(n=4)
    torch.manual_seed(0)
    model = MLP()
    first = copy.deepcopy(model)
    saver = xtrain.compile(first, xtrain.Mesh(data=8), optimizer=adamw(first.parameters()))
    [saver(*b) for b in batches[:2]]
    saver.save(tmp_path / "ckpt", extra={"next": 2})
    continued = [saver(*b)["loss"] for b in batches[2:]]
    fresh = copy.deepcopy(model)
    step = xtrain.compile(fresh, optimizer=adamw(fresh.parameters()), plan="auto")
    initial = step.state_dict()  # nothing loaded yet: the model's initial state
    assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())
    assert step.load(tmp_path / "ckpt") == {"next": 2} and step.step_count == 2
    with pytest.raises(errors.NotBuiltError, match=r"plan='auto' chooses the plan .* before state_dict\(\) of the checkpoint"):
        step.state_dict()
    with pytest.raises(errors.NotBuiltError, match=r"plan='auto' chooses the plan .* before \.mesh"):
        step.mesh
    resumed = [step(*b)["loss"] for b in batches[2:]]
    assert resumed == pytest.approx(continued, rel=1e-5) and step.step_count == 4
    assert step.search.best is not None and step.mesh.size == 8
    # an MLP has no layer scan to offload activations from: the search does not propose it
    assert all(r.candidate.offload.value != "activations" for r in step.search.rows)


@pytest.mark.e2e
def test_plan_auto_needs_a_first_step_and_rejects_other_strings():
    model, _, _ = gpt_case()
    step = xtrain.compile(model, optimizer=adamw(model.parameters()), plan="auto")
    with pytest.raises(errors.NotBuiltError, match=r"plan='auto' chooses the plan at the first step\(\*batch\)"):
        step.report()
    with pytest.raises(errors.OptionsError, match="plan='fastest'.*plan='auto'"):
        xtrain.compile(model, optimizer=adamw(model.parameters()), plan="fastest")


@pytest.mark.e2e
def test_remat_recomputes_the_blocks_and_matches_torch():
    model, wrapped, tx = wrapped_gpt()
    plain, remat = (flops.count(abstract_step(trainable_of(wrapped, tx), {"data": 8}, xtrain.Plan(remat=r), host_batch()).program)
                    for r in (False, True))
    assert plain.dot < remat.dot < 1.5 * plain.dot           # blocks' forward once more, not the head
    model, batches, reference = gpt_case()
    assert_parity(run_parity(model, adamw, batches, xtrain.Mesh(data=8), plan=xtrain.Plan(remat=True),
                             reference=reference))


# -- CLI --------------------------------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import sys, torch, xtrain
    sys.path.insert(0, {tests!r})
    from models import GPT, token_batches
    torch.manual_seed(0)
    model = GPT(layers=2)
    step = xtrain.compile(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    # a training script reads its step's mesh before the first call (as examples/train_gpt.py does)
    loader = xtrain.Loader(token_batches(n=1), step=step)
    monitor = xtrain.Monitor(step, progress=False)
    for x, y in loader:
        with monitor.step(tokens=x.size) as rec:
            rec["loss"] = step(x, y)["loss"]
    print("trained: the probe did not stop the script")
""")


@pytest.mark.multiprocess
def test_cli_plan_compiles_the_best_candidate_for_h100s(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "1"}
    out = subprocess.run([sys.executable, "-m", "xtrain.cli", "plan", "--target", "p5.48xlarge", "--compile", "1",
                          str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    picked = [line for line in out.stdout.splitlines() if line.startswith("* ")]
    # the pick is the candidate XLA's GPU compiler compiled (xtrain.aot) and found to fit an H100
    assert len(picked) == 1 and "[compiled: " in picked[0] and " fits; compiled for p5.48xlarge in " in picked[0], \
        out.stdout
    assert "trained" not in out.stdout


@pytest.mark.multiprocess
def test_cli_plan_lists_candidates_for_a_trainium_target(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=os.path.join(ROOT, "tests")))
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_NUM_CPU_DEVICES": "1"}
    out = subprocess.run([sys.executable, "-m", "xtrain.cli", "plan", "--target", "trn1.2xlarge", str(script)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "xtrain plan for trn1.2xlarge (2 devices) (trn1.2xlarge: 1 chips" in out.stdout  # the name once
    assert "pick: dp2, as code" in out.stdout and "    mesh = xtrain.Mesh(data=2)" in out.stdout
    assert "dp1xtp2" in out.stdout and "trained" not in out.stdout
    assert "dp1xpp2 gpipe m2" in out.stdout and "33.3%" in out.stdout      # 2 blocks: a 2-stage pipeline row
    bad = subprocess.run([sys.executable, "-m", "xtrain.cli", "plan", "--target", "trn1.32xlarge:x", str(script)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "node count after ':' must be a positive integer" in bad.stderr
