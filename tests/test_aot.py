"""Ahead-of-time compiles for GPU clusters that are not here (xtrain.aot): DDP, ZeRO-3, Megatron
TP+SP, a 1F1B pipeline, expert parallel, ring context parallel and int8 gradient sync compiled by
XLA's GPU compiler for 8 x H100 (p5.48xlarge:1), HSDP for 2 x 8 A100 (p4d.24xlarge:2), all in one
child process (one start-up), on this CPU-only machine. Every other family (ZeRO-1/2, GPipe,
interleaved, offload, ...) is compiled by benchmarks/aot_families.py (suite time).

- per (collective kind, mesh axes) the compiled program moves the bytes per step the report
  lists (within 1%), in no more collectives (XLA combines, never adds), nothing the report does
  not list; a program checked against another plan's report fails (the check can fail);
- DDP and ZeRO-3: at least 80% of the gradient all-reduce / weight all-gather bytes have a GEMM
  scheduled between start and done (XLA's latency-hiding scheduler with xtrain's flags);
- a second compile, in another child with a fake ptxas first on the host's PATH, gives the same
  program and the fake was never run (the pinned wheel's ptxas was used); its executable is not yet
  byte-identical across processes (an open, strict xfail below).
"""
import math
import os
import re
import stat
import time

import jax
import jax.numpy as jnp
import pytest
import torch

import xtrain
from models import GPT, SequenceParallelGPT, token_batches
from test_long_sequence import batches as long_batches, llama, lm_loss as ids_loss
from test_moe import lm_batches, lm_loss, mixtral
from xtrain import aot, plans
from xtrain.aot import schedule, toolchain
from xtrain.errors import InputError, MeshError, TargetCompileError, UnsupportedError
from xtrain.lowering import accounting

E2E = pytest.mark.e2e  # compiles steps (in a child); the two unit tests below compile nothing

H100, A100 = "p5.48xlarge:1", "p4d.24xlarge:2"
# Gradient buckets of half a layer of the small GPT (d=16: ~13 KB per block), as a real model's
# 25 MiB buckets are to its layers: XLA combines collectives up to one bucket (xtrain.aot passes
# the bucket as its combine threshold), so each bucket's all-reduce / all-gather stands apart and
# can run while other layers compute; the last bucket (the embeddings, whose gradients finish
# last) has nothing left to hide behind, a small share with four layers (a third with two).
LAYER_BUCKETS = xtrain.GradSync(bucket_bytes=6 * 1024)
D, SEQ = 16, 8


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _gpt(mesh, plan, layers=1, batch=8, **options):
    def case():
        torch.manual_seed(0)
        return GPT(layers=layers, d=D, seq=SEQ), token_batches(n=1, batch=batch, seq=SEQ)[0], mesh, plan, options
    return case


def _megatron_sp():
    torch.manual_seed(0)
    model, mesh = SequenceParallelGPT(d=D, layers=1, seq=SEQ), xtrain.Mesh(data=4, tensor=2)
    return model, token_batches(n=1, batch=8, seq=SEQ)[0], mesh, plans.megatron(model, mesh), {}


def _hybrid(mesh, batch):
    def case():
        torch.manual_seed(0)
        model = GPT(layers=1, d=D, seq=SEQ)
        return model, token_batches(n=1, batch=batch, seq=SEQ)[0], mesh, plans.hybrid(model, mesh), {}
    return case


def _context():
    torch.manual_seed(0)  # HF Llama, a ring over context=4: its backward passes k and v round again
    return llama(layers=1, positions=32), long_batches(32, n=1, batch=4)[0], xtrain.Mesh(data=2, context=4), \
        xtrain.Plan(), dict(loss_fn=ids_loss)


def _llama_remat():
    torch.manual_seed(0)  # HF Llama, 4 layers in a scan, each checkpointed: the saved inputs are one stack
    return llama(layers=4, positions=64), long_batches(64, n=1, batch=8)[0], xtrain.Mesh(data=8), \
        xtrain.Plan(zero=3, remat="full", precision="bf16"), dict(loss_fn=ids_loss)


def _expert(zero=0):
    def case():
        torch.manual_seed(0)
        return mixtral(), lm_batches(n=1, batch=8, seq=SEQ)[0], xtrain.Mesh(data=2, expert=4), \
            xtrain.Plan(zero=zero), dict(loss_fn=lm_loss)
    return case


