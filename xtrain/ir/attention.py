"""Markers on attention call sites: which implementation each got.

The front end computes scaled-dot-product attention one of a few ways (`Implementation`) and
traces each call inside a `jax.named_scope` named by its `Site` marker (xtrain.ir.markers): which
implementation, its block size and how many key blocks a causal mask let it skip. `sites` reads them back from a program, so
`step.report()` can name the attention every call site got.
"""
from __future__ import annotations

import dataclasses
import enum

from xtrain.ir import markers, walk

class Implementation(enum.Enum):
    """How an attention call is computed."""

    BLOCKWISE = "blockwise"  # key blocks with an online softmax; backward keeps out + log-sum-exp
    CUDNN = "cudnn"          # jax.nn.dot_product_attention(implementation="cudnn") on CUDA
    NKI_FLASH = "nki_flash"  # Neuron's NKI flash-attention kernels (xtrain.ir.kernels.neuron_attention)
    EAGER = "eager"          # HF's eager matmul -> softmax -> matmul left as written (full L x S weights)


# The key/query block of the blockwise path per JAX backend: big enough for efficient matmuls,
# small enough that a block's scores (batch x heads x block x block) stay small. GPU: measured on
# one H200 (benchmarks/results/gpu_attention_h200.md: causal forward + backward, 8 x 2048 tokens,
# 32 heads): 128 took 15.7 ms, 256 11.8, 512 10.4 (1.1 GiB of temporaries), 1024 10.4 (3.7 GiB).
DEFAULT_BLOCK = {"cpu": 256, "gpu": 512, "cuda": 512, "neuron": 512}


@markers.marker("attention")
@dataclasses.dataclass(frozen=True)
class Site:
    """One attention call as traced.

    Attributes:
        implementation: what computes it.
        block: query/key block size (blockwise); the sequence tile of NKI flash attention; 0 for cuDNN.
        blocks: (query block, key block) pairs computed.
        total: pairs a full score matrix would need; blocks < total when a causal mask skips some.
        why: why a fused kernel was not used ("" when it was).
        skipped_by: what let it skip blocks (the causal mask, or a mask's static band).
        fused_on: "cuda" when this blockwise call, traced on another backend, is one a CUDA host
            hands to cuDNN's fused kernel (the cost model then prices it as fused: its scores
            never go through device memory); "" otherwise.
        documents: how a mask of packed documents is computed (xtrain.frontend.token_mask);
            "" for other masks.
    """

    implementation: Implementation
    block: int = 0
    blocks: int = 1
    total: int = 1
    why: str = ""
    skipped_by: str = "causal mask"
    fused_on: str = ""
    documents: str = ""

    def describe(self) -> str:
        if self.implementation is Implementation.CUDNN:
            return "cuDNN fused attention"
        if self.implementation is Implementation.NKI_FLASH:
            return f"Neuron NKI flash attention (flash_fwd / flash_attn_bwd, sequence tile {self.block})"
        if self.implementation is Implementation.EAGER:
            return f"eager matmul-softmax-matmul left as written (full score matrix): {self.why}"
        skipped = f", {self.total - self.blocks} of {self.total} blocks skipped by the {self.skipped_by}" \
            if self.blocks < self.total else ""
        documents = f"; {self.documents}" if self.documents else ""
        return (f"blockwise (block {self.block}, {self.blocks} block pairs{skipped}{documents})"
                f"{'; ' + self.why if self.why else ''}")


def sites(jaxpr, module_paths: frozenset[str]) -> dict[str, Site]:
    """Module path -> the attention of each call site in a program ("" for top-level code)."""
    found: dict[str, Site] = {}
    for eqn, path in walk.equations(jaxpr, module_paths):
        site = markers.outermost(Site, eqn.source_info.name_stack)
        if site is not None:
            found.setdefault(path, site)
    return found
