"""Expert parallelism as a plan: on a mesh with an `expert` axis, the batch is split over data x
expert (for every layer but the experts, `expert` is one more data axis) and each MoE layer's
expert weights, stored (experts, ...), are split over `expert` on dim 0; the lowering then moves
tokens to their experts with all-to-all (xtrain.lowering.explicit.rules.experts). Gradients of
the expert weights are summed over the data axes only (a device holds its experts' whole
gradient over `expert`), the rest over data x expert: the layout's grad_axes."""
from __future__ import annotations

import dataclasses
import fnmatch
from typing import Iterable, Mapping

from xtrain.errors import PlanError
from xtrain.sharding.mesh import DATA, EXPERT
from xtrain.sharding.plan import Plan


def expert_parallel(plan: Plan, experts: Iterable[str], sizes: Mapping[str, int],
                    shapes: Mapping[str, tuple[int, ...]], model: str) -> Plan:
    """`plan` with the expert weights split over `expert` (dim 0) and the batch over data x expert,
    when the mesh has an `expert` axis; else `plan` itself. A plan rule for expert weights that
    splits another dim (FSDP over `data`) keeps it; one that splits dim 0 itself wins."""
    if sizes.get(EXPERT, 1) == 1:
        return plan
    experts = sorted(experts)
    if not experts:
        raise PlanError(
            f"mesh axis {EXPERT!r} (size {sizes[EXPERT]}) splits the experts of MoE layers, but {model} has none "
            "that xtrain can split (HF experts modules with experts_implementation='grouped_mm'): use a mesh "
            f"without it (fold its devices into {DATA!r})")
    peers = sizes[EXPERT]
    for name in experts:
        if shapes[name][0] % peers:
            raise PlanError(
                f"expert weight {name!r} of shape {tuple(shapes[name])} holds {shapes[name][0]} experts, not "
                f"divisible by the mesh axis {EXPERT!r} of size {peers}: use an {EXPERT!r} axis whose size "
                f"divides {shapes[name][0]}")
    params = {p: _with_expert_dim(p, spec, experts, shapes) for p, spec in plan.params.items()}
    mine = [n for n in experts if not any(fnmatch.fnmatchcase(n, p) for p in plan.params)]
    params.update({n: (EXPERT,) + (None,) * (len(shapes[n]) - 1) for n in mine})
    batch = plan.batch
    if batch is None:
        axes = tuple(a for a in sizes if a in (DATA, EXPERT))
        batch = (axes if len(axes) > 1 else axes[0],)
    return dataclasses.replace(plan, params=params, batch=batch)


def _with_expert_dim(pattern: str, spec, experts: list[str], shapes: Mapping[str, tuple[int, ...]]):
    """A plan rule that matches only expert weights and leaves their experts dim whole (FSDP's
    split of another dim over `data`) gets the experts dim split over `expert` too."""
    matched = [n for n in shapes if fnmatch.fnmatchcase(n, pattern)]
    if not matched or not set(matched) <= set(experts) or not spec or spec[0] is not None:
        return spec
    return (EXPERT,) + tuple(spec[1:])
