"""Pipeline parallelism trains like one device: GPipe, 1F1B and interleaved on pipe=2 and 4,
uneven stages, pipe x tensor x data on HF GPT-2 (tied embeddings; 1F1B and zero bubble) and Llama, memory that stays
flat in the number of microbatches for 1F1B, and the errors."""
import dataclasses
import functools

import jax
import pytest
import torch

import xtrain
from xtrain import plans
from xtrain.errors import InputError, PlanError, UnsupportedError
from xtrain.testing import assert_parity, torch_reference
from xtrain.testing.parity import ParityResult

from models import GPT, token_batches
from test_hf_models import adamw, gpt2, llama, lm_batches, lm_loss, sgd as hf_sgd

pytestmark = pytest.mark.e2e


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@functools.cache
def gpt_case(layers):
    torch.manual_seed(0)
    model, batches = GPT(layers=layers), token_batches(4, batch=16)
    return model, batches, torch_reference(model, sgd, batches)


def train(model, make_opt, batches, mesh, plan, reference, loss_fn=None):
    """(ParityResult, step) of xtrain on `mesh` with `plan` against the torch reference."""
    import copy

    candidate = copy.deepcopy(model)
    optimizer = make_opt(candidate.parameters())
    step = xtrain.compile(candidate, xtrain.Mesh(**mesh), optimizer=optimizer, plan=plan, loss_fn=loss_fn)
    losses = [step(*b)["loss"] for b in batches]
    return ParityResult(losses, reference[0], step.state_dict(), reference[1],
                        {"SGD": 1e-5}.get(type(optimizer).__name__, 5e-5)), step


# schedule, pipe, layers, virtual stages, split; global batch 16 = data x 4 microbatches x (1 or 2).
# 6 layers on 4 stages are uneven: cut by cost ("auto") or at given module paths.
PARITY = [("gpipe", 2, 4, 1, "auto"), ("1f1b", 2, 4, 1, "auto"), ("interleaved", 2, 4, 2, "auto"),
          ("gpipe", 4, 6, 1, ("blocks.3", "blocks.4", "blocks.5")), ("1f1b", 4, 6, 1, "auto"),
          ("interleaved", 4, 8, 2, "auto")]


@pytest.mark.parametrize("schedule,pipe,layers,v,split", PARITY)
def test_schedule_matches_torch(schedule, pipe, layers, v, split):
    model, batches, reference = gpt_case(layers)
    plan = xtrain.Plan().with_pipeline(stages=pipe, microbatches=4, schedule=schedule, virtual_stages=v, split=split,
                                       checkpoint=(schedule, pipe) == ("gpipe", 4))  # recomputed stages: same numbers
    # 1F1B on pipe=2 lays 'pipe' innermost (neighbouring stages on adjacent cores), the others outermost
    mesh = dict(data=-1, pipe=pipe) if (schedule, pipe) == ("1f1b", 2) else dict(pipe=pipe, data=-1)
    result, step = train(model, sgd, batches, mesh, plan, reference)
    assert_parity(result)
    if pipe == 2 and schedule != "interleaved":
        check_trainium(step, batches[0], inner=schedule == "1f1b")
    if pipe == 2 and schedule != "gpipe":  # eval: the GPipe forward loop (v = 1) or the interleaved table
        trained = GPT(layers=layers)
        trained.load_state_dict(result.reference_state)
        with torch.no_grad():
            expected = trained.eval()(*batches[0]).item()
        assert abs(step.eval(*batches[0])["loss"] - expected) <= 1e-5 * expected
    per_stage = list(step.lowered.findings.stage_layers)
    assert sum(per_stage) == layers
    # each stage stores only its own layers: every block family's rows split over 'pipe'
    families = step.layout.stacking.groups
    per_block = [n for n in model.state_dict() if n.startswith("blocks.0.")]
    assert len(families) == len(per_block) and all(step.state.params[n].sharding.spec[0] == "pipe" for n in families)
    held = [r for r in step.layout.stacking.rows_of(next(iter(families))) if r is not None]
    assert sorted(held) == list(range(layers))
    if split != "auto":
        assert per_stage == [3, 1, 1, 1]
    elif layers == 6:  # identical blocks: 2 + 1 + 1 + 2 or similar, never 3 on one stage
        assert max(per_stage) == 2
        text = str(step.report())  # the report says who runs what
        assert "pipeline: 1f1b, 4 stages x 4 microbatches, 14 ticks, bubble 42.9%" in text
        assert "stage 0: prologue (embeddings), blocks.0..blocks." in text
        assert "stage 3: blocks." in text and "epilogue (head, loss)" in text
        assert "activations held per stage (microbatch inputs): [4, 3, 2, 1]" in text


def check_trainium(step, batch, inner: bool):
    """No cond, no dynamic loop, aligned replica groups; the ring of stages is a ring of adjacent
    cores only when 'pipe' is the mesh's innermost axis."""
    from neuron_support import emulate

    found = emulate.check_step(step, *batch, cluster=emulate.virtual_cluster("trn1.32xlarge"))
    assert {f.rule for f in found} == (set() if inner else {"permute-ring"}), found


