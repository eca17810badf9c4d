"""One assembly (xtrain.lowering.assembly): the step a user runs and the cost model's abstract step
are built by the same function, so for every plan family the program the cost model reads on an
AbstractMesh is the program `step.program()` emits on the 8 emulated devices, and the plan search's
collectives are the report's. A step traces once per batch signature, and a pipeline balances its
stages on one trace."""
import collections
import contextlib
import copy
import re

import jax
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import xtrain
from xtrain import errors
from models import GPT, token_batches
from test_long_sequence import batches as long_batches, blocks_of_16, llama  # noqa: F401 (a fixture)
from test_long_sequence import lm_loss as ids_loss
from test_moe import lm_batches, lm_loss, mixtral
from xtrain import plans
from xtrain.cost import hardware, search
from xtrain.cost import program as cost_program
from xtrain.lowering import accounting
from xtrain.lowering.assembly import PLACEMENT_EVENT, TRACE_EVENT
from xtrain.step import host_batch

pytestmark = pytest.mark.e2e  # traces full steps (compiles only where it says so)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _gpt():
    torch.manual_seed(0)
    return GPT(layers=4, d=32, seq=16), token_batches(n=1, batch=16)[0]


def _tiny_llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                         bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    return model, (ids, ids)


def _gpt_case(mesh, plan, **options):
    return lambda: (*_gpt(), mesh, plan, options)


def _megatron_sp():
    model, batch = _tiny_llama()
    mesh = xtrain.Mesh(data=4, tensor=2)
    return model, batch, mesh, plans.megatron(model, mesh, example=batch, loss_fn=lm_loss, sequence_parallel=True), \
        dict(loss_fn=lm_loss)


def _hybrid():
    model, batch = _gpt()
    mesh = xtrain.Mesh(replicate=2, data=4)
    return model, batch, mesh, plans.hybrid(model, mesh), {}


def _moe(mesh, plan):
    def case():
        torch.manual_seed(0)
        return mixtral(), lm_batches(n=1, batch=8, seq=8)[0], mesh, plan, dict(loss_fn=lm_loss)
    return case


def _context():
    torch.manual_seed(0)
    return llama(positions=128), long_batches(128, n=1, batch=4)[0], xtrain.Mesh(data=2, context=4), xtrain.Plan(), \
        dict(loss_fn=ids_loss)


PIPE = xtrain.Mesh(pipe=2, data=4)
FAMILIES = {
    "ddp": _gpt_case(xtrain.Mesh(data=8), xtrain.Plan()),
    "zero1": _gpt_case(xtrain.Mesh(data=8), xtrain.Plan(zero=1)),
    "zero2": _gpt_case(xtrain.Mesh(data=8), xtrain.Plan(zero=2)),
    "zero3": _gpt_case(xtrain.Mesh(data=8), xtrain.Plan(zero=3)),
    "hsdp": _hybrid,
    "megatron_sp": _megatron_sp,
    "gpipe": _gpt_case(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=4)),
    "1f1b": _gpt_case(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule="1f1b")),
    "interleaved": _gpt_case(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule="interleaved",
                                                              virtual_stages=2)),
    "expert": _moe(xtrain.Mesh(data=2, expert=4), xtrain.Plan()),
    "capacity_factor": _moe(xtrain.Mesh(data=8), xtrain.Plan(capacity_factor=1.25)),
    "context": _context,
    "offload_optimizer": _gpt_case(xtrain.Mesh(data=8), xtrain.Plan(zero=1, offload="optimizer")),
    "offload_activations": _gpt_case(xtrain.Mesh(data=8), xtrain.Plan(remat="full", offload="activations")),
    "int8": _gpt_case(xtrain.Mesh(data=8), xtrain.Plan(), grad_sync=xtrain.GradSync(comm_dtype="int8")),
}


def _normalised(program) -> str:
    """A program's text with its mesh printed alike for devices and an AbstractMesh."""
    text = re.sub(r", device_kind=[^,]*, num_cores=[^,]*, platform=\w+", "", str(program))
    return text.replace("mesh=Mesh(", "mesh=AbstractMesh(")


