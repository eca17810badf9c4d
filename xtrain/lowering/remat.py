"""Activation checkpointing in the lowering: the plan's per-layer remat choice
(xtrain.sharding.remat.LayerRemat) as a jax.checkpoint policy, and the tags that mark what a
layer keeps: remat="selective"'s kept modules (and, offloaded under remat="dots", the matmul
outputs) and, when activations are offloaded, the layer's input.

Offload (Plan(offload="activations")): the tagged values are offloaded instead of saved
(jax.checkpoint_policies.save_and_offload_only_these_names): the forward pass copies each to
host memory ("pinned_host") as the layer finishes and the backward pass copies it back when it
reaches the layer; everything untagged is recomputed. JAX lowers those copies to XLA's host
placement annotations for GPU and TPU; for CPU it lowers them to nothing (jax/_src/dispatch.py
registers the annotating device_put lowering only for 'gpu' and 'tpu'), so on XLA:CPU the
residuals stay in device buffers, exactly as remat with the same policy saving them.
"""
from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from xtrain.sharding.offload import HOST_MEMORY
from xtrain.sharding.remat import LayerRemat, Remat

KEPT = "xtrain.remat.kept"                # checkpoint_name of the values remat='selective' keeps
LAYER_INPUT = "xtrain.remat.layer_input"  # a layer's input, named so that it can be offloaded
OFFLOADED = (KEPT, LAYER_INPUT)


def policy(remat: LayerRemat):
    """jax.checkpoint policy of one layer (None: save nothing but the layer's input)."""
    if remat.offload:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(OFFLOADED),
            offload_src="device", offload_dst=HOST_MEMORY)
    if remat.mode is Remat.DOTS:
        return jax.checkpoint_policies.dots_saveable
    if remat.mode is Remat.POLICY:
        return remat.policy
    if remat.mode is Remat.SELECTIVE:
        return jax.checkpoint_policies.save_only_these_names(KEPT)
    return None


def layer_inputs(remat: LayerRemat | None, values: list) -> list:
    """A layer's input values, tagged for offload when `remat` offloads (else unchanged): the
    layer then reads its input only through the tag, so the offloaded copy is all the backward
    pass needs of it."""
    if remat is None or not remat.offload:
        return values
    return [checkpoint_name(v, LAYER_INPUT) for v in values]
