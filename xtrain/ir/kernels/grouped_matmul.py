"""Grouped matmul over rows sorted by group, each row through its own group's matrix only.

`lax.ragged_dot` computes the same thing, but off TPU every backend runs it as one dense dot
of every row against every group's matrix, the other groups' rows masked to zero (JAX's own
lowering on CPU and Neuron, XLA's ragged-dot rewriter on GPU): `groups` times the work. An MoE
layer's experts are groups, so a model with 8 experts on a device did 8 times its expert FLOPs.

Here the rows go in tiles of `tile` rows, and the work is a list of (tile, group) items: each
group's rows are contiguous, so it meets the tiles it spans, and all groups together meet at most
`tiles + groups - 1` of them. One loop runs the items in order, each a (tile x K) @ (K x N)
matmul of one tile by one group's matrix written where the tile's rows are that group's; items
past the last group's (the count is static, the groups' sizes are not) write nothing. The work is
about rows + groups x tile rows instead of groups x rows, and each item reads one group's matrix.

FLOP counts (xtrain.ir.analysis.flops) read each loop's `Tiles` marker: the rows' share of the
items' work is the matmul FLOPs (what `lax.ragged_dot` counts, so model FLOPs and MFU are the
same either way), the rest is the backend's extra work (`Flops.ragged_dense`).

The gradient is the same loop twice (`custom_vjp`): the rows' gradient is the grouped matmul of
the output's gradient by the transposed matrices, the matrices' gradient accumulates each item's
(K x tile) @ (tile x N) product into its group, in float32.

A buffer mostly of padding (an expert-parallel device's receive buffer: room for every pair any
peer could send it, about 1 / peers of it filled when the load is even) goes through the experts'
whole FFN tile by tile (`grouped_ffn`: both GEMMs and the activation per item, so no hidden
features exist for the padding), over the items holding rows only: a count known at run time (a
while loop: xtrain uses it on CUDA; Neuron compiles no such loop, and on GPUs each iteration's
test is a copy to the host), its tiles sized for `expected` rows, the rows held on average, and
FLOP counts take the items `expected` rows make. Its gradient recomputes each tile's FFN.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from xtrain.ir import markers, vma

MAX_TILE = 1024


@markers.marker("grouped_matmul")
@dataclasses.dataclass(frozen=True)
class Tiles:
    """One grouped matmul loop: `items` items of `tile` rows over `rows` rows (a loop with a run-time
    count: those it runs for its `expected` rows)."""

    rows: int
    items: int
    tile: int

    @property
    def useful(self) -> float:
        """The rows' share of the items' work."""
        return self.rows / (self.items * self.tile)


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile: about half a group's share of the rows (so at most about 1.5 x the rows'
    work), a power of two from 8 to MAX_TILE."""
    want = max(rows // (2 * groups), 1)
    return min(max(8, 1 << (want - 1).bit_length()), MAX_TILE)


def _items(sizes, tiles: int, tile: int):
    """(group, tile index, real) of each work item, in order of group: (W,) each, W = tiles +
    groups - 1; an item past the last group's is not real (its group and tile are clamped)."""
    groups = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first, last = starts // tile, (ends - 1) // tile  # the tiles a group spans (when it has rows)
    spans = jnp.where(sizes > 0, last - first + 1, 0)
    through = jnp.cumsum(spans)  # items of groups 0..g
    index = jnp.arange(tiles + groups - 1, dtype=sizes.dtype)
    group = jnp.searchsorted(through, index, side="right", method="compare_all")
    group = jnp.minimum(group, groups - 1).astype(sizes.dtype)
    at = jnp.clip(first[group] + index - (through[group] - spans[group]), 0, tiles - 1)
    return group, at, index < through[-1], starts, ends


def _padded(x, tile: int):
    """x's rows padded with zeros to whole tiles."""
    rows = -(-x.shape[0] // tile) * tile
    return x if x.shape[0] == rows else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))


def _group(w, g):
    """Group g's matrix: the only one, or a dynamic index (no copy on a GPU: the GEMM reads it)."""
    return w[0] if w.shape[0] == 1 else lax.dynamic_index_in_dim(w, g, keepdims=False)


def _add(acc, g, part):
    """`acc` (G, ...) float32 with `part` added to group g's."""
    return lax.dynamic_update_index_in_dim(acc, _group(acc, g) + part.astype(jnp.float32), g, 0)


def _write(out, at, values, mine):
    """`out` with the tile at row `at` replaced by `values` where `mine`, kept elsewhere."""
    here = lax.dynamic_slice_in_dim(out, at, mine.shape[0])
    return lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], values.astype(out.dtype), here), at, 0)