# family -> (target, case): the suite's families (the others: benchmarks/aot_families.py). DDP and
# ZeRO-3 have four unrolled layers (scan_layers=False), so that each layer's gradients and gathers
# stand apart in the schedule, as in a real model's step.
FAMILIES = {
    "ddp": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(), layers=4, scan_layers=False, grad_sync=LAYER_BUCKETS)),
    "zero3": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=3), layers=4, scan_layers=False,
                         grad_sync=LAYER_BUCKETS)),
    # ZeRO-3 under fp8 in a layer scan: e4m3 weight gathers with their scales' amax, bf16 gradients
    "zero3_fp8": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(zero=3, precision="fp8"), layers=2)),
    "zero3_remat": (H100, _llama_remat),
    "megatron_sp": (H100, _megatron_sp),
    "1f1b": (H100, _gpt(xtrain.Mesh(pipe=2, data=4), xtrain.Plan().with_pipeline(stages=2, microbatches=2,
                                                                                 schedule="1f1b"), layers=2)),
    "expert": (H100, _expert()),
    # ZeRO-3 beside expert parallelism: the experts' shards gathered over data, the rest over data x expert
    "expert_zero3": (H100, _expert(zero=3)),
    "context": (H100, _context),
    "int8": (H100, _gpt(xtrain.Mesh(data=8), xtrain.Plan(), grad_sync=xtrain.GradSync(comm_dtype="int8"))),
    "a100_hsdp": (A100, _hybrid(xtrain.Mesh(replicate=2, data=8), batch=16)),
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
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_collectives_are_the_reports(compiled, family):
    program = compiled[family]
    assert aot.disagreements(program) == [], family
    assert program.collectives and program.memory.fits and program.flops > 0
    assert program.memory.capacity == (84942979072 if program.target == H100 else 42331013120)
    assert program.memory.temporaries > 0 and program.memory.aliased > 0  # the state is donated


@E2E
def test_the_check_fails_for_another_plans_report(compiled):
    """ZeRO-3's program against DDP's report (same model): all-gathers and reduce-scatters the
    report does not list; int8's gradient sync against the fp32 sync of the same model (its
    report, traced and never compiled): a narrower wire dtype moves fewer bytes than reported."""
    zero3 = aot.disagreements(compiled["zero3"], compiled["ddp"].report().collectives)
    assert any("all-gather over data" in p and "none in the report" in p for p in zero3), zero3
    target, case = FAMILIES["int8"]
    model, batch, mesh, plan, _ = case()
    fp32 = aot.prepare(model, mesh, target=target, optimizer=adamw(model.parameters()), plan=plan, batch=batch)
    reported = accounting.collectives(fp32.jaxpr, fp32.sizes, fp32.built.model.module_paths())
    int8 = aot.disagreements(compiled["int8"], reported)
    assert any("B per step compiled vs" in p for p in int8), int8


@E2E
@pytest.mark.parametrize("family, kinds", [("ddp", ("all-reduce",)),
                                           ("zero3", ("all-gather",))])
def test_gradient_and_weight_collectives_overlap_gemms(compiled, family, kinds):
    program = compiled[family]
    share = program.overlapped_share(kinds, ("data",))
    assert share >= 0.8, [(c.kind, c.bytes, c.gemms) for c in program.collectives]
    # the step's own XLA options (xtrain.lowering.gpu_options), in the manifest: a reduce-scatter's
    # threshold is the 6 KB bucket over its 8 devices; ZeRO-3's re-gathers may run beside them
    options = program.manifest["compiler_options"]
    assert options["xla_gpu_reduce_scatter_combine_threshold_bytes"] == (768 if family == "zero3" else 6144)
    assert options["xla_gpu_experimental_parallel_collective_overlap_limit"] == (2 if family == "zero3" else 1)


