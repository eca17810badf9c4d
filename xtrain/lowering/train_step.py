"""The one training-step skeleton. Every lowering's step is

    loss, gradients   the strategy's: the explicit forward and its autodiff (explicit/forward.py),
                      the pipeline's schedule (pipeline/strategy.py), or XLA's partitioner on the
                      global view (xla_partitioner.py)
    input checks      the batch's indices against their dimensions (input_checks.py): a batch
                      that breaks one turns the gradients to NaN, so the step is skipped
    gradient sync     what the strategy left to sum (it may have summed some inside the backward
                      pass, as ZeRO-3's gathers do by their transpose): a bucketed all-reduce
    update            the optax transformation on each device's shards, ZeRO-sharded as the
                      layout says (zero.Update); clipping, lr per param group, fp16's unscale
    outputs           loss and gradient norm; per-step counts (tokens per expert of each MoE
                      layer); the step counter; fp16 / detect_nan skip a non-finite step
                      (grad_transforms.finish_step)

jit-compiled with the state donated and its shardings fixed. A strategy says how loss and
gradients are computed and whether the step runs per device (shard_map) or in the global view.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from xtrain.lowering import collectives, gradient_sync, input_checks, offload, precision, router_bias
from xtrain.lowering import neuron_lowering, ordering  # noqa: F401  (neuron_lowering: its lowering rule)
from xtrain.lowering.findings import Findings
from xtrain.lowering.grad_transforms import GradTransforms, finish_step
from xtrain.lowering.gradient_sync import GradSync
from xtrain.lowering.options import StepOptions
from xtrain.lowering.state import TrainState
from xtrain.lowering.zero import Update
from xtrain.sharding.context_parallel import ContextParallel
from xtrain.sharding.fallback import FallbackPolicy
from xtrain.sharding.plan import Spec
from xtrain.sharding.remat import LayerRemat

TRACE_EVENT = "/xtrain/lowering/train_step_trace"  # jax.monitoring: the training step's Python body traced
PLACEMENT_EVENT = "/xtrain/lowering/stage_placement_trace"  # a pipeline's stages balanced on the traced model


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
    """What every lowering's step takes besides the model, the layout and the mesh.

    Attributes:
        tx: the optax transformation (lr 1 for torch optimizers: the lr enters per step).
        options: accumulation and the other step options.
        grad_tx: unscale / clip / lr / skip between the gradients and the update (default: what
            `options` call for, without lr groups or loss scaling: GradTransforms.of).
        sync: bucketing, wire dtype and hierarchy of the gradient all-reduce.
        remat: activation checkpointing of each layer of the repeated blocks (None: off).
        regather: ZeRO-3 gathers each weight again in the backward pass.
        offload_optimizer: the optimizer state arrives in host memory and goes back there
            (xtrain.lowering.offload).
        capacity_factor: MoE layers' expert capacity (Plan.capacity_factor); None: drop-free.
        router_bias_rate: auxiliary-loss-free balancing of MoE layers (Plan.router_bias_rate;
            xtrain.lowering.router_bias); None: off.
        context: attention over a sequence split along `context`: ring, Ulysses or both (Plan.context).
        fallback: where an op without a partition rule may run replicated (Plan.fallback_policy()).
        platform: what the step is built for ("cpu", "cuda", "neuron"; assembly.Target).
    """

    tx: optax.GradientTransformation
    options: StepOptions = StepOptions()
    grad_tx: GradTransforms | None = None
    sync: GradSync = GradSync()
    remat: LayerRemat | None = None
    regather: bool = True
    offload_optimizer: bool = False
    capacity_factor: float | None = None
    router_bias_rate: float | None = None
    context: ContextParallel = ContextParallel()
    fallback: FallbackPolicy = FallbackPolicy()
    platform: str = "cpu"

    def __post_init__(self):
        if self.grad_tx is None:  # a skip the options need (input checks) is never left out
            object.__setattr__(self, "grad_tx", GradTransforms.of(self.options))


@dataclasses.dataclass(frozen=True)
class Gradients:
    """A strategy's loss and gradients on one device (or in the global view)."""

    loss: Any
    buffers: Mapping[str, Any]          # buffers the forward updated (BatchNorm statistics)
    grads: Mapping[str, Any]
    pending: Mapping[str, tuple[str, ...]]  # per gradient, the mesh axes still to sum it over
    counts: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # per-step counts for the outputs
    shards: frozenset = frozenset()  # ZeRO-2 gradients already reduce-scattered (in the backward pass)
    findings: Findings = Findings()  # what the lowering found tracing this program (fallbacks, notes, blocks)
    # ZeRO-3 with int8 gradients: the next residual of each parameter, made in the backward pass
    dropped: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Strategy(Protocol):
    """How one lowering computes the loss and the gradients."""

    runner: "PerDevice | GlobalView"
    update: Update

    def gradients(self, state: TrainState, batch: tuple) -> Callable[..., Gradients]:
        """Traces the model at `batch`'s global shapes; returns (state, batch, key, loss scale) -> Gradients."""

    def loss(self, state: TrainState, batch: tuple) -> Callable:
        """Traces the eval forward; returns (state, batch, key) -> loss."""

    def notes(self, findings: Findings) -> list[str]:
        """What the report says about this lowering's program, whose trace found `findings`."""


