"""Ahead-of-time compiles for GPU clusters that are not here: XLA's GPU compiler, run on this CPU.

    import xtrain
    program = xtrain.aot.compile(model, xtrain.Mesh(data=-1, tensor=8), target="p5.48xlarge:2",
                                 optimizer=torch.optim.AdamW(model.parameters()), plan=plan,
                                 batch=(jax.ShapeDtypeStruct((16, 2048), jnp.int32),) * 2)
    program.memory.total, program.memory.fits      # bytes per GPU, against its capacity
    program.collectives                            # kind, axes, bytes, overlap_flops (scheduled)
    program.report()                               # the Report step.report() gives
    program.save("out/")                           # executable + manifest.json

The step is the one `xtrain.compile` builds (the one assembly function, on an AbstractMesh of the
target's size), exported for CUDA here and compiled in a child process (xtrain.aot.toolchain:
JAX_PLATFORMS=cpu, xtrain's GPU XLA flags, the pinned ptxas of the gpu-compile extra) for a
topology of the target's GPUs (xtrain.aot.targets). `prepare` + `compile_prepared` compile several
steps in one child (what `xtrain plan --compile` does with its best candidates).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from xtrain.aot import targets, toolchain
from xtrain.aot.program import Memory, TargetProgram, disagreements
from xtrain.aot.request import Prepared
from xtrain.aot.request import prepare as _prepare
from xtrain.aot.schedule import ScheduledCollective
from xtrain.aot.targets import GpuTarget, gpu_target
from xtrain.errors import OptionsError, TargetCompileError
from xtrain.lowering.gradient_sync import GradSync
from xtrain.lowering.options import StepOptions
from xtrain.sharding.mesh import Mesh
from xtrain.step import CompileOptions

__all__ = ["compile", "prepare", "compile_prepared", "TargetProgram", "Memory", "ScheduledCollective", "Prepared",
           "GpuTarget", "gpu_target", "disagreements"]

TIMEOUT_S = 1800.0


def prepare(model: Any, mesh: Mesh, *, target: str, optimizer: Any, batch: Sequence[Any], plan: Any = None,
            loss_fn: Callable | None = None, params: Any = None, lowering: str = "explicit",
            grad_sync: GradSync | None = None, scan_layers: bool | str = "auto", zero3_regather: bool | None = None,
            clip_grad_norm: float | None = None, accumulate: int = 1) -> Prepared:
    """Assembles and exports the step `compile` compiles, without compiling it (arguments as
    `compile`'s). Raises what xtrain.compile would: a plan or mesh that does not fit."""
    from xtrain import api

    if lowering != "explicit":
        raise OptionsError(f"lowering={lowering!r}: ahead-of-time compiles build xtrain's explicit lowering")
    gpu = targets.gpu_target(target)
    options = CompileOptions(lowering=lowering, grad_sync=grad_sync, scan_layers=scan_layers,
                             zero3_regather=zero3_regather,
                             step=StepOptions(clip_grad_norm=clip_grad_norm, accumulate=accumulate))
    trainable = api.trainable_of(model, optimizer, loss_fn, params, what="xtrain.aot.compile")
    return _prepare(trainable, mesh, plan, tuple(batch), gpu, options)


def compile_prepared(prepared: Sequence[Prepared], *, timeout_s: float = TIMEOUT_S) -> list[TargetProgram]:
    """Compiles prepared steps in one child process (one start-up for all); a step XLA refuses is
    a TargetCompileError naming its target and plan."""
    from xtrain.aot.program import program_of

    results = toolchain.run_child([p.job for p in prepared], timeout_s)
    versions, flags = toolchain.versions(), toolchain.xla_flags()
    programs = []
    for p, result in zip(prepared, results):
        if "error" in result:
            raise TargetCompileError(f"XLA could not compile the step for {p.target.spec} (mesh {p.sizes}, plan "
                                     f"{p.built.plan!r}) without its GPUs:\n{result['error']}")
        programs.append(program_of(p, result, versions, flags))
    return programs


def compile(model: Any, mesh: Mesh, *, target: str, optimizer: Any, batch: Sequence[Any], plan: Any = None,
            loss_fn: Callable | None = None, timeout_s: float = TIMEOUT_S, **options) -> TargetProgram:
    """Compiles `model`'s training step for the GPU cluster `target` on this machine, without it.

    Args:
        model: a torch.nn.Module (its parameters may be on the meta device) or a JAX function
            (then `params=`), as for xtrain.compile.
        mesh: the mesh, resolved over the target's GPUs (`Mesh(data=-1, tensor=8)`).
        target: 'INSTANCE[:NODES]' as for `xtrain plan --target`: p4d.24xlarge, p4de.24xlarge,
            p5.48xlarge, p5e.48xlarge, p5en.48xlarge.
        optimizer: a torch optimizer (or optax transformation for a JAX function).
        batch: the global batch: jax.ShapeDtypeStruct, torch tensors (meta ones too) or arrays;
            only shapes and dtypes are read.
        plan: a Plan or preset (default: data parallel); `plans.megatron(model, mesh)` without an
            example is derived on the batch's shapes.
        loss_fn: as for xtrain.compile.
        timeout_s: the child compile's time limit.
        options: params, grad_sync, scan_layers, zero3_regather, clip_grad_norm, accumulate (as
            for xtrain.compile).

    Returns:
        The TargetProgram: memory per device, scheduled collectives, FLOPs, HLO, report(), save().
        Attention is traced with xtrain's blockwise kernel (cuDNN's fused attention cannot be built
        deviceless; the program's notes say so).
    """
    prepared = prepare(model, mesh, target=target, optimizer=optimizer, batch=batch, plan=plan, loss_fn=loss_fn,
                       **options)
    return compile_prepared([prepared], timeout_s=timeout_s)[0]
