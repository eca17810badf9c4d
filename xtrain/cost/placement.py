"""Where a candidate plan's mesh axes lie on a target's devices, and whether the target's
compiler accepts the program there.

Device ids are numbered row-major over the mesh axes in order, so the order decides which
collectives run between neighbouring cores. On Trainium the Neuron conformance checker
(neuron_support.conformance) rules on replica groups and permutes; the per-device program is
the same in every order, so one program lowered for Neuron is checked in each order by
renumbering its devices, without lowering it again.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np

from neuron_support import conformance, topology
from xtrain.cost.hardware import HardwareProfile


def platform_of(profile: HardwareProfile) -> str:
    """The platform a step for `profile`'s devices is built for: "cuda", "neuron" or "cpu"."""
    kind = topology.INSTANCES.get(profile.name.split("[")[0])
    return kind.backend.value if kind else "cpu"


def neuron_target(profile: HardwareProfile) -> conformance.Target | None:
    """The Neuron conformance target of a Trainium profile (None for GPUs and CPUs)."""
    kind = topology.INSTANCES.get(profile.name.split("[")[0])
    return conformance.Target.for_instance(kind.name) if kind and kind.backend is topology.Backend.NEURON else None


def _errors(hlo: str, target: conformance.Target, device_ids: list[int] | None = None) -> list[conformance.Finding]:
    found = conformance.check(hlo, target, device_ids=device_ids)
    return [f for f in found if f.severity is conformance.Severity.ERROR]


def _device_ids(lowered: dict[str, int], placed: dict[str, int]) -> list[int]:
    """Where each device of a program lowered over mesh `lowered` sits when the same axes are
    laid out in the order of `placed` (ids row-major over the axes in order)."""
    coords = dict(zip(lowered, np.unravel_index(np.arange(math.prod(lowered.values())), tuple(lowered.values()))))
    return np.ravel_multi_index([coords[a] for a in placed], tuple(placed.values())).tolist()


def conforming_orders(candidate, hlo: str, target: conformance.Target) -> tuple[list, list]:
    """A search candidate (cost.candidates.Candidate) in every mesh-axis order whose program
    `target` accepts (`hlo`: the program lowered for `candidate.mesh`, its devices renumbered
    for each order), the given order first; and the findings of the given order."""
    errors = _errors(hlo, target)
    passing = [] if errors else [candidate]
    for order in itertools.permutations(candidate.mesh):
        moved = dataclasses.replace(candidate, order=order)
        if list(moved.mesh) != list(candidate.mesh) and not _errors(hlo, target, _device_ids(candidate.mesh, moved.mesh)):
            passing.append(moved)
    return passing, errors


def _shorter(text: str) -> str:
    """`text` with long device lists cut to their first ids."""
    return re.sub(r"\[((?:\d+, ){5}\d+)(?:, \d+)+\]", r"[\1, ...]", text)


def rejection(target: conformance.Target, errors: list) -> str:
    """One line for a candidate rejected in every order: its first finding, shortened."""
    first = errors[0]
    problem = first.message.split(";")[0].split(" (pairs")[0]
    return f"{target.name} rejects it in every mesh-axis order: {first.rule}: {_shorter(problem)}"