def test_dropout_masks_agree_between_gpipe_and_1f1b():
    """Each microbatch draws its own dropout stream, the same whether its backward is autodiff
    of the forward (GPipe) or a recomputation in a later tick (1F1B)."""
    torch.manual_seed(0)
    model, batches = GPT(layers=2, dropout=0.2), token_batches(2, batch=16)
    losses = {}
    for schedule in ("gpipe", "1f1b"):
        plan = xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule=schedule)
        candidate = GPT(layers=2, dropout=0.2)
        candidate.load_state_dict(model.state_dict())
        step = xtrain.compile(candidate, xtrain.Mesh(pipe=2, data=4), optimizer=sgd(candidate.parameters()), plan=plan)
        losses[schedule] = [step(*b)["loss"] for b in batches]
    assert losses["gpipe"] == pytest.approx(losses["1f1b"], rel=1e-5)
    plain = GPT(layers=2)  # the same weights without dropout: the masks do change the loss
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert losses["gpipe"][0] != pytest.approx(plain(*batches[0]).item(), rel=1e-3)


# -- 3D: pipe x tensor x data on HF models -----------------------------------------------------

@functools.cache
def hf_case(name):
    make_model, make_opt = {"gpt2": (gpt2, hf_sgd), "llama": (llama, adamw)}[name]
    torch.manual_seed(0)
    model, batches = make_model(), lm_batches()
    return model, make_opt, batches, torch_reference(model, make_opt, batches, lm_loss)


@pytest.mark.parametrize("name,schedule", [("gpt2", "1f1b"), ("llama", "gpipe"), ("gpt2", "zbh1")])
def test_pipe_tensor_data_on_hf_models(name, schedule):
    model, make_opt, batches, reference = hf_case(name)
    mesh = dict(pipe=2, tensor=2, data=2)
    megatron = plans.megatron(model, mesh)
    plan = dataclasses.replace(megatron, zero=1).with_pipeline(stages=2, microbatches=2, schedule=schedule)
    result, step = train(model, make_opt, batches, mesh, plan, reference, loss_fn=lm_loss)
    assert_parity(result)
    state = step.state_dict()
    if name == "gpt2":  # tied: one tensor used by stage 0 (embedding) and stage 1 (head)
        assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
    kinds = {(c.kind, c.axes) for c in step.report().collectives}
    assert ("collective-permute", ("pipe",)) in kinds
    assert any(k == "all-reduce" and "tensor" in a for k, a in kinds)


def test_interleaved_pipe_tensor_data_with_zero1_adamw():
    torch.manual_seed(0)
    model, batches = GPT(layers=4), token_batches(4, batch=16)

    def adamw_gpt(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)

    mesh = dict(tensor=2, data=2, pipe=2)
    plan = dataclasses.replace(plans.megatron(model, mesh), zero=1).with_pipeline(
        stages=2, microbatches=2, schedule="interleaved", virtual_stages=2)
    result, _ = train(model, adamw_gpt, batches, mesh, plan, torch_reference(model, adamw_gpt, batches))
    assert_parity(result)


# -- stored parameters and checkpoints -------------------------------------------------------

def block_bytes_per_device(step) -> dict:
    """Bytes of block parameters and of their optimizer state that each device holds."""
    leaves = jax.tree_util.tree_flatten_with_path((step.state.params, step.state.opt_state))[0]
    held: dict = {}
    for path, leaf in leaves:
        if getattr(path[-1], "key", "").startswith("blocks.") and hasattr(leaf, "addressable_shards"):
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return held


