"""Every plan family lowered for CUDA on this CPU host (`step.lower(*batch, platform="cuda")`),
and the program read on its own terms (tests/program_text.py, not xtrain's accounting):

- its collectives (kind, mesh axes, bytes per step, loops counted per iteration) equal the
  ones `step.report()` lists, which xtrain counts in the jaxpr it emits;
- each family has the collectives that define it (ZeRO-2 reduce-scatters its gradients, a
  pipeline permutes between stages, sequence parallelism reduce-scatters over "tensor", ...);
- no CPU-only ordering chain (xtrain/lowering/ordering.py lowers it on the CPU alone);
- matmuls, the gradient all-reduce and ZeRO-2's reduce-scatter in bf16, as Plan(precision="bf16")
  says (ZeRO-3's gradients leave as the transpose of its fp32 parameter gathers: fp32);
- every state buffer donated.

This is the program before XLA's GPU passes, which run only when compiling on a GPU.
"""
import collections
import copy
import dataclasses
import functools

import jax
import pytest
import torch

import program_text
import xtrain
from models import GPT, SequenceParallelGPT, token_batches
from neuron_support import conformance
from xtrain import plans
from xtrain.errors import OptionsError
from xtrain.lowering import zero
from xtrain.step import explain

pytestmark = pytest.mark.e2e

BATCH = token_batches(n=1, batch=16, seq=16)[0]
BF16 = xtrain.Plan(precision="bf16")
DP, TP, PP = dict(data=8), dict(data=4, tensor=2), dict(data=4, pipe=2)


def _megatron(model, mesh):
    return dataclasses.replace(plans.megatron(model, mesh), precision="bf16")


def _pipeline(schedule, virtual=1):
    return lambda model, mesh: BF16.with_pipeline(stages=2, microbatches=4, schedule=schedule,
                                                  virtual_stages=virtual)


# family -> (model, mesh, plan(model, mesh))
FAMILIES = {
    "dp": (GPT, DP, lambda m, mesh: BF16),
    "zero1": (GPT, DP, lambda m, mesh: dataclasses.replace(BF16, zero=1)),
    "zero2": (GPT, DP, lambda m, mesh: dataclasses.replace(BF16, zero=2)),
    "zero3": (GPT, DP, lambda m, mesh: dataclasses.replace(BF16, zero=3)),
    "megatron": (GPT, TP, _megatron),
    "megatron_sp": (SequenceParallelGPT, TP, _megatron),
    "gpipe": (functools.partial(GPT, layers=4), PP, _pipeline("gpipe")),
    "1f1b": (functools.partial(GPT, layers=4), PP, _pipeline("1f1b")),
    "interleaved": (functools.partial(GPT, layers=4), PP, _pipeline("interleaved", virtual=2)),
}


@dataclasses.dataclass
class Lowered:
    step: object
    model: torch.nn.Module
    text: str  # HLO of the program lowered for CUDA

    @property
    def mesh(self) -> dict:
        return dict(self.step.mesh.shape)

    def program_collectives(self) -> collections.Counter:
        return program_text.collectives(self.text, self.mesh)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def build(family: str) -> Lowered:
    make_model, mesh, make_plan = FAMILIES[family]
    torch.manual_seed(0)
    model = make_model()
    step = xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          plan=make_plan(model, mesh))
    return Lowered(step, model, step.lower(*BATCH, platform="cuda").as_text(dialect="hlo"))


@functools.cache
def lowered(family: str) -> Lowered:
    return build(family)


def as_counter(found, mesh: dict) -> collections.Counter:
    """xtrain's collectives keyed as the program's: (kind, axes in mesh order, payload bytes)."""
    return collections.Counter((c.kind, tuple(a for a in mesh if a in c.axes), c.payload_bytes) for c in found)


def assert_program_matches(program: collections.Counter, listed: collections.Counter) -> None:
    assert program == listed, (f"in the CUDA program only: {dict(program - listed)}; "
                               f"in xtrain's list only: {dict(listed - program)}")