def _step(model, mesh, plan, options):
    return xtrain.compile(model, mesh, optimizer=adamw(model.parameters()), plan=plan, **options)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_cost_models_program_is_the_steps_program(family, blocks_of_16):
    model, batch, mesh, plan, options = FAMILIES[family]()
    step = _step(model, mesh, plan, options)
    real = step.program(*batch)  # a pipeline places its stages here, on the first batch
    abstract = cost_program.abstract_step(step.trainable, dict(step.mesh.shape), step.plan, host_batch(batch),
                                          options=step.options.assembly())
    assert abstract.param_specs == step.param_specs
    assert _normalised(abstract.program) == _normalised(real), family


def test_the_plan_search_lists_the_collectives_the_report_counts():
    """`xtrain plan`'s row for a candidate and the report of the step compiled for it: the same
    collectives (kind, axes, bytes, source), read from the same program."""
    model, batch = _gpt()
    candidate = search.Candidate(data=4, tensor=2, zero=1)
    twin = copy.deepcopy(model)
    trainable = xtrain.compile(twin, optimizer=adamw(twin.parameters())).trainable
    tensor = search.tensor_plan(trainable.model, host_batch(batch))
    row = search.evaluate(trainable.model, trainable.tx, trainable.structure, candidate, host_batch(batch),
                          hardware.profile("p4d.24xlarge"))
    assert row.cost is not None, row.reason
    step = _step(model, xtrain.Mesh(**candidate.mesh), candidate.plan(tensor), {})
    step(*batch)
    assert sorted(map(str, row.cost.collectives)) == sorted(map(str, step.report().collectives))


@contextlib.contextmanager
def _counted():
    events = collections.Counter()

    def listen(event, **_):
        events[event] += 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(listen)


@pytest.mark.parametrize("plan, mesh", [(xtrain.Plan(zero=2), xtrain.Mesh(data=8)),
                                        (xtrain.Plan().with_pipeline(stages=2, microbatches=4), PIPE)],
                         ids=["zero2", "pipeline"])
def test_one_trace_per_batch_signature_and_one_placement(plan, mesh):
    model, batch = _gpt()
    other = token_batches(n=1, batch=32)[0]
    with _counted() as events:
        step = _step(model, mesh, plan, dict(allow_recompile=True))
        for b in (batch, batch, batch):
            step(*b)
        step.report()
        step.program(*batch)
        step.eval(*batch)
        assert events[TRACE_EVENT] == 1 and events[PLACEMENT_EVENT] == (plan.pipeline is not None)
        step(*other)  # a second batch signature: its own trace, the stages stay where they are
        step.program(*other)
        assert events[TRACE_EVENT] == 2 and events[PLACEMENT_EVENT] == (plan.pipeline is not None)


def test_a_deferred_step_says_what_it_waits_for():
    model, batch = _gpt()
    step = _step(model, PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=4), {})
    with pytest.raises(errors.NotBuiltError, match="balances its stages"):
        step.param_specs
    assert set(step.state_dict()) == set(model.state_dict())  # the initial state, before any call
    step(*batch)
    assert step.param_specs and step.built.bubble > 0
    assert step.built.table is not None and step.built.plan.pipeline.stages == 2


def test_report_notes_estimate_and_compare_compiles():
    """The report's remat note is the graph model's estimate (a trace, no compile); with
    compare=True both programs are compiled and XLA's figures given."""
    model, batch = _gpt()
    step = _step(model, xtrain.Mesh(data=8), xtrain.Plan(remat="full"), {})
    step(*batch)
    (estimate,) = [n for n in step.report().notes if n.startswith("activation checkpointing")]
    assert "graph estimate" in estimate
    (measured,) = [n for n in step.report(compare=True).notes if n.startswith("activation checkpointing")]
    on, off = map(int, re.search(r"temporaries (\d+) B per device vs (\d+) B without", measured).groups())
    assert on < off
    assert accounting.collectives(step.program(), dict(step.mesh.shape), step.model.module_paths())
