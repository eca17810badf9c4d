"""`xtrain.compile`: the one entry point from a model to a distributed training step."""
from __future__ import annotations

import math
from typing import Any, Callable

import optax

from xtrain.sharding.mesh import Mesh
from xtrain.sharding.plan import Plan

LOWERINGS = ("explicit", "xla")


def _torch_model(model, optimizer, loss_fn):
    from xtrain import optim
    from xtrain.frontend.torch_module import TorchModel

    wrapped = TorchModel(model, loss_fn=loss_fn)
    if optimizer is None:
        raise ValueError("xtrain.compile of a torch module needs optimizer=torch.optim.<...>(model.parameters(), ...)")
    tx, groups = optim.from_torch(optimizer, wrapped.name_of, wrapped.trainable())
    return wrapped, tx, set(groups), optim.LearningRates(optimizer, groups)


def _jax_model(fn, params, optimizer):
    from xtrain.frontend.jax_function import JaxModel

    if params is None:
        raise ValueError("xtrain.compile of a JAX function needs params=<pytree of initial parameters>")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError("xtrain.compile of a JAX function needs optimizer=<optax.GradientTransformation>")
    wrapped = JaxModel(fn, params)
    return wrapped, optimizer, set(wrapped.param_names), None


def compile(model: Any, mesh: Mesh | None = None, *, optimizer: Any = None, plan: Plan | str | None = None,
            loss_fn: Callable | None = None, params: Any = None, seed: int = 0,
            lowering: str = "explicit", grad_sync=None, scan_layers: bool | str = "auto",
            zero3_regather: bool | None = None, init_from: str | None = None,
            clip_grad_norm: float | None = None, accumulate: int = 1, detect_nan: bool = False,
            allow_recompile: bool = False):
    """Compiles a model into a distributed training step.

    Args:
        model: a torch.nn.Module whose forward returns the loss (or see `loss_fn`), or a JAX
            function `loss(params, *batch) -> scalar`.
        mesh: the device mesh; default `Mesh(data=-1)` (pure data parallel over all devices).
        optimizer: a torch.optim optimizer over `model.parameters()` (SGD, Adam, AdamW), or an
            optax transformation for JAX functions.
        plan: how tensors are split over the mesh; default: parameters replicated, batch
            split over `data`. "auto": the cost model's pick (xtrain.cost.search) for the
            current devices, chosen at the first step call (it needs the batch shapes); the
            mesh then comes from the pick, so `mesh` may only fix the device count.
        loss_fn: `loss_fn(model, *batch) -> scalar tensor` for torch models whose forward does
            not return the loss.
        params: initial parameters (pytree) of a JAX function.
        seed: seed of the per-step random streams (dropout).
        lowering: "explicit" (xtrain's partitioner: every collective chosen and counted by
            xtrain) or "xla" (XLA's SPMD partitioner on the same plan, for comparison).
        grad_sync: `xtrain.GradSync(bucket_bytes=..., comm_dtype=...)` for the explicit lowering.
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
            exist. "auto" (default): unrolled up to 8 layers, scanned beyond, and scanned on a
            host emulating several CPU devices in one process (measured reasons and figures:
            `xtrain.frontend.stacked.scan_layers_for`). `step.scan_layers` says which was used.
        clip_grad_norm, accumulate, detect_nan, allow_recompile: see
            `xtrain.step_options.StepOptions`. The torch optimizer's lr (per param group) is read
            before every step, so a torch LR scheduler stepped by the caller takes effect
            without recompiling. Precision and activation checkpointing are the plan's
            (`Plan(precision="bf16", remat="full")`).

    Returns:
        A TrainStep: `step(*batch)` trains on one global batch and returns {"loss": float, ...}.
    """
    import torch

    from xtrain.step_options import StepOptions

    from xtrain import runtime
    from xtrain.step import TrainStep

    if lowering not in LOWERINGS:
        raise ValueError(f"lowering={lowering!r} is not one of {LOWERINGS}")
    if not isinstance(scan_layers, bool) and scan_layers != "auto":
        raise ValueError(f"scan_layers={scan_layers!r}: use True (one scan over the repeated blocks), False "
                         "(the blocks one after another) or 'auto' (unrolled up to 8 layers)")
    options = StepOptions(clip_grad_norm=clip_grad_norm, accumulate=accumulate, detect_nan=detect_nan,
                          allow_recompile=allow_recompile)
    runtime.init()
    mesh = Mesh(data=-1) if mesh is None else mesh
    if isinstance(model, torch.nn.Module):
        wrapped, tx, optimized, learning_rates = _torch_model(model, optimizer, loss_fn)
    elif callable(model):
        wrapped, tx, optimized, learning_rates = _jax_model(model, params, optimizer)
    else:
        raise TypeError(f"xtrain.compile expects a torch.nn.Module or a JAX function, got {type(model).__name__}")
    def build(built_mesh, chosen: Plan) -> TrainStep:
        return TrainStep(wrapped, built_mesh, chosen, tx, optimized, seed=seed, lowering=lowering,
                         grad_sync=grad_sync, scan_layers=scan_layers, zero3_regather=zero3_regather,
                         init_from=init_from, options=options, learning_rates=learning_rates)

    special = _special_plan(plan, lowering, wrapped, tx, model, mesh, build, pipelines=accumulate == 1)
    return special if special is not None else build(mesh.build(), plan or Plan())


def _special_plan(plan, lowering: str, wrapped, tx, module, mesh: Mesh, build, pipelines: bool = True):
    """The step for `xtrain plan` (a probe that prints the search) and for plan="auto"; None
    for an ordinary Plan. `pipelines`: plan="auto" may pick a pipeline (the pipeline step
    refuses accumulate > 1: its microbatches accumulate already)."""
    import os

    from xtrain.cost import auto

    module = module if hasattr(module, "named_modules") else None
    if os.environ.get(auto.PLAN_TARGET):
        return auto.PlanProbe(wrapped, tx, module, os.environ[auto.PLAN_TARGET])
    if isinstance(plan, str) and plan != "auto":
        raise ValueError(f"plan={plan!r}: pass an xtrain.Plan, a preset (xtrain.plans.*) or plan='auto'")
    if plan != "auto":
        return None
    if lowering != "explicit":
        raise ValueError("plan='auto' searches plans of the explicit lowering; use lowering='explicit'")
    from xtrain.runtime import job_devices

    devices = len(job_devices())
    if math.prod(mesh.resolve(devices).values()) != devices:
        raise ValueError(f"plan='auto': {mesh} does not cover the {devices} devices")
    return auto.AutoStep(wrapped, tx, module, devices, lambda sizes, chosen: build(Mesh(**sizes).build(), chosen),
                         pipelines=pipelines)
