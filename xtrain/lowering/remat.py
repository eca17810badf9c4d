"""Activation checkpointing in the lowering: the plan's per-layer remat choice
(xtrain.sharding.remat.LayerRemat) as a jax.checkpoint policy, and the tag that marks what
remat="selective" keeps."""
from __future__ import annotations

import jax

from xtrain.sharding.remat import LayerRemat, Remat

KEPT = "xtrain.remat.kept"  # checkpoint_name of the values remat='selective' keeps


def policy(remat: LayerRemat):
    """jax.checkpoint policy of one layer (None: save nothing but the layer's input)."""
    if remat.mode is Remat.DOTS:
        return jax.checkpoint_policies.dots_saveable
    if remat.mode is Remat.SELECTIVE:
        return jax.checkpoint_policies.save_only_these_names(KEPT)
    return None
