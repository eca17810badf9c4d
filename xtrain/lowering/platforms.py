"""Which platform a step is lowered for, when it is not the one it runs on.

JAX lowers a jitted function for any platform it has rules for, without that platform's
devices (`jit(f).trace(...).lower(lowering_platforms=(p,))`): the program XLA would receive
there, before XLA's own passes (which run only when compiling on that platform). xtrain emits
only JAX primitives with platform-independent lowering rules, plus one CPU-only rule of its own
(ordering.py), so the program lowered here for CUDA or Neuron is the one a GPU or a Trainium
host builds. The NKI flash-attention primitives (xtrain.ir.kernels.neuron_attention) get their lowering
for "neuron" from the plugin and are emitted only when the trace runs on Neuron devices with it
(xtrain.frontend.sdpa), so lowering for "neuron" elsewhere needs no plugin.
"""
from __future__ import annotations

from xtrain.errors import OptionsError

# user-facing names -> JAX's lowering platform names
PLATFORMS = {"cpu": "cpu", "cuda": "cuda", "gpu": "cuda", "neuron": "neuron"}


def lowering_platforms(platform: str | None) -> tuple[str, ...] | None:
    """JAX's `lowering_platforms` for `platform` ("cuda", "gpu", "neuron", "cpu"); None: the
    platform of the devices the program is placed on."""
    if platform is None:
        return None
    name = PLATFORMS.get(str(platform).lower())
    if name is None:
        raise OptionsError(f"platform={platform!r} is not one xtrain lowers for; use one of "
                           f"{', '.join(sorted(set(PLATFORMS) - {'gpu'}))}")
    return (name,)