@E2E
def test_saved_layer_inputs_are_never_transposed_as_one_stack(compiled):
    """ZeRO-3 with full remat in a layer scan (HF Llama, 4 layers): the forward pass saves each
    layer's input in one stack (layers x tokens x hidden). XLA's GPU layout assignment gave that
    stack the hidden-major layout the backward pass prefers and transposed all of it at once after
    the forward pass, a second copy of every saved input (20 GiB per H100 on Llama-3-70B). xtrain
    saves them flat (xtrain.lowering.explicit.layer_scan): each value of the stack's size that
    the step's top level makes has the layers as its major dimension."""
    text = compiled["zero3_remat"].text
    entry = text[text.index("\nENTRY"):]
    elements = 4 * 1 * 64 * 32  # layers x (local batch 1 x 64 tokens) x hidden
    made = [dims for dims, op in re.findall(r"= f32\[([0-9,]+)\]\{[0-9,]+\} ([\w-]+)\(", entry)
            if op not in ("get-tuple-element", "bitcast", "parameter")
            and math.prod(int(d) for d in dims.split(",")) == elements]
    assert made and all(dims.split(",")[0] == "4" for dims in made), made


@E2E
def test_the_embedding_gradients_zeros_are_made_after_the_backward_loop(compiled):
    """The embedding's gradient is a scatter-add into a table of zeros. With memory to spare,
    XLA's GPU scheduler made that table before the backward pass's layer loop and held it
    throughout (2 GiB on Llama-3.1-8B); xtrain makes the zeros from the cotangent
    (xtrain.lowering.explicit.rules.indexing), so they come after the loop."""
    text = compiled["zero3_remat"].text
    lines = text[text.index("\nENTRY"):].splitlines()
    loop = max(i for i, line in enumerate(lines) if " while(" in line)
    (scatter,) = [line for line in lines if "embed_tokens" in line and re.match(r"\s*%\S*scatter\S* = \S+ fusion", line)]
    zeros = re.search(r"fusion\(%([\w.\-]+)", scatter).group(1)
    made = [i for i, line in enumerate(lines) if line.strip().startswith(f"%{zeros} ")]
    assert made and made[0] > loop, (made, loop, scatter[:200])


@E2E
def test_zero3_beside_expert_parallel_gathers_the_experts_over_data_alone(compiled):
    """ZeRO-3 on Mesh(data=2, expert=4), compiled for H100s: the expert weights (split over
    `expert`) are gathered and their gradients reduce-scattered over `data` alone, every other
    weight over data x expert; the report lists the same (the family's agreement test)."""
    found = {(c.kind, tuple(c.axes)) for c in compiled["expert_zero3"].collectives}
    for kind in ("all-gather", "reduce-scatter"):
        assert {(kind, ("data",)), (kind, ("data", "expert"))} <= found, found


@E2E
def test_expert_dispatch_sends_routed_rows_while_the_other_chunks_experts_compute(compiled):
    """The expert family built for CUDA: each MoE layer's dispatch and combine are ragged
    all-to-alls of the routed rows (8 tokens x top-2 per device, 32 features + the expert id),
    where the fixed buffers of CPU move 4 peers' worth; in 2 chunks, so that per layer and
    direction chunk 1's dispatch and chunk 0's combine run while the other chunk's expert GEMMs
    compute, the first dispatch while the experts run the rows a device routes to itself (never
    sent) and the last combine while they run the other chunk's own rows: each of a layer's 4
    all-to-alls each way encloses expert GEMMs of other rows (one more collective in flight for
    an expert mesh, xtrain.lowering.gpu_options, and the step's counts summed after the loss)."""
    program, layers, tokens, top_k, hidden = compiled["expert"], 2, 8 * SEQ // 8, 2, 32
    ragged = [c for c in program.collectives if c.name.startswith("ragged-all-to-all")]
    assert len(ragged) == layers * 2 * 2 * 2  # (dispatch, combine) x 2 chunks, forward and backward
    routed = tokens * top_k * hidden * 4  # bytes of one layer's routed rows, f32
    dispatch = [c.bytes for c in ragged if c.payload % ((hidden + 1) * 4) == 0]  # rows with their expert id
    assert sum(dispatch) == layers * 2 * routed * (hidden + 1) // hidden <= 1.1 * layers * 2 * routed
    for layer in range(layers):
        experts = f"model.layers.{layer}.mlp.experts/"
        hidden_by_experts = [c for c in ragged if any(experts in g and "grouped_matmul" in g for g in c.overlapped)]
        assert len(hidden_by_experts) == 8, [(c.name, c.overlapped) for c in ragged]
    assert program.manifest["compiler_options"]["xla_gpu_experimental_parallel_collective_overlap_limit"] == 2
    notes = " ".join(program.report().notes)
    assert "by ragged all-to-all over 'expert'" in notes and "in 2 chunks" in notes


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


