"""The parent's half of an ahead-of-time compile: the step assembled and exported for the target.

The model is traced here (torch and the front end live in this process), by the one assembly
function (xtrain.lowering.assembly.assemble) on an AbstractMesh of the target's size, as the cost
model's abstract step is. The step is then exported for CUDA (jax.export: StableHLO with its
shardings and donated state) as a flat function of its argument leaves, so the child needs no
torch, no xtrain and no pytree types: it deserialises the module, places the arguments on a
topology mesh of the target's GPUs and compiles. Nothing here reads a value, so a model on the
meta device prepares like any other.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np
from jax._src import config as jax_config  # traceback_in_locations_limit has no public context manager
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from xtrain import data
from xtrain.aot.targets import GpuTarget
from xtrain.errors import OptionsError, TargetCompileError
from xtrain.frontend import tensors
from xtrain.ir.model import Trainable
from xtrain.lowering import accumulation, assembly
from xtrain.lowering.assembly import BuiltStep
from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import PendingPlan, Plan
from xtrain.step import CompileOptions


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A step assembled and exported for a GPU target, not yet compiled.

    Attributes:
        target: the GPU cluster.
        built: the assembled step (on an AbstractMesh of the target's size).
        trainable: the model and optimizer it was assembled from.
        batch: the batch's shapes, with their shardings on the abstract mesh.
        jaxpr: the traced training step (what step.report() counts collectives in).
        job: what the child compiles (xtrain.aot._child), picklable.
        options: the compile options.
    """

    target: GpuTarget
    built: BuiltStep
    trainable: Trainable
    batch: tuple
    jaxpr: Any
    job: dict
    options: CompileOptions

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.built.mesh.shape)


def batch_shapes(batch: tuple) -> tuple:
    """The batch as jax.ShapeDtypeStruct: given so, or read from torch tensors (meta ones too) and
    arrays; 64-bit types narrowed as the step narrows them (frontend.tensors)."""
    return tuple(x if isinstance(x, jax.ShapeDtypeStruct) or not hasattr(x, "shape") else tensors.shape_of(x)
                 for x in batch)


def _placed_batch(built: BuiltStep, shapes: tuple) -> tuple:
    layout, mesh, out = built.layout, built.mesh, []
    for index, x in enumerate(shapes):
        if not isinstance(x, jax.ShapeDtypeStruct):
            raise OptionsError(f"batch argument {index} is a {type(x).__name__}: give the batch as arrays, torch "
                               "tensors (meta ones too) or jax.ShapeDtypeStruct")
        spec = dict(layout.batch_args).get(index, layout.batch_spec)
        if x.ndim:
            data.check_divisible(index, x.shape, spec, mesh)
        sharding = data.batch_sharding(mesh, spec, x.ndim) if x.ndim else NamedSharding(mesh, PartitionSpec())
        out.append(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding))
    return tuple(out)


def _plan(plan: Plan | PendingPlan | str | None, trainable: Trainable, shapes: tuple) -> Plan:
    if plan is None:
        return Plan()
    if isinstance(plan, str):
        raise OptionsError(f"plan={plan!r}: an ahead-of-time compile takes a Plan or a preset; `xtrain plan "
                           "--target ... --compile` searches and compiles the best candidates")
    if isinstance(plan, PendingPlan):  # plans.megatron(model, mesh) without example=: derived on the shapes
        return plan.resolved(trainable.model, shapes)
    return plan