def total(found: collections.Counter, kind: str, axes: tuple) -> int:
    """Bytes per step of `kind` collectives over `axes` (scalars left out: loss and token count)."""
    return sum(b * n for (k, a, b), n in found.items() if k == kind and a == axes and b > 8)


# -- what defines each family, read from the program alone -----------------------------------
def _dp(low: Lowered, found):
    assert {k for k, _, _ in found} == {"all-reduce"}, found
    assert total(found, "all-reduce", ("data",)) == 2 * low.param_count(), "bf16 gradients, each once"


def _zero1(low, found):
    assert total(found, "all-reduce", ("data",)) == 2 * low.param_count()
    assert total(found, "all-gather", ("data",)) == 4 * low.param_count(), "updated fp32 parameters gathered"


def _zero2(low, found):
    assert total(found, "reduce-scatter", ("data",)) == 2 * low.param_count(), "bf16 gradients reduce-scattered"
    assert total(found, "all-reduce", ("data",)) == 0, "ZeRO-2 all-reduces no gradient"
    assert total(found, "all-gather", ("data",)) == 4 * low.param_count()


def _zero3(low, found):
    assert total(found, "all-gather", ("data",)) >= 4 * low.param_count(), "every parameter gathered"
    assert total(found, "reduce-scatter", ("data",)) > 0, "gradients leave by reduce-scatter"


def _megatron(low, found):
    assert total(found, "all-reduce", ("tensor",)) > 0, "row-parallel outputs all-reduced over tensor"
    assert total(found, "all-reduce", ("data",)) > 0


def _megatron_sp(low, found):
    plain = lowered("megatron").program_collectives()
    assert total(found, "reduce-scatter", ("tensor",)) > total(plain, "reduce-scatter", ("tensor",)) == 0
    assert total(found, "all-gather", ("tensor",)) > total(plain, "all-gather", ("tensor",)), \
        "the sequence is gathered over tensor before the column-parallel matmuls"


def _pipeline(low, found):
    sends = sum(n for (k, a, _), n in found.items() if k == "collective-permute" and a == ("pipe",))
    assert sends >= 2 * 4, f"each of 4 microbatches crosses the stage boundary forward and backward: {sends}"


SIGNATURES = {"dp": _dp, "zero1": _zero1, "zero2": _zero2, "zero3": _zero3, "megatron": _megatron,
              "megatron_sp": _megatron_sp, "gpipe": _pipeline, "1f1b": _pipeline, "interleaved": _pipeline}


def check_family(family: str, low: Lowered) -> None:
    SIGNATURES[family](low, low.program_collectives())


def check_bf16(family: str, low: Lowered) -> None:
    dots = program_text.dot_operand_dtypes(low.text)
    assert set(dots) == {"bf16"}, f"matmul operands in {dict(dots)}"
    for kind, types, size in program_text.collective_dtypes(low.text):
        gradients = kind == "all-reduce" or (kind == "reduce-scatter" and family != "zero3")
        if gradients and size >= 2 * 64 * 32 and "f32" in types and family not in ("megatron", "megatron_sp"):
            pytest.fail(f"{kind} of {size} B in {types}: gradients must cross the wire in bf16")


# -- the tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_program_matches_the_report_and_the_plan(family):
    low = lowered(family)
    assert_program_matches(low.program_collectives(), as_counter(explain.collectives(low.step, *BATCH), low.mesh))
    check_family(family, low)
    check_bf16(family, low)
    names = program_text.instruction_names(low.text)
    assert not [n for n in names if n.startswith("xtrain_after")], "CPU-only ordering chain in the CUDA program"
    state = len(jax.tree.leaves(low.step.state))
    assert program_text.donated_inputs(low.text) == set(range(state)), "every state buffer donated"