@pytest.fixture(scope="module")
def recompiled(tmp_path_factory):
    """A second compile of the int8 step, in a child whose host PATH starts with a fake ptxas that
    records its calls and fails: (the program, whether the fake ran)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    fake, called = bin_dir / "ptxas", bin_dir / "fake-ptxas-ran"
    fake.write_text(f"#!/bin/sh\ntouch {called}\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        (again,) = aot.compile_prepared([_prepare("int8")])
    return again, called.exists()


@E2E
def test_the_pinned_ptxas_is_used_and_the_manifest_names_it(compiled, recompiled, tmp_path):
    again, fake_ran = recompiled
    assert not fake_ran, "XLA ran the ptxas found on the host's PATH"
    assert again.collectives == compiled["int8"].collectives and again.memory == compiled["int8"].memory
    first = compiled["int8"]
    saved = first.save(tmp_path / "int8")
    manifest = (saved / "manifest.json").read_text()
    assert first.sha256 in manifest and toolchain.ptxas_version() in manifest and "jaxlib" in manifest
    assert (saved / "executable.bin").read_bytes() == first.executable
    assert toolchain.ptxas_version().startswith("12.")  # the wheel's CUDA 12, not the host's toolkit


# The step is prepared twice, from two lines of this file, and compiled in two processes: the
# executables were 18 bytes apart (the call site's line in the program's stack frames, and the module
# fingerprints over them) until the export left source locations out.
@E2E
def test_two_compiles_in_two_processes_are_byte_identical(compiled, recompiled):
    again, _ = recompiled
    same = again.executable == compiled["int8"].executable  # not pytest's diff of two executables (minutes with -v)
    assert same and again.sha256 == compiled["int8"].sha256, (again.sha256, compiled["int8"].sha256)


@pytest.mark.unit
def test_targets_without_gpus_and_meshes_that_do_not_fit_are_named_errors():
    model = GPT(layers=1, d=D, seq=SEQ)
    batch = (jax.ShapeDtypeStruct((16, SEQ), jnp.int32),) * 2
    with pytest.raises(UnsupportedError, match="trn1.32xlarge has no GPU target config"):
        aot.prepare(model, xtrain.Mesh(data=-1), target="trn1.32xlarge", optimizer=adamw(model.parameters()),
                    batch=batch)
    with pytest.raises(MeshError, match="needs 4 devices but 16"):
        aot.prepare(model, xtrain.Mesh(data=4), target=A100, optimizer=adamw(model.parameters()), batch=batch)
    with pytest.raises(InputError, match="global batch 16 does not split into accumulate=2 micro-batches on each of "
                                         "16 data-parallel devices"):
        aot.prepare(model, xtrain.Mesh(data=-1), target=A100, optimizer=adamw(model.parameters()), batch=batch,
                    accumulate=2)


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


def _outputs(text: str, op: str) -> set[tuple[str, str]]:
    """(dtype, shape) of every array `op` (e.g. all-gather-done) yields in scheduled HLO `text`."""
    found = set()
    for line in text.splitlines():
        head, sep, _ = line.partition(f" {op}(")
        if sep:
            found.update(re.findall(r"(\w+)\[([\d,]*)\]", head.partition("=")[2]))
    return found


@E2E
def test_zero3_under_fp8_gathers_e4m3_and_reduces_bf16_in_the_gpu_program(compiled):
    """The program XLA's GPU compiler scheduled for H100s gathers the layers' weight matrices as
    e4m3 and reduces their gradients in bf16 (the byte counts: the test above). The GPT (d=16)
    has matrices of (16, 16), (64, 16) and (16, 64) (the token embedding, (64, 16) too, is
    gathered in float32 for its lookup); (16, 16) and (16, 64) are no other tensor's shape, nor
    their shards' (2, 16) and (2, 64) over 8 devices."""
    text = compiled["zero3_fp8"].text
    gathered, scattered = _outputs(text, "all-gather-done"), _outputs(text, "reduce-scatter-done")
    assert {("f8e4m3fn", "16,16"), ("f8e4m3fn", "64,16")} <= gathered, gathered
    assert not {(d, s) for d, s in gathered if s in ("16,16", "16,64") and d != "f8e4m3fn"}, gathered
    assert ("bf16", "2,16") in scattered, scattered
    assert not {(d, s) for d, s in scattered if s in ("2,16", "2,64") and d != "bf16"}, scattered
