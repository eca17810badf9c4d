"""Presets: the usual parallel layouts as ordinary, printable, editable Plans.

Every preset reads the parameters' names and shapes (and, for `megatron`, the traced program's
dimension flow: xtrain.ir.analysis.dimflow) and the mesh's axis sizes, and writes one rule per parameter (layers with
the same choice collapse to one `blocks.*.` glob). What a preset kept whole, and why, is in
`plan.notes`. Users call them through `xtrain.plans`, which describes a torch module or a JAX
parameter tree first.
"""
from __future__ import annotations

import fnmatch
import functools
import math
from typing import Mapping

from xtrain.errors import PlanError
from xtrain.ir.analysis import dimflow
from xtrain.ir.model import Model
from xtrain.sharding import tensor_parallel
from xtrain.sharding import zero as zero_mod
from xtrain.sharding.tensor_parallel import escape as _escape
from xtrain.sharding.tensor_parallel import layer_glob
from xtrain.sharding.mesh import CONTEXT, DATA, TENSOR
from xtrain.sharding.plan import PendingPlan, Plan, Spec, axes_of

Shapes = Mapping[str, tuple[int, ...]]
# Tensors below this many elements (biases, norm scales of small models) are not worth a
# gather per use; FSDP keeps them whole.
MIN_SIZE = 1024


def require_axes(axes: tuple[str, ...], sizes: Mapping[str, int], preset: str) -> None:
    for axis in axes:
        if axis not in sizes:
            mesh = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise PlanError(f"xtrain.plans.{preset}: the mesh ({mesh}) has no axis {axis!r}; "
                            f"pass one of {list(sizes)} or add {axis!r} to the mesh")


# -- outputs: compact rules and readable notes ---------------------------------------------
def compact(specs: Mapping[str, Spec], names: list[str]) -> dict[str, Spec]:
    """Rules for the split parameters in `specs`, one glob per layer group where every layer
    made the same choice and the glob matches nothing else."""
    groups: dict[str, list[str]] = {}
    for name in specs:
        groups.setdefault(layer_glob(name), []).append(name)
    rules: dict[str, Spec] = {}
    for glob, members in groups.items():
        same = len({specs[m] for m in members}) == 1
        if same and len(members) > 1 and set(fnmatch.filter(names, glob)) == set(members):
            rules[glob] = specs[members[0]]
        else:
            rules.update({_escape(m): specs[m] for m in members})
    return rules


def listing(names: list[str], limit: int = 6) -> str:
    unique = list(dict.fromkeys(layer_glob(n) for n in names))
    return ", ".join(unique[:limit]) + (f", ... ({len(unique) - limit} more)" if len(unique) > limit else "")


