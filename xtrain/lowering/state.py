"""The training state a step reads and writes, and where each of its arrays lives on the mesh."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from xtrain.ir import stacked
from xtrain.ir.stacked import Stacking
from xtrain.ir.tree import named_leaves, rebuild
from xtrain.sharding.layout import StateLayout
from xtrain.sharding import segments
from xtrain.sharding.offload import HOST_MEMORY
from xtrain.sharding.plan import Spec, axes_of, partition_entry


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
    """Everything a training step reads and writes (all jax arrays)."""

    params: dict[str, Any]      # optimized parameters
    frozen: dict[str, Any]      # parameters the optimizer does not update
    buffers: dict[str, Any]     # module buffers (BatchNorm statistics, ...)
    opt_state: Any
    step: Any                   # int32 scalar: steps run (a step fp16 skipped counts)
    key: Any                    # base PRNG key; step k uses fold_in(key, k)
    loss_scale: Any = None      # fp16: {"scale": f32, "good_steps": i32} (xtrain.lowering.precision)
    grad_residual: Any = None   # GradSync(comm_dtype="int8"): per device, what quantization dropped
                                # of each gradient, added to the next step's (residual_specs)


def named(mesh, specs: Mapping[str, Spec], memory_kind: str | None = None) -> dict[str, NamedSharding]:
    """{name: NamedSharding} of per-tensor specs on `mesh` (in `memory_kind`: default the device's)."""
    return {n: NamedSharding(mesh, PartitionSpec(*map(partition_entry, s)), memory_kind=memory_kind) for n, s in specs.items()}


def residual_specs(layout: StateLayout) -> dict[str, Spec]:
    """Where int8 error-feedback residuals live: one per device of the data axes each optimized
    gradient is summed over, on a device dimension placed first (after the layer dimension of a
    stacked parameter), the rest split as the parameter. Each device holds its own (1, ...)."""
    out = {}
    for name in sorted(layout.optimized):
        axes = _residual_axes(layout, name)
        if not axes:
            continue
        # a ZeRO-3 shard reduced in the backward pass (zero3_int8) keeps the whole gradient's
        # residual; an HSDP shard (all-reduced over the other batch axes after it) its shard's
        zero = layout.zero_axes(name) if not layout.grad_axes(name) else ()
        spec = tuple(_without(e, zero) for e in layout.param_specs[name])
        entry = axes[0] if len(axes) == 1 else axes
        out[name] = (spec[0], entry) + spec[1:] if stacked.is_stacked(name) else (entry,) + spec
    return out


def _residual_axes(layout: StateLayout, name: str) -> tuple[str, ...]:
    """The batch axes a parameter's gradient is reduced over: summed (its grad axes) or, for a
    ZeRO-3 shard, reduce-scattered (its ZeRO axes)."""
    return layout.grad_axes(name) or layout.zero_axes(name)


def _without(entry, axes):
    kept = tuple(a for a in axes_of(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def residual_shapes(layout: StateLayout, shapes: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """Global shapes of the int8 residuals (`residual_specs`); `shapes`: stored parameters'."""
    out = {}
    for name in residual_specs(layout):
        shape = list(shapes[name].shape)
        shape.insert(1 if stacked.is_stacked(name) else 0, int(np.prod([layout.sizes[a] for a in _residual_axes(layout, name)])))
        out[name] = jax.ShapeDtypeStruct(tuple(shape), shapes[name].dtype)
    return out


def residual_zeros(layout: StateLayout, shapes: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The residuals of a fresh run: zero-stride host arrays (placing them allocates only each
    device's own part)."""
    return {n: np.broadcast_to(np.zeros((), s.dtype), s.shape) for n, s in residual_shapes(layout, shapes).items()}


def shardings(state: TrainState, layout: StateLayout, mesh) -> TrainState:
    """Shardings of a TrainState laid out by `layout`: parameters per their specs, optimizer
    moments like their parameter's optimizer spec (ZeRO-1/2 split them further; in host memory
    under Plan(offload="optimizer")), everything else replicated."""
    host = HOST_MEMORY if layout.offload_optimizer else None
    params, optimizer = named(mesh, layout.param_specs), named(mesh, layout.optimizer_specs, host)
    shapes = {n: x.shape for n, x in {**state.params, **state.frozen}.items()}
    replicated = NamedSharding(mesh, PartitionSpec())

    def opt_leaf(path, leaf):
        for entry in path:
            name = getattr(entry, "key", None)
            if name in params and getattr(leaf, "shape", None) == shapes[name]:
                return optimizer[name]
        return NamedSharding(mesh, PartitionSpec(), memory_kind=host)

    return TrainState(
        params={n: params[n] for n in state.params},
        frozen={n: params[n] for n in state.frozen},
        buffers={n: replicated for n in state.buffers},
        opt_state=jax.tree_util.tree_map_with_path(opt_leaf, state.opt_state),
        step=replicated,
        key=replicated,
        loss_scale=jax.tree.map(lambda _: replicated, state.loss_scale),
        grad_residual=None if state.grad_residual is None else named(mesh, residual_specs(layout)),
    )


def abstract(state: TrainState) -> TrainState:
    """Shapes and dtypes of `state` (jax.ShapeDtypeStruct leaves)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)


def initial(params: Mapping[str, Any], buffers: Mapping[str, Any], optimized, tx: optax.GradientTransformation,
            seed: int, loss_scale, grad_residual=None) -> TrainState:
    """A fresh state: the optimizer's initial state for the `optimized` parameters, the rest frozen."""
    trained = {n: v for n, v in params.items() if n in optimized}
    return TrainState(params=trained, frozen={n: v for n, v in params.items() if n not in optimized},
                      buffers=dict(buffers), opt_state=jax.jit(tx.init)(trained), step=np.int32(0),
                      key=jax.random.key_data(jax.random.key(seed)), loss_scale=loss_scale,
                      grad_residual=grad_residual)


def restacked(state: TrainState, stacking: Stacking, tx: optax.GradientTransformation) -> TrainState:
    """`state` (per-layer storage) with `stacking`'s families stored stacked, the optimizer
    state alike (padding rows zeros). Traceable: run it under jit to place the result."""
    stack = lambda d: stacking.stack_dict(d, stack=jax.numpy.stack, zeros=jax.numpy.zeros_like)
    params, old = stack(state.params), named_leaves(state.opt_state)

    def leaf(name: str, like):
        param = name.rsplit("/", 1)[-1]  # e.g. "0/mu/blocks.*.attn.q.weight": the parameter's name
        prefix = name[:len(name) - len(param)]
        if param not in stacking.groups:
            return old[name]
        members = stacking.groups[param]
        return jax.numpy.stack([old[prefix + members[r]] if r is not None else jax.numpy.zeros(like.shape[1:], like.dtype)
                                for r in stacking.rows_of(param)])

    template = jax.eval_shape(tx.init, params)
    opt_state = rebuild(template, {n: leaf(n, like) for n, like in named_leaves(template).items()})
    return dataclasses.replace(state, params=params, frozen=stack(state.frozen), opt_state=opt_state)


def reordered(state: TrainState, layout: StateLayout, *, to_torch: bool) -> TrainState:
    """`state` with each parameter split per segment (xtrain.Segments), and its optimizer state,
    moved from torch's order to the stored, segment-interleaved order (or back: `to_torch`)."""
    specs = {n: s for n, s in layout.param_specs.items() if segments.segmented_dims(s)}
    move = lambda x, name: (segments.to_torch if to_torch else segments.to_stored)(x, specs[name], layout.sizes)
    shapes = {n: np.shape(x) for n, x in {**state.params, **state.frozen}.items()}

    def opt_leaf(path, leaf):
        name = next((e.key for e in path if getattr(e, "key", None) in specs), None)
        return move(leaf, name) if name is not None and np.shape(leaf) == shapes[name] else leaf

    return dataclasses.replace(state, params={n: move(v, n) if n in specs else v for n, v in state.params.items()},
                               frozen={n: move(v, n) if n in specs else v for n, v in state.frozen.items()},
                               opt_state=jax.tree_util.tree_map_with_path(opt_leaf, state.opt_state))


def in_order(state: TrainState, layout: StateLayout, shardings: TrainState, *, to_torch: bool) -> TrainState:
    """`reordered` on the mesh (placed as `shardings`); `state` itself when nothing is split per segment."""
    if not any(segments.segmented_dims(s) for s in layout.param_specs.values()):
        return state
    # offloaded optimizer state is reordered in device memory (a gather reads one memory space)
    device = jax.tree.map(lambda s: s.with_memory_kind("device") if s.memory_kind == HOST_MEMORY else s, shardings)
    moved = jax.jit(lambda s: reordered(s, layout, to_torch=to_torch), out_shardings=device)(
        jax.device_put(state, device))
    return jax.device_put(moved, shardings)