def prepare(trainable: Trainable, mesh: Mesh, plan, batch: tuple, target: GpuTarget,
            options: CompileOptions = CompileOptions(), *, on_device: bool = False) -> Prepared:
    """Assembles `trainable`'s step for `plan` on `mesh` resolved over the target's GPUs and exports
    it for CUDA; raises what the assembly raises (a plan that does not fit the mesh, ...).
    `on_device=True`: the job is for a compile on the target's GPUs themselves, so it may call
    cuDNN's fused attention (a deviceless compile cannot build it; benchmarks/gpu_step.py)."""
    sizes = mesh.resolve(target.devices)
    abstract = AbstractMesh(tuple(sizes.values()), tuple(sizes))
    if on_device:  # cuDNN's lowering wants devices: this host's stand in for the target's (the mesh's shape)
        if len(jax.devices()) < abstract.size:
            raise TargetCompileError(f"prepare(on_device=True) for {target.spec} (mesh {sizes}) lowers on {abstract.size} "
                                     f"of this host's devices and it has {len(jax.devices())}: call "
                                     f"xtrain.init(cpu_devices={abstract.size}) first")
        abstract = jax.sharding.Mesh(np.array(jax.devices()[:abstract.size]).reshape(abstract.axis_sizes),
                                     abstract.axis_names)
    shapes = batch_shapes(batch)
    plan = _plan(plan, trainable, shapes)
    built = assembly.assemble(trainable, plan, abstract, options.assembly(), batch=shapes,
                              target=assembly.Target(platform="cuda", local_devices=target.gpus_per_node))
    placed = _placed_batch(built, shapes)
    data_size = int(np.prod([sizes[a] for a in built.layout.batch_axes]))
    accumulation.check_divisible(placed, options.step.accumulate, data_size)  # as a step's call checks it
    lrs = assembly.lrs_shape(trainable)
    lrs = jax.ShapeDtypeStruct(lrs.shape, lrs.dtype, sharding=NamedSharding(abstract, PartitionSpec()))
    args = (built.placed_state, placed, lrs)
    jaxpr = built.program.train.trace(*args).jaxpr
    return Prepared(target, built, trainable, placed, jaxpr, _job(built, args, target, options, on_device), options)


# the custom calls of cuDNN's fused attention (jax._src.cudnn), outside jax.export's stable list
CUDNN_TARGETS = tuple(f"__cudnn$fmha{bias}Softmax{dropout}{grad}" for bias in ("", "ScaleBias")
                      for dropout in ("", "Dropout") for grad in ("", "Backward"))


def _job(built: BuiltStep, args: tuple, target: GpuTarget, options: CompileOptions, on_device: bool = False) -> dict:
    """The child's job: the step exported as a function of its argument leaves."""
    leaves, tree = jax.tree.flatten(args)
    donated = len(jax.tree.leaves(args[0]))
    train = built.program.train

    def flat(*xs):
        return jax.tree.leaves(train(*jax.tree.unflatten(tree, xs)))

    shardings = tuple(x.sharding for x in leaves)
    # source locations out of the program (op names stay): the executable then depends on the step, not
    # on the file and line it was prepared from (two compiles of one step are byte-identical)
    with warnings.catch_warnings(), jax_config.traceback_in_locations_limit(0):
        # shape-only inputs: donation is decided by the child's compile
        warnings.filterwarnings("ignore", "Some donated buffers were not usable")
        # the parent and the child run one jaxlib: its custom calls without a stability guarantee are safe
        # to pass (MoE dispatch's ragged all-to-all; cuDNN's attention traced on a GPU host)
        disabled = [jax.export.DisabledSafetyCheck.custom_call(t)
                    for t in ("ragged_all_to_all",) + (CUDNN_TARGETS if on_device else ())]
        exported = jax.export.export(jax.jit(flat, in_shardings=shardings, donate_argnums=tuple(range(donated))),
                                     platforms=("cuda",), disabled_checks=disabled)(*leaves)
    if not on_device and "cudnn" in exported.mlir_module():  # traced on a GPU host: sdpa chose cuDNN's fused attention
        raise TargetCompileError("the step calls cuDNN fused attention, which XLA does not build without a GPU "
                                 "(jaxlib 0.10.2): prepare it in a process started with JAX_PLATFORMS=cpu, "
                                 "where attention is traced with xtrain's blockwise kernel")
    return {"exported": exported.serialize(), "donated": donated,
            "specs": [(s.spec, s.memory_kind) for s in shardings],
            "axes": tuple(built.mesh.axis_names), "shape": tuple(built.mesh.axis_sizes),
            "topology": target.topology, "config": target.config,
            "compiler_options": built.program.compiler_options}

