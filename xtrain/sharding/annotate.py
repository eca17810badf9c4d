"""`xtrain.shard(x, spec)`: activation sharding annotations written inside model code.

    x = xtrain.shard(x, ("data", "tensor", None))   # (B, T, D): sequence parallel

Inside an xtrain trace the annotation becomes `jax.lax.with_sharding_constraint` on the mesh
being compiled for; the explicit lowering moves the value to that layout (a pending partial sum
becomes one reduce-scatter) and XLA's partitioner takes it as a constraint. Anywhere else (plain
torch eager, a JAX function called directly) it returns `x` unchanged, so one model file
serves both the torch reference and xtrain.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator, Sequence

from xtrain.errors import PlanError
from xtrain.ir import interop, replay
from xtrain.sharding.plan import AxisEntry, axes_of

# The jax.sharding.Mesh xtrain is tracing the model for (None outside xtrain's traces).
_MESH: contextvars.ContextVar = contextvars.ContextVar("xtrain_tracing_mesh", default=None)


@contextlib.contextmanager
def tracing_for(mesh) -> Iterator[None]:
    """Makes `mesh` the target of `shard` calls made while the model is traced."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def shard(x: Any, spec: Sequence[AxisEntry]) -> Any:
    """Marks how activation `x` is split over the mesh.

    Args:
        x: a torch tensor (traced by xtrain, or plain) or a JAX array.
        spec: one entry per dimension of `x`: a mesh axis name, a tuple of axis names
            (major first), or None (that dimension whole).

    Returns:
        `x`, constrained to that sharding when xtrain is compiling; `x` itself otherwise.

    Raises:
        ValueError: (while compiling) an axis the mesh lacks, a spec of the wrong rank, or a
            dimension its axes do not divide.
    """
    replay.depends_on(_MESH.get)  # a kept trace of the model is for this mesh (or none) only
    mesh = _MESH.get()
    if mesh is None:
        return x
    spec = tuple(spec) if not isinstance(spec, str) else (spec,)
    return interop.apply(lambda v: _constrain(v, spec, mesh), x)  # a traced torch tensor: through torchax


interop.register_shard(shard)  # for front ends annotating a plan's activations (sequence parallel)


def _constrain(x, spec: tuple, mesh):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    _check(tuple(x.shape), spec, dict(mesh.shape))
    entries = [e if e is None or isinstance(e, str) else tuple(e) for e in spec]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*entries)))


def _check(shape: tuple, spec: tuple, sizes: dict) -> None:
    """The errors of a spec that cannot apply to a tensor of `shape` on this mesh."""
    where = _where()
    mesh = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if len(spec) != len(shape):
        raise PlanError(f"xtrain.shard{where}: spec {spec} has {len(spec)} entries for a tensor of "
                        f"shape {shape} ({len(shape)} dims); give one entry (axis name or None) per dim")
    used = [a for entry in spec for a in axes_of(entry)]
    for axis in used:
        if axis not in sizes:
            raise PlanError(f"xtrain.shard{where}: spec {spec} for tensor of shape {shape} names axis "
                            f"{axis!r}, which the mesh ({mesh}) does not have; use one of {list(sizes)}")
    if len(set(used)) != len(used):
        raise PlanError(f"xtrain.shard{where}: spec {spec} for tensor of shape {shape} uses a mesh axis twice")
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        axes = axes_of(entry)
        parts = math.prod(sizes[a] for a in axes)
        if size % parts:
            raise PlanError(f"xtrain.shard{where}: dim {dim} of tensor of shape {shape} (size {size}) is not "
                            f"divisible by {'x'.join(axes)}={parts} (spec {spec}, mesh {mesh}); pick axes "
                            "whose product divides it or leave the dim whole (None)")


def _where() -> str:
    """' in module <path>' from the named scopes xtrain opens per torch module, if any."""
    from jax._src import source_info_util

    stack = str(source_info_util.current_name_stack())
    modules = [p for p in stack.split("/") if p and "::" not in p]
    return f" in module {modules[-1]!r}" if modules else ""
