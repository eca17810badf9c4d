"""Ahead-of-time compiles for GPU clusters that are not here (xtrain.aot): every plan family's
step compiled by XLA's GPU compiler for 8 x H100 (p5.48xlarge:1), some for 2 x 8 A100
(p4d.24xlarge:2), all in one child process (one start-up), on this CPU-only machine.

- per (collective kind, mesh axes) the compiled program moves the bytes per step the report
  lists (within 1%), in no more collectives (XLA combines, never adds), nothing the report does
  not list; a program checked against another plan's report fails (the check can fail);
- DDP and ZeRO-3: at least 80% of the gradient all-reduce / weight all-gather bytes have a GEMM
  scheduled between start and done (XLA's latency-hiding scheduler with xtrain's flags);
- a second compile, in another child with a fake ptxas first on the host's PATH, gives the
  byte-identical executable, and the fake was never run (the pinned wheel's ptxas was used).
"""
import os
import stat
import time

import jax
import jax.numpy as jnp
import pytest
import torch

import xtrain
from models import GPT, SequenceParallelGPT, token_batches
from test_long_sequence import batches as long_batches, llama
from test_long_sequence import lm_loss as ids_loss
from test_moe import lm_batches, lm_loss, mixtral
from xtrain import aot, plans
from xtrain.aot import schedule, toolchain
from xtrain.errors import MeshError, TargetCompileError, UnsupportedError
from xtrain.lowering import accounting

E2E = pytest.mark.e2e  # compiles steps (in a child); the two unit tests below compile nothing

H100, A100 = "p5.48xlarge:1", "p4d.24xlarge:2"
PIPE = xtrain.Mesh(pipe=2, data=4)
# Gradient buckets of about one layer of the small GPT (d=32: ~50 KB per block), as a real model's
# 25 MiB buckets are to its layers: each bucket's all-reduce can start while earlier layers compute.
LAYER_BUCKETS = xtrain.GradSync(bucket_bytes=64 * 1024)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _gpt(mesh, plan, layers=4, **options):
    def case():
        torch.manual_seed(0)
        return GPT(layers=layers, d=32, seq=16), token_batches(n=1, batch=16)[0], mesh, plan, options
    return case


def _megatron_sp():
    torch.manual_seed(0)
    model, mesh = SequenceParallelGPT(d=32, layers=2), xtrain.Mesh(data=4, tensor=2)
    return model, token_batches(n=1, batch=16)[0], mesh, plans.megatron(model, mesh), {}


def _hybrid(mesh):
    def case():
        torch.manual_seed(0)
        model = GPT(layers=2, d=32, seq=16)
        return model, token_batches(n=1, batch=16)[0], mesh, plans.hybrid(model, mesh), {}
    return case


def _expert():
    torch.manual_seed(0)
    return mixtral(), lm_batches(n=1, batch=8, seq=8)[0], xtrain.Mesh(data=2, expert=4), xtrain.Plan(), \
        dict(loss_fn=lm_loss)


def _context():
    torch.manual_seed(0)
    return llama(positions=128), long_batches(128, n=1, batch=4)[0], xtrain.Mesh(data=2, context=4), xtrain.Plan(), \
        dict(loss_fn=ids_loss)


# family -> (target, case); DDP and ZeRO-3 unrolled (scan_layers=False) so that each layer's
# gradients and gathers stand apart in the schedule, as in a real model's step
FAMILIES = {
    "ddp": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(), scan_layers=False, grad_sync=LAYER_BUCKETS)),
    "zero1": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=1), layers=2)),
    "zero2": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=2), layers=2)),
    "zero3": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=3), scan_layers=False)),
    "hsdp": (H100, _hybrid(xtrain.Mesh(replicate=2, data=4))),
    "megatron_sp": (H100, _megatron_sp),
    "gpipe": (H100, _gpt(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=4))),
    "1f1b": (H100, _gpt(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule="1f1b"))),
    "interleaved": (H100, _gpt(PIPE, xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule="interleaved",
                                                                 virtual_stages=2))),
    "expert": (H100, _expert),
    "context": (H100, _context),
    "offload_optimizer": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=1, offload="optimizer"), layers=2)),
    "int8": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(), layers=2, grad_sync=xtrain.GradSync(comm_dtype="int8"))),
    "a100_ddp": (A100, _gpt(xtrain.Mesh(data=-1), xtrain.Plan(), layers=2)),
    "a100_hsdp": (A100, _hybrid(xtrain.Mesh(replicate=2, data=8))),
}


def _prepare(family):
    target, case = FAMILIES[family]
    model, batch, mesh, plan, options = case()
    return aot.prepare(model, mesh, target=target, optimizer=adamw(model.parameters()), plan=plan, batch=batch,
                       **options)


@pytest.fixture(scope="module")
def compiled():
    """Every family compiled in one child process: family -> TargetProgram (and the seconds)."""
    start = time.perf_counter()
    prepared = {family: _prepare(family) for family in FAMILIES}
    traced = time.perf_counter() - start
    programs = dict(zip(prepared, aot.compile_prepared(list(prepared.values()))))
    print(f"\naot: {len(programs)} steps traced in {traced:.1f} s, compiled in {time.perf_counter() - start - traced:.1f} s "
          f"({', '.join(f'{f} {p.compile_s:.1f}' for f, p in programs.items())})")
    return programs


@E2E
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_collectives_are_the_reports(compiled, family):
    program = compiled[family]
    assert aot.disagreements(program) == [], family
    assert program.collectives and program.memory.fits and program.flops > 0
    assert program.memory.capacity == (84942979072 if program.target == H100 else 42331013120)
    assert program.memory.temporaries > 0 and program.memory.aliased > 0  # the state is donated


