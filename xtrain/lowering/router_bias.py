"""Auxiliary-loss-free load balancing of MoE layers (DeepSeek-V3, arXiv:2412.19437, section
2.1.2): each expert has a bias added to its router score for the choice of experts only (the
gate weights stay the unbiased scores), and after every step it moves by a fixed rate towards
balance: up for an expert that got fewer tokens than the mean, down for one that got more,
`bias += rate x sign(mean(load) - load)`, from the step's tokens per expert over all devices.

The bias is the model's own buffer, HF DeepSeek-V3's `e_score_correction_bias` (its router adds
it to the sigmoid scores before the group and top-k choice; torch leaves it at zero), found
beside the layer's experts. Updated in the compiled step with the other buffers, it is training
state: checkpointed, resharded and restored with them, and kept as it was when a step is skipped.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp

from xtrain.errors import PlanError

BUFFER = "e_score_correction_bias"


def buffer_of(layer: str, buffers: Mapping[str, Any], experts: int) -> str:
    """The selection bias of the MoE layer whose experts run at module path `layer`: the one
    buffer named BUFFER of `experts` entries in the module that holds the experts."""
    parent = layer.rsplit(".", 1)[0] if "." in layer else ""
    found = [n for n, b in buffers.items() if n.rsplit(".", 1)[-1] == BUFFER and tuple(b.shape) == (experts,)
             and (n.startswith(parent + ".") if parent else True)]
    if len(found) != 1:
        what = "no buffer" if not found else f"{len(found)} buffers ({', '.join(sorted(found))})"
        raise PlanError(f"Plan(router_bias_rate=...): the MoE layer {layer!r} ({experts} experts) has {what} named "
                        f"{BUFFER!r} of shape ({experts},) under {parent or '<top level>'!r}; the router must add "
                        f"such a buffer to its scores for the choice of experts (HF DeepSeek-V3's does), or leave "
                        f"router_bias_rate=None")
    return found[0]


def updated(buffers: Mapping[str, Any], tokens: Mapping[str, Any], rate: float) -> dict:
    """`buffers` with each MoE layer's selection bias moved by `rate` towards balance, from
    `tokens` ({experts' module path: tokens per expert this step, summed over the devices})."""
    if not tokens:
        raise PlanError("Plan(router_bias_rate=...) balances MoE layers, and this model routed no tokens to experts "
                        "(no HF experts module or routed-experts call was traced); leave router_bias_rate=None")
    new = dict(buffers)
    for layer, counts in tokens.items():
        name = buffer_of(layer, buffers, counts.shape[-1])
        load = counts.astype(jnp.float32)
        step = rate * jnp.sign(jnp.mean(load) - load)
        new[name] = (buffers[name] + step).astype(buffers[name].dtype)
    return new
