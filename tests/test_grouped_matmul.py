"""xtrain's grouped matmul (xtrain.ir.kernels.grouped_matmul): the MoE experts' GEMMs as a loop of
(tile, group) items, against `lax.ragged_dot`, which off TPU runs every row through every group's
matrix; its FLOPs as counted for MFU and for the cost model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from xtrain.ir.analysis import flops
from xtrain.ir.kernels import grouped_matmul as gm
from xtrain.ir.kernels import moe

pytestmark = pytest.mark.unit

CASES = {
    "uneven, empty groups, rows past the groups": (37, [3, 0, 20, 2, 0, 7]),
    "one group of all rows": (64, [64]),
    "no rows in any group": (50, [0, 0, 0]),
    "a group of one row between tiles": (33, [1, 1, 1, 30]),
    "many groups": (300, [5] * 40 + [0] * 20 + [60]),
}


@pytest.mark.parametrize("case", CASES)
def test_equals_ragged_dot_with_its_gradients(case):
    rows, sizes = CASES[case]
    groups, k, n = len(sizes), 6, 5
    sizes = jnp.array(sizes, jnp.int32)
    keys = jax.random.split(jax.random.key(rows), 3)
    a, b = jax.random.normal(keys[0], (rows, k)), jax.random.normal(keys[1], (groups, k, n))
    probe = jax.random.normal(keys[2], (rows, n))
    loss = lambda f: jax.jit(jax.value_and_grad(lambda a, b: jnp.sum(jnp.sin(f(a, b, sizes)) * probe), (0, 1)))
    (want, want_grads), (got, got_grads) = loss(lax.ragged_dot)(a, b), loss(gm.grouped_matmul)(a, b)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_bfloat16_accumulates_the_weight_gradient_in_float32():
    """A group spanning many tiles: its weight gradient is summed over the tiles in float32, then
    rounded once, as one dot would (within bf16's rounding of the float32 reference)."""
    rows, k, n = 512, 8, 4
    sizes = jnp.array([500, 12], jnp.int32)
    a = jax.random.normal(jax.random.key(0), (rows, k))
    b = jax.random.normal(jax.random.key(1), (2, k, n))
    grad = lambda dtype: jax.grad(lambda b: jnp.sum(gm.grouped_matmul(a.astype(dtype), b, sizes).astype(jnp.float32)))
    reference = grad(jnp.float32)(b)
    got = grad(jnp.bfloat16)(b.astype(jnp.bfloat16)).astype(jnp.float32)
    np.testing.assert_allclose(got, reference, rtol=2e-2, atol=0.5)  # inputs rounded to bf16, sums of 500 rows


def test_flops_count_each_row_once_and_the_loop_rest_apart():
    """Model FLOPs count each row through one group's matrix (as for lax.ragged_dot: forward, and
    the rows' and the matrices' gradients); the loop's other work is `ragged_dense`, a fraction of
    the work lax.ragged_dot's dense lowering does beyond it."""
    rows, k, n, groups = 256, 16, 8, 8
    sizes = jnp.full((groups,), rows // groups, jnp.int32)
    args = jnp.ones((rows, k)), jnp.ones((groups, k, n))
    counted = {name: flops.count(jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(f(a, b, sizes) ** 2), (0, 1)))(*args))
               for name, f in (("ragged", lax.ragged_dot), ("grouped", gm.grouped_matmul))}
    useful = 3 * 2 * rows * k * n
    assert counted["ragged"].dot == counted["grouped"].dot == useful
    tile = gm.tile_rows(rows, groups)
    items = -(-rows // tile) + groups - 1
    assert counted["grouped"].ragged_dense == pytest.approx(3 * 2 * items * tile * k * n - useful)
    assert counted["grouped"].ragged_dense < counted["ragged"].ragged_dense / 4


SPECS = {
    "SwiGLU [gate; up]": moe.ExpertsSpec(activation="silu"),
    "interleaved, stored (in, out)": moe.ExpertsSpec(activation="silu", concatenated=False, transposed=True),
    "GELU, not gated": moe.ExpertsSpec(activation="gelu", gated=False),
    "bf16 GEMMs": moe.ExpertsSpec(activation="silu", compute="bfloat16"),
}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("held", [[30], [5, 0, 17], [0, 0]], ids=["one group", "three groups", "no rows"])
def test_a_padded_buffer_through_the_experts_ffn_tile_by_tile(spec, held):
    """An expert-parallel receive buffer (room for 96 rows, a few held, the rest padding) through
    the experts' FFN tile by tile over the rows held (grouped_ffn, a loop counted at run time):
    the same values and gradients as the FFN over every row."""
    spec, room, hidden, ffn = SPECS[spec], 96, 8, 6
    groups, sizes = len(held), jnp.array(held, jnp.int32)
    keys = jax.random.split(jax.random.key(groups), 4)
    up_shape, down_shape = ((ffn * (1 + spec.gated), hidden), (hidden, ffn))
    if spec.transposed:
        up_shape, down_shape = up_shape[::-1], down_shape[::-1]
    rows, probe = jax.random.normal(keys[0], (room, hidden)), jax.random.normal(keys[3], (room, hidden))
    up = jax.random.normal(keys[1], (groups, *up_shape)) / 3
    down = jax.random.normal(keys[2], (groups, *down_shape)) / 3
    loss = lambda expected: jax.jit(jax.value_and_grad(
        lambda r, u, d: jnp.sum(jnp.sin(moe._ffn(r, sizes, u, d, spec, expected)) * probe), (0, 1, 2)))
    # bf16: the weights' gradients summed over the tiles in float32 and rounded once, within an ulp
    tolerance = dict(rtol=2e-2, atol=5e-2) if spec.compute else dict(rtol=1e-5, atol=1e-5)
    for want, got in zip(jax.tree.leaves(loss(None)(rows, up, down)), jax.tree.leaves(loss(32)(rows, up, down))):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tolerance)


def test_a_padded_buffer_runs_and_counts_only_the_items_holding_rows():
    """With `expected` rows the experts' FFN loop has a count known at run time (a while loop,
    not a scan over every item), its tiles sized for the rows held; FLOP counts take the items
    `expected` rows make: the forward's 2 GEMMs, the backward's 5 (the tile's up GEMM again)."""
    room, hidden, ffn, held = 1024, 16, 8, [40, 56]
    sizes, spec = jnp.array(held, jnp.int32), moe.ExpertsSpec(activation="gelu", gated=False)
    keys = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(keys[0], (room, hidden)), jax.random.normal(keys[1], (2, ffn, hidden)),
            jax.random.normal(keys[2], (2, hidden, ffn)))
    step = lambda expected: jax.make_jaxpr(jax.grad(
        lambda r, u, d: jnp.sum(moe._ffn(r, sizes, u, d, spec, expected) ** 2), (0, 1, 2)))(*args)
    every, padded = step(None), step(sum(held))
    assert "while" in str(padded) and "scan" not in str(padded) and "scan" in str(every)
    counted = flops.count(padded)
    assert counted.unknown_loops == 0
    assert counted.dot == (2 + 5) * 2 * sum(held) * hidden * ffn
    tile = gm.tile_rows(sum(held), 2)
    items = gm.expected_items(sum(held), 2, tile, room // tile)
    assert counted.ragged_dense == pytest.approx((2 + 5) * 2 * items * tile * hidden * ffn - counted.dot)
    assert counted.dot + counted.ragged_dense < (flops.count(every).dot + flops.count(every).ragged_dense) / 4