def expected_items(rows: int, groups: int, tile: int, tiles: int) -> int:
    """The items `rows` rows of `groups` groups make (each group's partial tiles), at most all."""
    return min(-(-rows // tile) + groups - 1, tiles + groups - 1)


def _over_items(m: int, sizes, tile: int, init, step, expected: int | None = None):
    """`init` carried through the work items of `m` rows in tiles of `tile` (`_items`):
    step(carry, group, first row of the tile, which of the tile's rows are the group's) -> carry.
    `expected` rows (not None): only the items holding rows run, a count known at run time."""
    group, at, real, starts, ends = _items(sizes, -(-m // tile), tile)
    offsets = jnp.arange(tile, dtype=sizes.dtype)

    def item(carry, work):
        g, t, ok = work
        r = t * tile + offsets
        return step(carry, g, t * tile, ok & (r >= starts[g]) & (r < ends[g])), None

    if expected is None:
        with jax.named_scope(markers.name(Tiles(m, group.shape[0], tile))):
            return lax.scan(item, init, (group, at, real))[0]
    expected = min(expected, m)
    with jax.named_scope(markers.name(Tiles(expected, expected_items(expected, sizes.shape[0], tile, -(-m // tile)),
                                            tile))):
        return lax.fori_loop(0, jnp.sum(real, dtype=jnp.int32),
                             lambda i, carry: item(carry, (group[i], at[i], True))[0], init)


def _matmul(rows, w, sizes, tile: int):
    """rows (M, K) @ w (G, K, N) by group -> (M, N), in rows' dtype."""
    m = rows.shape[0]
    padded = _padded(rows, tile)

    def step(out, g, at, mine):
        y = jnp.dot(lax.dynamic_slice_in_dim(padded, at, tile), _group(w, g), preferred_element_type=rows.dtype)
        return _write(out, at, y, mine)

    zeros = jnp.zeros((padded.shape[0], w.shape[2]), rows.dtype)
    return _over_items(m, sizes, tile, vma.widen(zeros, vma.of(rows) | vma.of(w) | vma.of(sizes)), step)[:m]


def _weight_grad(rows, dout, sizes, groups: int, tile: int):
    """The matrices' gradient: per group, its rows' (K x rows) @ (rows x N), in float32."""
    m = rows.shape[0]
    x_all, d_all = _padded(rows, tile), _padded(dout, tile)

    def step(dw, g, at, mine):
        d = jnp.where(mine[:, None], lax.dynamic_slice_in_dim(d_all, at, tile), 0)
        part = jnp.dot(lax.dynamic_slice_in_dim(x_all, at, tile).T, d, preferred_element_type=jnp.float32)
        return _add(dw, g, part)

    zeros = jnp.zeros((groups, rows.shape[1], dout.shape[1]), jnp.float32)
    return _over_items(m, sizes, tile, vma.widen(zeros, vma.of(rows) | vma.of(dout) | vma.of(sizes)), step)


@jax.custom_vjp
def grouped_matmul(rows, w, sizes):
    """rows (M, K) sorted by group, w (G, K, N), sizes (G,) int32 rows per group (rows past their
    sum: zero) -> (M, N) in rows' dtype, each row times its group's matrix (module docstring)."""
    return _matmul(rows, w, sizes, tile_rows(rows.shape[0], w.shape[0]))


def _fwd(rows, w, sizes):
    return grouped_matmul(rows, w, sizes), (rows, w, sizes)


def _bwd(res, dout):
    rows, w, sizes = res
    tile = tile_rows(rows.shape[0], w.shape[0])
    drows = _matmul(dout.astype(rows.dtype), jnp.swapaxes(w, 1, 2), sizes, tile)
    dw = _weight_grad(rows, dout.astype(rows.dtype), sizes, w.shape[0], tile)
    return drows, dw.astype(w.dtype), None


grouped_matmul.defvjp(_fwd, _bwd)


def _ffn_tile(rows, up, expected: int) -> int:
    return tile_rows(min(expected, rows.shape[0]), up.shape[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def grouped_ffn(rows, up, down, sizes, ffn, expected: int):
    """rows (M, K) sorted by group -> (M, N): each row through its group's FFN, `ffn(x (T, K),
    up[g], down[g]) -> (T, N)` (its GEMMs and activation), tile by tile over the items holding
    rows only (a loop count known at run time; `expected` rows on average, module docstring).
    Nothing of a tile's hidden features outlives it: the gradient recomputes them per item."""
    m, tile = rows.shape[0], _ffn_tile(rows, up, expected)
    padded = _padded(rows, tile)
    features = jax.eval_shape(ffn, padded[:tile], _group(up, 0), _group(down, 0)).shape[-1]

    def step(out, g, at, mine):
        return _write(out, at, ffn(lax.dynamic_slice_in_dim(padded, at, tile), _group(up, g), _group(down, g)), mine)

    zeros = vma.widen(jnp.zeros((padded.shape[0], features), rows.dtype),
                      vma.of(rows) | vma.of(up) | vma.of(down) | vma.of(sizes))
    return _over_items(m, sizes, tile, zeros, step, expected)[:m]


def _ffn_fwd(rows, up, down, sizes, ffn, expected):
    return grouped_ffn(rows, up, down, sizes, ffn, expected), (rows, up, down, sizes)


def _ffn_bwd(ffn, expected, res, dout):
    """Per item: the tile's FFN again and its pullback of the tile's rows of `dout` (the other
    groups' rows zero); the rows' gradient written where they are, the matrices' summed per
    group in float32."""
    rows, up, down, sizes = res
    m, tile = rows.shape[0], _ffn_tile(rows, up, expected)
    x_all, d_all = _padded(rows, tile), _padded(dout.astype(rows.dtype), tile)

    def step(carry, g, at, mine):
        drows, dup, ddown = carry
        _, pull = jax.vjp(ffn, lax.dynamic_slice_in_dim(x_all, at, tile), _group(up, g), _group(down, g))
        dx, du, dd = pull(jnp.where(mine[:, None], lax.dynamic_slice_in_dim(d_all, at, tile), 0))
        return _write(drows, at, dx, mine), _add(dup, g, du), _add(ddown, g, dd)

    kinds = vma.of(rows) | vma.of(dout) | vma.of(up) | vma.of(down) | vma.of(sizes)
    init = tuple(vma.widen(jnp.zeros(shape, dtype), kinds) for shape, dtype in (
        (x_all.shape, rows.dtype), (up.shape, jnp.float32), (down.shape, jnp.float32)))
    drows, dup, ddown = _over_items(m, sizes, tile, init, step, expected)
    return drows[:m], dup.astype(up.dtype), ddown.astype(down.dtype), None


grouped_ffn.defvjp(_ffn_fwd, _ffn_bwd)
