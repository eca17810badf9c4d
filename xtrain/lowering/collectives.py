"""The collectives layer: every collective xtrain emits is one of these calls.

Partition rules (explicit/rules/), gradient synchronisation, ZeRO, gradient clipping and
the pipeline's permutes all communicate through here and nowhere else (a test checks the
sources), so what the program can contain is this list: all-reduce, reduce-scatter,
all-gather, all-to-all, collective permute. The report counts them back from the emitted program
(accounting.py), autodiff's transposes included; the Neuron conformance checker and the cost
model read the same program.

Axes are mesh axis names (major first); a collective over several axes runs over the
flattened group.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant  # no public name in jax 0.10

from xtrain.ir.vma import of as vma  # noqa: F401 (the mesh axes a value varies over: the lowering's import)

Axes = tuple[str, ...]


def _name(axes: Sequence[str]):
    axes = tuple(axes)
    return axes[0] if len(axes) == 1 else axes


def all_reduce(x, axes: Sequence[str]):
    """The sum of `x` over the devices of `axes`, on each of them."""
    return lax.psum(x, _name(axes))


def _joined(reduce, values: list, axes: Sequence[str]) -> list:
    """`reduce` (lax.psum, lax.pmax) of each value over `axes` (all of one dtype) as one
    collective of the values flattened into one buffer."""
    flat = reduce(jnp.concatenate([jnp.ravel(x) for x in values]), _name(axes))
    sizes = np.cumsum([x.size for x in values])[:-1]
    return [piece.reshape(x.shape) for x, piece in zip(values, jnp.split(flat, sizes))]


def all_reduce_joined(values: list, axes: Sequence[str]) -> list:
    """Each value summed over `axes` (all of one dtype): one all-reduce of them all."""
    return _joined(lax.psum, values, axes)


def all_max(values: dict) -> dict:
    """Each value's elementwise max over every axis it varies on, typed invariant over them: one
    all-reduce per set of axes (the values flattened into one buffer)."""
    groups: dict = {}
    for name, x in values.items():
        groups.setdefault(tuple(sorted(vma(x))), []).append(name)
    out = {}
    for axes, names in groups.items():
        if not axes:
            out.update((n, values[n]) for n in names)
            continue
        out.update(zip(names, _joined(lax.pmax, [values[n] for n in names], axes)))
    return out


def broadcast_first(x, axes: Sequence[str]):
    """`x` as the first device of `axes` holds it, on each of them and typed invariant over them:
    one all-reduce in which the other devices add zeros (exact). For a value equal on those
    devices that the program types as varying (computed from parameters cast to varying)."""
    first = True
    for a in axes:
        first = first & (lax.axis_index(a) == 0)
    return lax.psum(jnp.where(first, x, jnp.zeros_like(x)), _name(axes))


def reduce_scatter(x, axes: Sequence[str], dim: int, *, tiled: bool = True):
    """The sum of `x` over `axes`, each device keeping its block of dimension `dim`."""
    return lax.psum_scatter(x, _name(axes), scatter_dimension=dim, tiled=tiled)


def all_gather(x, axes: Sequence[str], dim: int, *, tiled: bool = True, invariant: bool = False):
    """Every device's `x` joined along `dim` (tiled) or stacked on a new leading dim.

    `invariant`: the result is typed as the same on every device of `axes` (so the rest of the
    program is not typed as varying over them); else varying, which makes the transpose a
    reduce-scatter (what a consumer that varies over `axes` anyway needs)."""
    gather = _all_gather_invariant if invariant else lax.all_gather
    return gather(x, _name(axes), axis=dim, tiled=tiled)


def all_to_all(x, axes: Sequence[str], dim: int, concat_dim: int | None = None,
               groups: Sequence[Sequence[int]] | None = None):
    """Block i of `x`'s dimension `dim` (cut into one block per device of `axes`) sent to device
    i; the received blocks replace them in sender order (block j came from device j), or are
    joined along `concat_dim` in that order. `groups`: disjoint lists of device indices along
    `axes` exchanging among themselves only (block i to the group's i-th device)."""
    return lax.all_to_all(x, _name(axes), dim, dim if concat_dim is None else concat_dim, tiled=True,
                          axis_index_groups=None if groups is None else [list(g) for g in groups])


def ragged_all_to_all(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis: str):
    """Rows [input_offsets[j], + send_sizes[j]) of `x` sent to device j along `axis`, written
    there at output_offsets[j]; `output` with the rows received from each device j (recv_sizes[j]
    of them) written where j said (lax.ragged_all_to_all). XLA:CPU has no ragged all-to-all."""
    return lax.ragged_all_to_all(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=axis)


def permute(x, axis: str, pairs: Sequence[tuple[int, int]]):
    """`x` sent from device i to device j along `axis` for each (i, j) of `pairs`."""
    return lax.ppermute(x, axis, list(pairs))


def axis_offset(sizes: Mapping[str, int], axes: Sequence[str]):
    """This device's index along `axes` flattened major-first (0 for no axes). No communication."""
    index = 0
    for a in axes:
        index = index * sizes[a] + lax.axis_index(a)
    return index


