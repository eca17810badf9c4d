"""`plan="auto"`: the plan the cost model picks (xtrain.cost.search) for the devices this job
runs on, from the first batch's shapes, and the same pick in every process."""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from xtrain.cost import hardware, search
from xtrain.errors import PlanError
from xtrain.ir.model import Trainable


def search_plans(trainable: Trainable, batch: tuple, *, pipelines: bool) -> search.SearchResult:
    """The plan search for the current devices' hardware profile.

    Args:
        trainable: the model and optimizer being compiled.
        batch: the first global batch on the host (only its shapes are read).
        pipelines: whether pipeline plans are candidates (the pipeline step refuses accumulate > 1).

    Returns:
        The search, every candidate listed (`step.search`).
    """
    return search.search(trainable.model, trainable.tx, batch, hardware.current_profile(), len(jax.devices()),
                         structure=trainable.structure, pipe_degrees=None if pipelines else (1,),
                         experts=sorted(trainable.experts))


def agreed_pick(result: search.SearchResult) -> search.Candidate:
    """The pick of process 0 in every process: each calibrates its own profile, and a job whose
    processes compiled different plans would deadlock in its first collective. An error when no
    candidate fits."""
    if result.best is None:
        raise PlanError(f"plan='auto': no candidate plan fits the device memory:\n{result}")
    if jax.process_count() == 1:
        return result.best.candidate
    index = multihost_utils.broadcast_one_to_all(np.int32(result.rows.index(result.best)))
    return result.rows[int(index)].candidate