def batch_specs(batch_spec: Spec, batch: tuple, batch_args=()) -> tuple:
    """Each batch argument's PartitionSpec: `batch_spec`, or its own from `batch_args` pairs."""
    own = dict(batch_args)
    return tuple(PartitionSpec(*own.get(i, batch_spec)[: x.ndim]) if hasattr(x, "ndim") else None
                 for i, x in enumerate(batch))


@dataclasses.dataclass(frozen=True)
class PerDevice:
    """Runs a step function on every device of `mesh` (shard_map), with the collectives in one
    order on XLA's CPU runtime (xtrain/lowering/ordering.py)."""

    mesh: Any
    state_specs: TrainState
    batch_spec: Spec
    batch_args: tuple = ()  # (argument position, spec) pairs replacing batch_spec

    @property
    def split_dims(self) -> frozenset[int]:
        """Batch dimensions split across devices (a step function sees a shard of them)."""
        return frozenset(d for d, entry in enumerate(self.batch_spec) if entry)

    def train(self, fn: Callable, batch: tuple) -> Callable:
        return jax.shard_map(ordering.in_order(fn), mesh=self.mesh,
                             in_specs=(self.state_specs, batch_specs(self.batch_spec, batch, self.batch_args), PartitionSpec()),
                             out_specs=(self.state_specs, PartitionSpec()), check_vma=True)

    def eval(self, fn: Callable, batch: tuple) -> Callable:
        return jax.shard_map(ordering.in_order(fn), mesh=self.mesh,
                             in_specs=(self.state_specs, batch_specs(self.batch_spec, batch, self.batch_args)),
                             out_specs=PartitionSpec(), check_vma=True)


class GlobalView:
    """Runs a step function on global arrays (XLA's partitioner splits it)."""

    split_dims = frozenset()

    def train(self, fn: Callable, batch: tuple) -> Callable:
        return fn

    def eval(self, fn: Callable, batch: tuple) -> Callable:
        return fn


class Traced:
    """What the training step's last trace found; jit traces it when first called (once per
    batch signature), and the trace sets `findings` (the strategy returns them with its gradients)."""

    def __init__(self):
        self.findings = Findings()


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """A compiled step: `train(state, batch, lrs) -> (state, outputs)`, `eval(state, batch) -> loss`;
    `inputs`: the input checks of the batch shape it last traced (the host names a violation);
    `findings`: what the lowering found when it last traced `train`."""

    train: Callable
    eval: Callable
    strategy: Strategy
    inputs: input_checks.Found = dataclasses.field(default_factory=input_checks.Found)
    traced: Traced = dataclasses.field(default_factory=Traced, repr=False)
    compiler_options: Mapping[str, Any] | None = None  # XLA's, per compile (CUDA: xtrain.lowering.gpu_options)

    @property
    def findings(self) -> Findings:
        return self.traced.findings

    def notes(self) -> list[str]:
        return self.strategy.notes(self.findings) + self.inputs.notes()


def _checks(model, config: StepConfig, runner, state: TrainState, batch: tuple, found: input_checks.Found) -> list:
    """The input checks this step runs (none when switched off); recorded in `found`."""
    if not config.options.check_inputs:
        return []
    _, buffers = precision.split_histories(state.buffers, precision.histories_of(model))  # the model's own only
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (buffers, state.key, batch))
    traced = input_checks.for_model(model, *shapes)
    found.checks[:] = [c for c in traced.checks if input_checks.checkable(c, runner.split_dims)]
    found.unchecked[:] = traced.unchecked + [f"{c.op} in module {c.module or '<top level>'!r} reads a part of batch "
                                             f"argument {c.arg} the batch split cuts: not checked"
                                             for c in traced.checks if c not in found.checks]
    return list(found.checks)


def _poisoned(grads, bad) -> dict:
    """NaN gradients when `bad`: the gradient sync spreads them to every device, whose norm
    then skips the step (finish_step). Exact otherwise (times 1). A gradient already summed
    (invariant over axes `bad` varies over: the layer scan's in-backward sync) takes the flag
    of any device first."""
    flags: dict[frozenset, Any] = {}

    def flag(g):
        missing = frozenset(collectives.vma(bad) - collectives.vma(g))
        if missing and missing not in flags:
            with jax.named_scope("xtrain.input_checks.any_device"):
                flags[missing] = collectives.all_reduce(bad.astype(jnp.int32), tuple(sorted(missing))) > 0
        return flags[missing] if missing else bad

    return {n: g * jnp.where(flag(g), jnp.nan, 1.0).astype(g.dtype) for n, g in grads.items()}


