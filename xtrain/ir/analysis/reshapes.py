"""How a reshape's dimensions correspond (for analyses that follow a dimension through reshapes)."""
from __future__ import annotations

import bisect
import itertools
import operator


def one_head(in_shape, out_shape, first: int) -> bool:
    """A reshape of the last dimension into (1 head, head_dim): one key/value head (MQA), which
    the axis cannot split (an unsqueeze of the same shape is read the same way)."""
    return (len(out_shape) == len(in_shape) + 1 and first == len(out_shape) - 1 and out_shape[first - 1] == 1
            and out_shape[first] == in_shape[-1])


def blocks(a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """A reshape's dimensions grouped into blocks of equal element count: ([in dims], [out dims])
    (a block ends where the running products of both shapes meet)."""
    pa, pb = list(itertools.accumulate(a, operator.mul)), list(itertools.accumulate(b, operator.mul))
    common = sorted(set(pa) & set(pb))
    blocks: list[tuple[list[int], list[int]]] = [([], []) for _ in common]
    for side, running in ((0, pa), (1, pb)):
        for d, p in enumerate(running):
            blocks[min(bisect.bisect_left(common, p), len(common) - 1)][side].append(d)
    return blocks


def fused_heads(size: int, big_out: list[int], tp: int) -> list[tuple[int, int]] | None:
    """The equal segments of a fused output of `size` reshaped into (segments, heads, ...) (the
    output's dims larger than 1: `big_out`) when the axis `tp` does not divide the segment count
    and divides the heads (ModernBERT's Wqkv into (3, heads, head_dim)), else None."""
    if len(big_out) < 3 or big_out[1] % tp or not big_out[0] % tp:
        return None
    count = big_out[0]
    return [(i * size // count, (i + 1) * size // count) for i in range(count)]
