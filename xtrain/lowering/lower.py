"""The lowering's entry: a model, its state layout and a mesh -> the compiled training step,
by the strategy the plan calls for."""
from __future__ import annotations

import jax

from xtrain.errors import OptionsError, UnsupportedError
from xtrain.ir.model import Model
from xtrain.lowering import gpu_options, gradient_sync, offload, train_step
from xtrain.lowering.explicit.forward import ExplicitStrategy
from xtrain.lowering.pipeline.program import check_mesh
from xtrain.lowering.pipeline import strategy as pipeline_strategy
from xtrain.lowering.pipeline.strategy import PipelineStrategy
from xtrain.lowering.state import TrainState
from xtrain.lowering.train_step import StepConfig, StepProgram
from xtrain.lowering.xla_partitioner import XlaStrategy
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.pipeline import Pipeline

LOWERINGS = ("explicit", "xla")


def lower(model: Model, mesh, layout: StateLayout, shardings: TrainState, config: StepConfig, *,
          lowering: str = "explicit", pipeline: Pipeline | None = None) -> StepProgram:
    """The jit-compiled step: the explicit lowering (its pipeline strategy when the plan has a
    pipeline) or XLA's partitioner on the same layout."""
    check(mesh, layout, config, lowering=lowering, pipeline=pipeline)
    specs = jax.tree.map(lambda s: s.spec, shardings)
    if pipeline is not None:
        strategy = PipelineStrategy(model, mesh, layout, specs, config, pipeline)
    elif lowering == "explicit":
        strategy = ExplicitStrategy(model, mesh, layout, specs, config)
    else:
        strategy = XlaStrategy(model, mesh, layout, config)
    options = gpu_options.compiler_options(config.sync, layout, regather=config.regather) \
        if config.platform == "cuda" else None
    return train_step.build(strategy, shardings, mesh, config, model, options)


def check(mesh, layout: StateLayout, config: StepConfig, *, lowering: str = "explicit",
          pipeline: Pipeline | None = None) -> None:
    """What `lower` refuses before it builds anything: an unknown lowering, int8 sync where it
    cannot run, a pipeline under XLA's partitioner, offload where the host has no memory space."""
    if lowering not in LOWERINGS:
        raise OptionsError(f"lowering={lowering!r} is not one of {LOWERINGS}")
    gradient_sync.check_int8(config.sync, pipeline=pipeline is not None,
                             loss_scale=config.grad_tx.loss_scale is not None, lowering=lowering)
    if isinstance(mesh, jax.sharding.Mesh):  # an AbstractMesh has no devices to ask
        if layout.offload_optimizer:
            offload.check_host_memory(mesh.devices.flat[0])
        if config.remat is not None and config.remat.offload:
            offload.check_host_memory(mesh.devices.flat[0], "activations")
    if pipeline is not None:
        if lowering != "explicit":
            raise UnsupportedError(f"pipeline parallelism needs lowering='explicit' (got {lowering!r})")
        check_mesh(pipeline, dict(mesh.shape))
        pipeline_strategy.check(config, layout)