def test_each_stage_stores_only_its_layers_and_their_optimizer_state():
    torch.manual_seed(0)
    model, batches = GPT(layers=4), token_batches(1, batch=16)

    def compiled(mesh, plan):
        candidate = GPT(layers=4)
        candidate.load_state_dict(model.state_dict())
        step = xtrain.compile(candidate, xtrain.Mesh(**mesh), plan=plan,
                              optimizer=torch.optim.AdamW(candidate.parameters(), lr=1e-3))
        step(*batches[0])
        return step

    data = block_bytes_per_device(compiled(dict(data=8), None))
    piped = block_bytes_per_device(compiled(dict(pipe=2, data=4), xtrain.Plan().with_pipeline(stages=2, microbatches=4)))
    whole = set(data.values())
    assert len(whole) == 1 and set(piped.values()) == {whole.pop() // 2}, (data, piped)


@pytest.mark.parametrize("direction", ["pipeline->data", "data->pipeline", "data->placed pipeline"])
def test_checkpoints_move_between_pipeline_and_data_parallel(tmp_path, direction):
    """Checkpoints hold layers under their own names whatever the storage: a pipeline run
    resumes under data parallelism and the reverse, before or after its stages are placed."""
    model, batches, reference = gpt_case(4)
    pipeline = dict(mesh=dict(pipe=2, data=4), plan=xtrain.Plan().with_pipeline(stages=2, microbatches=4))
    data = dict(mesh=dict(data=8), plan=None)
    first, second = (pipeline, data) if direction == "pipeline->data" else (data, pipeline)

    def compiled(setup):
        candidate = GPT(layers=4)
        candidate.load_state_dict(model.state_dict())
        return xtrain.compile(candidate, xtrain.Mesh(**setup["mesh"]), optimizer=sgd(candidate.parameters()),
                              plan=setup["plan"])

    step = compiled(first)
    losses = [step(*b)["loss"] for b in batches[:2]]
    step.save(tmp_path / "ckpt")
    resumed = compiled(second)
    if direction == "data->placed pipeline":
        resumed(*batches[3])  # places the stages (and trains a step the load then overwrites)
        assert resumed.layout.stacking.groups
    resumed.load(tmp_path / "ckpt")
    losses += [resumed(*b)["loss"] for b in batches[2:]]
    assert_parity(ParityResult(losses, reference[0], resumed.state_dict(), reference[1], 1e-5))


# -- memory -----------------------------------------------------------------------------------

def _temporaries(schedule, microbatches, checkpoint=False):
    torch.manual_seed(0)
    model = GPT(layers=4, d=64, seq=32)
    plan = xtrain.Plan().with_pipeline(stages=2, microbatches=microbatches, schedule=schedule, checkpoint=checkpoint)
    step = xtrain.compile(model, xtrain.Mesh(pipe=2, data=4), optimizer=sgd(model.parameters()), plan=plan)
    (batch,) = token_batches(1, batch=4 * microbatches * 2, seq=32)
    return step.compiled(*batch).memory_analysis().temp_size_in_bytes


def test_1f1b_temporaries_stay_flat_as_microbatches_double_gpipe_grows():
    gpipe = _temporaries("gpipe", 8), _temporaries("gpipe", 16)
    one_f_one_b = _temporaries("1f1b", 8), _temporaries("1f1b", 16)
    assert gpipe[1] > 1.5 * gpipe[0], gpipe
    assert one_f_one_b[1] <= 1.05 * one_f_one_b[0], one_f_one_b
    assert one_f_one_b[1] < gpipe[1]
    # GPipe with the stage checkpointed keeps stage inputs only: less, though still m of them
    assert _temporaries("gpipe", 16, checkpoint=True) < 0.7 * gpipe[1]


# -- errors -----------------------------------------------------------------------------------

def _step(layers, mesh, **pipeline):
    model = GPT(layers=layers)
    return xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=sgd(model.parameters()),
                          plan=xtrain.Plan().with_pipeline(**pipeline))


def test_error_pipe_axis_missing_from_mesh():
    with pytest.raises(PlanError, match=r"runs over mesh axis 'pipe', which the mesh \(data=8\) does not have; "
                                        r"use e.g. xtrain.Mesh\(pipe=2, data=-1\)"):
        _step(2, dict(data=8), stages=2, microbatches=2)


def test_error_pipe_axis_size_differs_from_stages():
    with pytest.raises(PlanError, match=r"stages=4\) but mesh axis 'pipe' has size 2"):
        _step(4, dict(pipe=2, data=4), stages=4, microbatches=2)


def test_error_more_stages_than_layers():
    step = _step(2, dict(pipe=4, data=2), stages=4, microbatches=2)
    with pytest.raises(PlanError, match=r"4 stages but the model has only 2 repeated blocks \(blocks.0 .. blocks.1\); "
                                        r"use at most 2 stages"):
        step(*token_batches(1, batch=8)[0])


def test_error_batch_not_divisible_by_data_times_microbatches():
    step = _step(2, dict(pipe=2, data=4), stages=2, microbatches=4)
    with pytest.raises(InputError, match=r"batch argument 0 has 12 rows \(shape \(12, 16\)\), not divisible by data "
                                         r"degree 4 x microbatches 4 = 16; use a global batch that is a multiple of 16"):
        step(*token_batches(1, batch=12)[0])


def test_error_model_without_repeated_blocks():
    from models import MLP, mlp_batches

    model = MLP()
    step = xtrain.compile(model, xtrain.Mesh(pipe=2, data=4), optimizer=sgd(model.parameters()),
                          plan=xtrain.Plan().with_pipeline(stages=2, microbatches=2))
    with pytest.raises(UnsupportedError, match=r"pipeline parallelism needs repeated blocks .* none were found"):
        step(*mlp_batches(1, batch=16)[0])


def test_error_pipeline_with_xla_lowering():
    model = GPT(layers=2)
    with pytest.raises(UnsupportedError, match=r"pipeline parallelism needs lowering='explicit' \(got 'xla'\)"):
        xtrain.compile(model, xtrain.Mesh(pipe=2, data=4), optimizer=sgd(model.parameters()), lowering="xla",
                       plan=xtrain.Plan().with_pipeline(stages=2, microbatches=2))


def test_error_zero2_with_pipeline():
    model = GPT(layers=2)
    plan = xtrain.Plan(zero=2).with_pipeline(stages=2, microbatches=2)
    with pytest.raises(UnsupportedError, match=r"supports ZeRO stage 0 or 1 \(got Plan\(zero=2\)\)"):
        xtrain.compile(model, xtrain.Mesh(pipe=2, data=4), optimizer=sgd(model.parameters()), plan=plan)