def _dedup(notes: list[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(notes))


# -- data parallel and ZeRO/FSDP ------------------------------------------------------------
def ddp(axis: str | tuple[str, ...] = DATA) -> Plan:
    """Pure data parallel: every parameter replicated, the batch split over `axis`."""
    note = f"DDP: every parameter replicated, batch split over {axis!r}"
    return Plan(notes=(note,)) if axis == DATA else Plan(batch=(axis,), notes=(note,))


def fsdp(shapes: Shapes, sizes: Mapping[str, int], *, axis: str | tuple[str, ...] = DATA,
         min_size: int = MIN_SIZE, base: Plan | None = None) -> Plan:
    """ZeRO-3 / FSDP: every parameter split over `axis` on its largest divisible dimension (the
    dimension ZeRO's own rule picks: xtrain.sharding.zero.shard_dim); `base`'s splits kept."""
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    require_axes(axes, sizes, "fsdp")
    if isinstance(base, PendingPlan):  # FSDP on top of rules derived at the step's first call
        pending = base
        return PendingPlan(derive=lambda model, batch: fsdp(shapes, sizes, axis=axis, min_size=min_size,
                                                            base=pending.resolved(model, batch)))
    n = math.prod(sizes[a] for a in axes)
    base = base or Plan()
    base_specs = base.param_specs(shapes, sizes)
    specs, small, indivisible = {}, [], []
    for name, shape in shapes.items():
        spec = base_specs[name]
        if math.prod(shape) < min_size and not set(axes) & {a for e in spec for a in axes_of(e)}:
            small.append(name)
            specs[name] = spec
            continue
        specs[name] = zero_mod.with_data_split(shape, spec, sizes, axes)
        if specs[name] == tuple(spec) and not set(axes) & {a for e in spec for a in axes_of(e)}:
            indivisible.append(name)
    where = "x".join(axes)
    notes = list(base.notes) + [f"FSDP: parameters split over {where}={n} on their largest divisible dimension"]
    if small:
        notes.append(f"{len(small)} tensors under min_size={min_size} elements not split over {where}: {listing(small)}")
    notes += [f"{m} {shapes[m]}: no dimension divisible by {where}={n}; not split over {where}" for m in indivisible]
    split = {k: tuple(v) for k, v in specs.items() if v}
    return Plan(params=compact(split, list(shapes)), batch=base.batch, notes=_dedup(notes), trace=base.trace)


def zero(stage: int, shapes: Shapes | None = None, sizes: Mapping[str, int] | None = None, **fsdp_kwargs) -> Plan:
    """ZeRO by stage over the data axis. 0: `ddp()`; 1 and 2: `Plan(zero=stage)` (optimizer
    state, and for 2 gradients, split; each tensor's dimension is picked at compile time);
    3: `fsdp(shapes, sizes, ...)` when given them (explicit, printable rules), else `Plan(zero=3)`."""
    if stage == 0:
        return ddp()
    if stage in (1, 2) or (stage == 3 and (shapes is None or sizes is None)):
        return Plan(zero=stage)
    if stage == 3:
        return fsdp(shapes, sizes, **fsdp_kwargs)
    raise PlanError(f"xtrain.plans.zero({stage!r}): the ZeRO stage must be 0, 1, 2 or 3")


def hybrid(shapes: Shapes, sizes: Mapping[str, int], *, shard_axis: str = DATA,
           replicate_axes: tuple[str, ...] | None = None, min_size: int = MIN_SIZE) -> Plan:
    """HSDP: parameters split over `shard_axis` (FSDP within each group), replicated across
    `replicate_axes` (default: every other mesh axis); the batch spans all of them."""
    require_axes((shard_axis,), sizes, "hybrid")
    replicate = tuple(a for a in sizes if a != shard_axis) if replicate_axes is None else tuple(replicate_axes)
    require_axes(replicate, sizes, "hybrid")
    # mesh order; a `context` axis splits the sequence (dimension 1), not the batch
    batch_axes = tuple(a for a in sizes if (a in replicate or a == shard_axis) and a != CONTEXT)
    inner = fsdp(shapes, sizes, axis=shard_axis, min_size=min_size)
    across = " x ".join(f"{a}={sizes[a]}" for a in replicate) or "nothing"
    note = f"HSDP: split over {shard_axis}={sizes[shard_axis]}, replicated across {across}; batch over {batch_axes}"
    sequence = (CONTEXT,) if sizes.get(CONTEXT, 1) > 1 else ()
    lead = (batch_axes if len(batch_axes) > 1 else batch_axes[0]) if batch_axes else None
    return Plan(params=inner.params, batch=(lead, *sequence),
                notes=(note,) + inner.notes)


# -- Megatron tensor parallel ---------------------------------------------------------------
def megatron(flow: dimflow.Flow, shapes: Shapes, sizes: Mapping[str, int], *, axis: str = TENSOR,
             vocab_parallel: bool = True) -> Plan:
    """Megatron-LM tensor parallel from the traced program's dimension flow
    (xtrain.sharding.tensor_parallel)."""
    require_axes((axis,), sizes, "megatron")
    specs, notes = tensor_parallel.derive(flow, shapes, axis, sizes[axis], vocab_parallel=vocab_parallel)
    notes.append(f"replicated: {listing([n for n in shapes if n not in specs])}")
    return Plan(params=compact(specs, list(shapes)), notes=_dedup(notes))


def megatron_of(model: Model, batch: tuple, sizes: Mapping[str, int], *, axis: str = TENSOR,
                vocab_parallel: bool = True) -> Plan:
    """`megatron` for a model traced on `batch` (only its shapes are read; the dimension flow reads
    only the tensor degree: derived once per degree, kept for every mesh, e.g. a plan search's)."""
    require_axes((axis,), sizes, "megatron")
    shapes = {n: tuple(s.shape) for n, s in model.param_shapes().items()}
    return megatron(_flow(model, tuple(batch), sizes[axis]), shapes, sizes, axis=axis, vocab_parallel=vocab_parallel)


@functools.lru_cache(maxsize=8)
def _flow(model: Model, batch: tuple, tp: int) -> dimflow.Flow:
    return dimflow.of_model(model, batch, tp)


# -- checks ---------------------------------------------------------------------------------
def largest_replicated(specs: Mapping[str, Spec], shapes: Shapes, *, top: int = 5) -> list[tuple[str, tuple]]:
    """The `top` largest parameters kept whole on every device, largest first."""
    whole = [n for n, s in specs.items() if not any(s)]
    return [(n, tuple(shapes[n])) for n in sorted(whole, key=lambda n: -math.prod(shapes[n]))[:top]]


def replicated_fraction(specs: Mapping[str, Spec], shapes: Shapes) -> float:
    """The share of parameter elements kept whole on every device."""
    total = sum(math.prod(s) for s in shapes.values())
    whole = sum(math.prod(shapes[n]) for n, s in specs.items() if not any(s))
    return whole / max(total, 1)
