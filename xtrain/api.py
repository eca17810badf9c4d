"""`xtrain.compile`: the one entry point from a model to a distributed training step."""
from __future__ import annotations

from typing import Any, Callable

from xtrain import runtime
from xtrain.errors import OptionsError, UnsupportedError
from xtrain.frontend import jax_function, torch_module
from xtrain.lowering.gradient_sync import GradSync
from xtrain.lowering.lower import LOWERINGS
from xtrain.lowering.options import StepOptions
from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import Plan
from xtrain.step import AUTO, CompileOptions, TrainStep


def compile(model: Any, mesh: Mesh | None = None, *, optimizer: Any = None, plan: Plan | str | None = None,
            loss_fn: Callable | None = None, params: Any = None, seed: int = 0,
            lowering: str = "explicit", grad_sync: GradSync | None = None, scan_layers: bool | str = "auto",
            zero3_regather: bool | None = None, init_from: str | None = None,
            clip_grad_norm: float | None = None, accumulate: int = 1, detect_nan: bool | None = None,
            check_inputs: bool = True, allow_recompile: bool = False):
    """Compiles a model into a distributed training step.

    Args:
        model: a torch.nn.Module whose forward returns the loss (or see `loss_fn`), or a JAX
            function `loss(params, *batch) -> scalar`.
        mesh: the device mesh; default `Mesh(data=-1)` (pure data parallel over all devices).
        optimizer: a torch.optim optimizer over `model.parameters()` (SGD, Adam, AdamW), or an
            optax transformation for JAX functions.
        plan: how tensors are split over the mesh; default: parameters replicated, batch
            split over `data`. "auto": the cost model's pick (xtrain.cost.search) for the
            current devices, chosen at the first step call (it needs the batch shapes; until
            then `step.mesh` is unknown, `step.load` is applied at that call and
            `step.state_dict()` is the initial state); the mesh then comes from the pick, so
            `mesh` may only fix the device count. `step.search` keeps the search. A pending
            `xtrain.plans.megatron(model, mesh)` plan (no `example=`) is derived from the
            program traced on the first batch, at the first step call, likewise.
        loss_fn: `loss_fn(model, *batch) -> scalar tensor` for torch models whose forward does
            not return the loss.
        params: initial parameters (pytree) of a JAX function.
        seed: seed of the per-step random streams (dropout).
        lowering: "explicit" (xtrain's partitioner: every collective chosen and counted by
            xtrain) or "xla" (XLA's SPMD partitioner on the same plan, for comparison).
        grad_sync: `xtrain.GradSync(bucket_bytes=..., comm_dtype=...)` for the explicit lowering;
            comm_dtype="int8" quantizes gradients with error feedback (xtrain.lowering.int8_sync).
        zero3_regather: ZeRO-3 gathers each weight again in the backward pass instead of keeping
            it from the forward pass (default: on, on every backend; False keeps the weights
            gathered in the forward pass alive until the backward pass uses them).
        init_from: initial parameters from a safetensors file (or an HF `*.index.json` / a
            directory of them), under the module's own names, read shard by shard: each process
            reads only the regions its devices hold, so the model may be built on the meta
            device (`with torch.device("meta"): model = ...`) and never exist whole in memory.
        scan_layers: the explicit lowering emits identical consecutive blocks (blocks.0,
            blocks.1, ...) from the first block's equations, gathers each layer's ZeRO-3 shards
            with one all-gather and checkpoints (remat) each layer. True: as one lax.scan over
            parameters stored stacked, (L, ...) per block position; compile time stays flat in
            depth. False: one layer after another, parameters stored per layer; compile time
            grows with depth, and the program has no stacked residuals to write and read back,
            and each gradient bucket's all-reduce can start once its own layers' gradients
            exist. "auto" (default): unrolled up to 3 layers, scanned beyond, and scanned on a
            host emulating several CPU devices in one process (measured reasons and figures:
            `xtrain.sharding.layout.scan_layers_for`). `step.scan_layers` says which was used.
        clip_grad_norm: see `xtrain.lowering.options.StepOptions`, as for the four below.
        accumulate: micro-batches per optimizer step.
        detect_nan: skip a step whose loss or gradient norm is not finite, naming the module.
        check_inputs: hold the batch's integer indices to torch's rules inside the step.
        allow_recompile: admit batches of new shapes (True, or at most N shapes). The torch optimizer's lr (per param group) is read
            before every step, so a torch LR scheduler stepped by the caller takes effect
            without recompiling. Precision and activation checkpointing are the plan's
            (`Plan(precision="bf16", remat="full")`).

    Returns:
        A TrainStep: `step(*batch)` trains on one global batch and returns {"loss": float, ...}.
    """
    if lowering not in LOWERINGS:
        raise OptionsError(f"lowering={lowering!r} is not one of {LOWERINGS}")
    if not isinstance(scan_layers, bool) and scan_layers != "auto":
        raise OptionsError(f"scan_layers={scan_layers!r}: use True (one scan over the repeated blocks), False "
                         "(the blocks one after another) or 'auto' (unrolled up to 3 layers)")
    if isinstance(plan, str) and plan != AUTO:
        raise OptionsError(f"plan={plan!r}: pass an xtrain.Plan, a preset (xtrain.plans.*) or plan='auto'")
    if plan == AUTO and lowering != "explicit":
        raise UnsupportedError("plan='auto' searches plans of the explicit lowering; use lowering='explicit'")
    if plan == AUTO and grad_sync is not None and grad_sync.int8:
        raise UnsupportedError("plan='auto' searches plans with the default gradient sync, not GradSync(comm_dtype='int8') "
                         "(which excludes ZeRO-3 and pipelines); pass a plan, e.g. xtrain.plans.ddp()")
    options = CompileOptions(seed=seed, lowering=lowering, grad_sync=grad_sync, scan_layers=scan_layers,
                             zero3_regather=zero3_regather, init_from=init_from,
                             step=StepOptions(clip_grad_norm=clip_grad_norm, accumulate=accumulate,
                                              detect_nan=detect_nan, check_inputs=check_inputs,
                                              allow_recompile=allow_recompile))
    runtime.init()
    trainable = trainable_of(model, optimizer, loss_fn, params, what="xtrain.compile")
    return TrainStep(trainable, Mesh(data=-1) if mesh is None else mesh, plan or Plan(), options)


def trainable_of(model, optimizer, loss_fn=None, params=None, *, what: str):
    """The model and its optimizer as the compiler takes them: a torch.nn.Module (through torchax)
    or a JAX loss function of `params`."""
    if torch_module.is_module(model):
        return torch_module.wrap(model, optimizer, loss_fn)
    if callable(model):
        return jax_function.wrap(model, params, optimizer)
    raise TypeError(f"{what} expects a torch.nn.Module or a JAX function, got {type(model).__name__}")

