"""Trace options: how a front end traces a model for one plan and step, as plain data.

A plan can need the model traced differently from how torch runs it (Megatron's split of
grouped-query heads, sequence-parallel annotations on the blocks, a kernel ruled out). Those
choices travel as a `TraceOptions` value: the plan carries it (`Plan.trace`, set by
`xtrain.plans.megatron`), the step completes it for its mesh and lowering
(`Plan.trace_options`), and `Model.specialised(options)` returns the model traced under it.
The front end installs what it needs only inside that model's trace, so the user's module is
the same object, with the same hooks and attributes, before and after.
"""
from __future__ import annotations

import dataclasses

# One spec entry per activation dimension, as xtrain.shard takes it: a mesh axis, a tuple of
# axes (major first) or None.
SpecEntry = str | tuple[str, ...] | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SequenceParallel:
    """Megatron-SP: the residual stream between the blocks' tensor-parallel regions split over
    the sequence.

    Attributes:
        blocks: module paths of the blocks whose hidden-state input and output are annotated.
        spec: the annotation (batch axis, sequence axes, width), as `xtrain.shard(x, spec)`.
    """

    blocks: tuple[str, ...]
    spec: tuple[SpecEntry, ...]

    def __post_init__(self):
        object.__setattr__(self, "blocks", tuple(self.blocks))
        object.__setattr__(self, "spec", tuple(tuple(e) if isinstance(e, list) else e for e in self.spec))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TraceOptions:
    """How the front end traces the model (defaults: as torch computes it).

    Attributes:
        head_split: the tensor-parallel size the query heads are split over. Grouped-query
            attention whose key/value heads it does not divide has keys and values repeated
            per query head (xtrain.frontend.sdpa), so each device's split stays local.
        sequence_parallel: blocks whose inputs and outputs are split over the sequence, or None.
        no_nki: why attention must not use Neuron's NKI kernels ("" when it may).
        no_cudnn: why attention must not use cuDNN's fused kernel on CUDA ("" when it may).
        ulysses: the devices a sequence split over `context` is turned into a head split over
            for attention (Plan(context="ulysses")): a fused kernel sees whole sequences, and
            its query and key/value heads must split over them (1: no Ulysses).
        autocast: the dtype the plan's matrix multiplications run in ("bfloat16", "float16"; ""
            for float32): a fused attention kernel (cuDNN, NKI) takes float32 queries, keys and
            values cast to it, as torch.autocast runs scaled_dot_product_attention, and its
            output is cast back (the precision policy narrows the blockwise kernel's matmuls
            the same way).
    """

    head_split: int = 1
    sequence_parallel: SequenceParallel | None = None
    no_nki: str = ""
    no_cudnn: str = ""
    ulysses: int = 1
    autocast: str = ""

    def __post_init__(self):
        if not isinstance(self.head_split, int) or self.head_split < 1:
            raise ValueError(f"TraceOptions(head_split={self.head_split!r}): give the tensor-parallel size, an int >= 1")

    @property
    def is_default(self) -> bool:
        return self == TraceOptions()

    def __str__(self) -> str:
        """One clause per option that differs from torch's own computation ("" when none)."""
        parts = []
        if self.head_split != 1:
            parts.append(f"query heads split {self.head_split} ways (keys/values repeated where that cuts GQA groups)")
        if self.sequence_parallel is not None:
            sp = self.sequence_parallel
            parts.append(f"sequence parallel {sp.spec} at the inputs and outputs of {len(sp.blocks)} blocks")
        if self.no_nki:
            parts.append(f"no NKI kernels: {self.no_nki}")
        if self.no_cudnn:
            parts.append(f"no cuDNN attention: {self.no_cudnn}")
        if self.ulysses != 1:
            parts.append(f"attention over whole sequences, heads split {self.ulysses} ways over 'context' (Ulysses)")
        return "; ".join(parts)