@E2E
def test_the_check_fails_for_another_plans_report(compiled):
    """ZeRO-3's program against DDP's report: all-gathers and reduce-scatters the report does not
    list; int8's gradient sync against DDP's fp32 report: other kinds and fewer bytes."""
    ddp = compiled["ddp"].report().collectives
    zero3 = aot.disagreements(compiled["zero3"], ddp)
    assert any("all-gather over data" in p and "none in the report" in p for p in zero3), zero3
    int8 = aot.disagreements(compiled["int8"], compiled["ddp"].report().collectives)
    assert int8, "int8's program cannot pass for fp32 DDP's"


@E2E
@pytest.mark.parametrize("family, kinds", [("ddp", ("all-reduce",)), ("zero3", ("all-gather",))])
def test_gradient_and_weight_collectives_overlap_gemms(compiled, family, kinds):
    program = compiled[family]
    share = program.overlapped_share(kinds, ("data",))
    assert share >= 0.8, [(c.kind, c.bytes, c.gemms) for c in program.collectives]


@E2E
def test_the_report_is_the_steps(compiled):
    """program.report() lists what step.report() lists for the same plan on 8 devices (the same
    assembly, traced on devices here and on the target's abstract mesh)."""
    _, case = FAMILIES["ddp"]
    model, batch, mesh, plan, options = case()
    step = xtrain.compile(model, mesh, optimizer=adamw(model.parameters()), plan=plan, **options)
    on_devices = accounting.collectives(step.program(*batch), dict(step.mesh.shape), step.model.module_paths())
    assert sorted(map(str, on_devices)) == sorted(map(str, compiled["ddp"].report().collectives))
    assert "cuDNN" in " ".join(compiled["ddp"].report().notes)


@E2E
def test_two_compiles_are_byte_identical_with_the_pinned_ptxas(compiled, tmp_path, monkeypatch):
    """A second compile of the DDP step, in a child whose host PATH starts with a fake ptxas that
    records its calls and fails: the same executable, and the fake never ran."""
    fake, called = tmp_path / "bin" / "ptxas", tmp_path / "fake-ptxas-ran"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    (again,) = aot.compile_prepared([_prepare("ddp")])
    assert not called.exists(), "XLA ran the ptxas found on the host's PATH"
    first = compiled["ddp"]
    assert again.executable == first.executable and again.sha256 == first.sha256
    saved = first.save(tmp_path / "ddp")
    manifest = (saved / "manifest.json").read_text()
    assert first.sha256 in manifest and toolchain.ptxas_version() in manifest and "jaxlib" in manifest
    assert (saved / "executable.bin").read_bytes() == first.executable
    assert toolchain.ptxas_version().startswith("12.")  # the wheel's CUDA 12, not the host's toolkit


@pytest.mark.unit
def test_targets_without_gpus_and_meshes_that_do_not_fit_are_named_errors():
    model = GPT(layers=1, d=32)
    batch = (jax.ShapeDtypeStruct((16, 16), jnp.int32),) * 2
    with pytest.raises(UnsupportedError, match="trn1.32xlarge has no GPU target config"):
        aot.prepare(model, xtrain.Mesh(data=-1), target="trn1.32xlarge", optimizer=adamw(model.parameters()),
                    batch=batch)
    with pytest.raises(MeshError, match="needs 4 devices but 16"):
        aot.prepare(model, xtrain.Mesh(data=4), target=A100, optimizer=adamw(model.parameters()), batch=batch)


@pytest.mark.unit
def test_a_missing_toolchain_names_the_extra(monkeypatch):
    monkeypatch.setattr(toolchain, "NVCC_WHEEL", "nvidia.no_such_wheel")
    with pytest.raises(TargetCompileError, match="gpu-compile"):
        toolchain.check_installed()


@pytest.mark.unit
def test_every_operand_of_a_combined_collective_is_counted():
    """Compiled HLO numbers long operand lists (`/*index=5*/%g`): the operand after each comment
    is counted too (it was lost once: ZeRO-3's combined reduce-scatter read 5184 B short)."""
    text = """HloModule m, entry_computation_layout={()->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main () -> f32[] {
""" + "".join(f"  %p{i} = f32[{8 * (i + 1)}]{{0}} constant({{...}})\n" for i in range(7)) + """\
  %rs-start = ((f32[8]{0}, f32[16]{0}, f32[24]{0}, f32[32]{0}, f32[40]{0}, /*index=5*/f32[48]{0}, f32[56]{0}), \
(f32[1]{0}, f32[2]{0}, f32[3]{0}, f32[4]{0}, f32[5]{0}, /*index=5*/f32[6]{0}, f32[7]{0})) reduce-scatter-start(\
%p0, %p1, %p2, %p3, %p4, /*index=5*/%p5, %p6), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, \
use_global_device_ids=true, dimensions={0}, to_apply=%add
  %rs-done = (f32[1]{0}, f32[2]{0}, f32[3]{0}, f32[4]{0}, f32[5]{0}, /*index=5*/f32[6]{0}, f32[7]{0}) \
reduce-scatter-done(%rs-start)
  ROOT %r = f32[] constant(0)
}
"""
    (rs,) = schedule.Schedule(text, {"data": 8}).collectives()
    assert (rs.kind, rs.axes, rs.bytes) == ("reduce-scatter", ("data",), 4 * 8 * (1 + 2 + 3 + 4 + 5 + 6 + 7))