def _trainer(strategy: Strategy, config: StepConfig, model, found: input_checks.Found, traced: Traced) -> Callable:
    def train_step(state: TrainState, batch: tuple, lrs):
        jax.monitoring.record_event(TRACE_EVENT, model=getattr(model, "name", ""))
        compute = strategy.gradients(state, batch)  # traced at global shapes, outside shard_map
        checks = _checks(model, config, strategy.runner, state, batch, found)

        def step(state: TrainState, batch: tuple, lrs):
            key = jax.random.fold_in(state.key, state.step)
            scale = state.loss_scale["scale"] if state.loss_scale is not None else None
            out = compute(state, batch, key, scale)
            traced.findings = out.findings
            grads = _poisoned(out.grads, input_checks.violated(checks, batch)) if checks else out.grads
            # int8's error feedback (ZeRO-3's is added in the backward pass: out.dropped)
            grads = gradient_sync.with_feedback(grads, {n: r for n, r in (state.grad_residual or {}).items()
                                                        if n not in out.dropped})
            grads, dropped = gradient_sync.sync(grads, out.pending, config.sync)
            old = _fetched(state, config)  # an offloaded optimizer state reaches the device only now
            params, opt_state, norm, scattered = strategy.update(grads, old.opt_state, state.params, lrs, scale,
                                                                 out.shards)
            buffers = {**state.buffers, **out.buffers}
            if config.router_bias_rate is not None:  # each MoE layer's selection bias, towards balance
                buffers = router_bias.updated(buffers, out.counts.get("expert_tokens", {}), config.router_bias_rate)
            new = dataclasses.replace(state, params=params, buffers=buffers,
                                      opt_state=opt_state, grad_residual=_stored(state.grad_residual,
                                                                                 {**dropped, **scattered, **out.dropped}))
            new, outputs = finish_step(old, new, out.loss, norm, config.grad_tx)
            outputs = {**outputs, **out.counts}  # tokens per expert of each MoE layer
            if config.offload_optimizer:
                new = dataclasses.replace(new, opt_state=offload.store(new.opt_state))
            return new, outputs

        return strategy.runner.train(step, batch)(state, batch, lrs)

    return train_step


def _fetched(state: TrainState, config: StepConfig) -> TrainState:
    """`state` with an offloaded optimizer state moved to the device, placed after the backward
    pass in the program so that it is not held through it."""
    if not config.offload_optimizer:
        return state
    return dataclasses.replace(state, opt_state=offload.fetch(state.opt_state))


def _stored(residual, dropped: Mapping[str, Any]):
    """The next int8 residuals in their stored form (a device dimension of 1 beside the
    gradient's shape); None without int8."""
    if residual is None:
        return None
    assert set(dropped) == set(residual), (sorted(dropped), sorted(residual))
    return {n: dropped[n].reshape(r.shape).astype(r.dtype) for n, r in residual.items()}


def _evaluator(strategy: Strategy) -> Callable:
    def eval_step(state: TrainState, batch: tuple):
        compute = strategy.loss(state, batch)

        def step(state: TrainState, batch: tuple):
            return compute(state, batch, jax.random.fold_in(state.key, state.step))

        return strategy.runner.eval(step, batch)(state, batch)

    return eval_step


def build(strategy: Strategy, shardings: TrainState, mesh, config: StepConfig, model,
          compiler_options: Mapping[str, Any] | None = None) -> StepProgram:
    """The jit-compiled step of `strategy` for `model`, its state laid out by `shardings` (donated).
    `compiler_options`: XLA's for this step (over the process's XLA flags), compiled with on GPUs
    present; else kept for a compile elsewhere (xtrain.aot passes them to its child, whose jit
    holds this one: JAX takes them on the outermost jit only)."""
    gradient_sync.check_axes(config.sync, dict(mesh.shape))
    replicated, found, traced = NamedSharding(mesh, PartitionSpec()), input_checks.Found(), Traced()
    here = isinstance(mesh, jax.sharding.Mesh) and mesh.devices.flat[0].platform == "gpu"
    train = jax.jit(_trainer(strategy, config, model, found, traced), out_shardings=(shardings, replicated),
                    donate_argnums=0, compiler_options=compiler_options if here else None)
    return StepProgram(train, jax.jit(_evaluator(strategy), out_shardings=replicated), strategy, found, traced,
                       compiler_options)
