"""Variable-length batches -> a small fixed set of shapes, so the step compiles once per bucket.

A step compiles once per distinct batch shape. Text batches whose sequence length varies from
batch to batch would recompile every step; padding each batch's sequence axis up to the next
length in `Buckets.lengths` bounds the shapes the step ever sees to `len(lengths)`.

Padding must not change the loss: targets are padded with an ignore index (-100 is what
`torch.nn.functional.cross_entropy` skips by default) and inputs with a pad token; with causal
attention the padded positions come after every real token, so real positions never see them.
`mask=True` appends a (B, L) int32 mask (1 = real token) for models that need one.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from xtrain.errors import InputError, OptionsError
from xtrain.frontend.tensors import to_numpy

IGNORE_INDEX = -100  # torch cross_entropy's default ignore_index


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """How variable-length batches are padded.

    Attributes:
        lengths: the allowed padded lengths of the sequence axis, e.g. (128, 256, 512); a batch is
            padded to the smallest one that holds its longest sequence.
        pad_values: the pad value of each batch argument, in order, e.g. (0, -100) for
            (token ids, next-token targets).
        axis: the sequence axis of every argument (1 for (B, T) batches).
        mask: append a (B, L) int32 mask of real tokens as the last argument.
    """

    lengths: tuple[int, ...]
    pad_values: tuple[float, ...]
    axis: int = 1
    mask: bool = False

    def __post_init__(self):
        lengths = tuple(self.lengths)
        if not lengths or any(not isinstance(n, int) or n <= 0 for n in lengths):
            raise OptionsError(f"Buckets.lengths={self.lengths!r}: give one or more positive integer lengths")
        if list(lengths) != sorted(set(lengths)):
            raise OptionsError(
                f"Buckets.lengths={self.lengths!r} must be strictly increasing, e.g. {tuple(sorted(set(lengths)))}")
        if self.axis < 1:
            raise OptionsError(f"Buckets.axis={self.axis}: axis 0 is the batch axis; the sequence axis is 1 or later")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "pad_values", tuple(self.pad_values))

    def length_for(self, longest: int) -> int:
        """The bucket a batch whose longest sequence has `longest` tokens is padded to."""
        at = bisect.bisect_left(self.lengths, longest)
        if at == len(self.lengths):
            raise InputError(f"a sequence of {longest} tokens is longer than the largest bucket "
                             f"{self.lengths[-1]} (Buckets.lengths={self.lengths}); add a larger bucket or "
                             f"truncate the data")
        return self.lengths[at]

    def pad(self, batch: Sequence[Any], length: int | None = None) -> tuple:
        """Pads every argument of `batch` to one bucket length (the batch's own, or `length`).

        Each argument is an array whose sequence axis may be shorter than the bucket, or a list
        of per-sample sequences of different lengths (ragged)."""
        if len(batch) != len(self.pad_values):
            raise InputError(f"the batch has {len(batch)} arguments but Buckets.pad_values has "
                             f"{len(self.pad_values)} ({self.pad_values}); give one pad value per argument")
        rows = [_rows(x) for x in batch]
        longest = max(len_along(r, self.axis) for arg in rows for r in arg)
        length = self.length_for(longest) if length is None else length
        if length < longest:
            raise InputError(f"a sequence of {longest} tokens does not fit the requested bucket length {length}")
        out = [self._stack(arg, value, length) for arg, value in zip(rows, self.pad_values)]
        if self.mask:
            out.append(_mask([len_along(r, self.axis) for r in rows[0]], length))
        return tuple(out)

    def _stack(self, rows: list[np.ndarray], value: float, length: int) -> np.ndarray:
        padded = []
        for r in rows:
            widths = [(0, 0)] * r.ndim
            widths[self.axis - 1] = (0, length - r.shape[self.axis - 1])
            padded.append(np.pad(r, widths, constant_values=value))
        return np.stack(padded)  # (B, L, ...)


def len_along(row: np.ndarray, axis: int) -> int:
    """The length of one sample (no batch axis) along the batch's sequence `axis`."""
    return row.shape[axis - 1]


def _rows(x: Any) -> list[np.ndarray]:
    """One argument -> its samples (arrays without the batch axis)."""
    if isinstance(x, (list, tuple)):
        return [to_numpy(r) for r in x]
    arr = to_numpy(x)
    return list(arr)


def _mask(lengths: list[int], length: int) -> np.ndarray:
    return (np.arange(length)[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)  # (B, L)
