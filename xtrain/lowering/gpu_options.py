"""XLA options of one step compiled for CUDA, beside the flags xtrain sets for the whole process.

xtrain.runtime.backends.cuda_xla_flags turns on XLA's latency-hiding scheduler for every GPU
program. What depends on the step is set per compile (the same options for a step run on GPUs
and for its deviceless compile, xtrain.aot), overriding those flags:

- the combine thresholds: one gradient bucket (GradSync.bucket_bytes), so that XLA merges
  collectives up to the bucket xtrain planned and no further (a whole small model's would become
  one, with no compute left to hide it behind). XLA's combiners measure a collective by its
  result, and a reduce-scatter's is one device's block, 1/n of the gradients it reduces: its
  threshold is the bucket over the largest group n the gradients are scattered over. With the
  bucket as its threshold, XLA merged every layer's reduce-scatter of a ZeRO-3 step into one
  at the end of the backward pass (deviceless H100, 4 layers: 43 KB overlapping nothing).
- for a step that gathers ZeRO-3 weights again in its backward pass, two collectives in flight
  (XLA's default is one): the re-gather of the next layer's weights runs beside this layer's
  reduce-scatter, as FSDP runs its all-gathers and reduce-scatters on two streams. On other
  steps one. A step with experts split over `expert` has one more: a MoE layer keeps a
  chunk's dispatch or combine in flight while another chunk's experts compute, beside ZeRO-3's
  gathers (xtrain.lowering.explicit.rules.experts). With one fewer, XLA's scheduler gave those
  expert GEMMs to a ZeRO-3 gather and left the layer's last combine uncovered (Mixtral-8x7B,
  dp2xep8 ZeRO-3 on 16 H100s, deviceless: 14 of 16 all-to-alls enclosed expert GEMMs; 16 of 16
  with it).
"""
from __future__ import annotations

import math

from xtrain.lowering.gradient_sync import GradSync
from xtrain.sharding.layout import StateLayout
from xtrain.sharding.mesh import EXPERT
from xtrain.sharding.plan import axes_of

THRESHOLD_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def scatter_group(layout: StateLayout) -> int:
    """The most devices any gradient is reduce-scattered over (ZeRO-2 and ZeRO-3; 1 if none)."""
    batch = set(layout.batch_axes) - {EXPERT}  # experts split over it are not reduce-scattered there
    return max((math.prod(layout.sizes[a] for entry in spec for a in axes_of(entry) if a in batch)
                for name, spec in layout.grad_specs.items() if name in layout.optimized), default=1)


def compiler_options(sync: GradSync, layout: StateLayout, *, regather: bool) -> dict[str, int]:
    """The XLA options of a step with this gradient sync and layout (module docstring)."""
    bucket = GradSync().bucket_bytes if sync.bucket_bytes is None else sync.bucket_bytes
    group = scatter_group(layout)
    options = {f"xla_gpu_{kind}_combine_threshold_bytes": max(1, bucket // (group if kind == "reduce_scatter" else 1))
               for kind in THRESHOLD_KINDS}
    in_flight = (2 if layout.zero == 3 and regather else 1) + (layout.sizes.get(EXPERT, 1) > 1)
    options["xla_gpu_experimental_parallel_collective_overlap_limit"] = in_flight
    return options