def test_report_lists_what_the_cuda_program_runs_and_the_cpu_program_orders_them():
    low = lowered("zero2")
    assert_program_matches(low.program_collectives(), as_counter(low.step.report(*BATCH).collectives, low.mesh))
    cpu = low.step.lower(*BATCH, platform="cpu").as_text(dialect="hlo")
    assert any(n.startswith("xtrain_after") for n in program_text.instruction_names(cpu)), \
        "the CPU program should carry the ordering chain (or this test no longer sees it)"
    assert program_text.collectives(cpu, low.mesh) == low.program_collectives()


def test_zero2_without_its_reduce_scatter_fails_the_checks(monkeypatch):
    healthy = lowered("zero2")
    # a broken ZeRO-2: its update slices the local gradients (stage 1's path) and never reduces them
    original = zero.Update.__init__

    def stage_one(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.stage = 1 if self.stage == 2 else self.stage

    monkeypatch.setattr(zero.Update, "__init__", stage_one)
    broken = build("zero2")
    with pytest.raises(AssertionError, match="reduce-scattered"):
        check_family("zero2", broken)
    with pytest.raises(AssertionError, match="reduce-scatter"):
        assert_program_matches(broken.program_collectives(), as_counter(explain.collectives(healthy.step, *BATCH), healthy.mesh))


def _moe():
    from test_moe import case  # the in-repo MoE: top-2 of 4 experts and a shared expert, 2 layers
    model, _, loss_fn, batches, _ = case("moe")
    return copy.deepcopy(model), loss_fn, batches[0]


def _long_llama():
    from test_long_sequence import batches, llama, lm_loss
    torch.manual_seed(0)  # 1024 tokens: 8 chunks of one 128-token CUDA attention block
    return llama(layers=1, positions=1024), lm_loss, batches(1024, n=1, batch=2)[0]


# family -> (model, loss_fn, batch; mesh; the collective that defines it, over its axis)
MORE = {"expert": (_moe, dict(data=2, expert=4), ("all-to-all", ("expert",))),
        "context": (_long_llama, dict(data=2, context=4), ("collective-permute", ("context",)))}


@pytest.mark.parametrize("family", list(MORE))
def test_expert_and_context_parallel_cuda_programs_match_the_report(family):
    """Expert parallel's all-to-alls and context parallel's ring of permutes, lowered for CUDA:
    the program runs exactly the collectives the report lists, and no CPU-only ordering chain."""
    make, mesh, (kind, axes) = MORE[family]
    model, loss_fn, batch = make()
    step = xtrain.compile(model, xtrain.Mesh(**mesh), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          loss_fn=loss_fn)
    text = step.lower(*batch, platform="cuda").as_text(dialect="hlo")
    order = dict(step.mesh.shape)
    program = program_text.collectives(text, order)
    assert_program_matches(program, as_counter(explain.collectives(step, *batch), order))
    assert sum(n for (k, a, _), n in program.items() if k == kind and a == axes) > 0, program
    assert not [n for n in program_text.instruction_names(text) if n.startswith("xtrain_after")]


@pytest.mark.parametrize("family", ["dp", "megatron", "gpipe"])
def test_the_neuron_program_has_the_same_collectives_and_fits_a_trn1_node(family):
    low = lowered(family)
    text = low.step.lower(*BATCH, platform="neuron").as_text(dialect="hlo")
    assert program_text.collectives(text, low.mesh) == low.program_collectives()
    # 8 devices as 8 cores of one trn1.32xlarge: replica groups, permutes between neighbours
    target = conformance.Target.for_instance("trn1.32xlarge", devices_per_node=8)
    assert [f for f in conformance.check(text, target) if f.severity is conformance.Severity.ERROR] == []


def test_platform_errors():
    low = lowered("dp")
    with pytest.raises(OptionsError, match=r"platform='tpu' is not one xtrain lowers for; use one of cpu, cuda"):
        low.step.lower(*BATCH, platform="tpu")
