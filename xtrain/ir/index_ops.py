"""Markers on the index operations whose rules differ between torch and their JAX lowering.

JAX clips or fills an out-of-range gather index and wraps a negative one; torch raises for an
index out of range, and per op either wraps negatives (advanced indexing, `x[idx]`) or raises
(`embedding`, `gather`, the targets of `nll_loss` / `cross_entropy`). The front end traces such
ops inside a `jax.named_scope` named by their `IndexOp` marker (xtrain.ir.markers), so the lowering's input
checks (xtrain.lowering.input_checks) can hold a batch's indices to torch's rule. Gathers
without a marker follow advanced indexing's rule.
"""
from __future__ import annotations

import dataclasses

from xtrain.ir import markers


@markers.marker("index")
@dataclasses.dataclass(frozen=True)
class IndexOp:
    """A torch op that indexes with a tensor.

    Attributes:
        name: how errors name it ("embedding", "cross_entropy/nll_loss target", "torch.gather").
        negatives: torch wraps a negative index (as `x[-1]`); False: torch raises for it.
        float_index: the index reached the op as a floating-point tensor (torch refuses it;
            the front end traced it cast to int so that the error can name the batch argument).
    """

    name: str
    negatives: bool = False
    float_index: bool = False


ADVANCED_INDEXING = IndexOp("indexing (x[idx])", negatives=True)


def marker_in(name_stack: str) -> IndexOp | None:
    """The op of a name stack's markers: the outermost names it and its rule (an op such as
    nll_loss contains a gather); a floating-point index at any level is one."""
    found = markers.found(IndexOp, name_stack)
    if not found:
        return None
    return dataclasses.replace(found[0], float_index=any(op.float_index for op in found))
