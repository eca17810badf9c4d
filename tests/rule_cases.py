"""Fuzz families of the partition rules added for issue 34 (test_partition_rules.py runs them):
complex arithmetic, bit tricks, pooling and its gradient, cond, dynamic_update_slice, variadic
and associative reductions, cumulative ops, FFTs, scatters with every combiner, stack/tile.

`UNTOUCHED` lists, per family, ops with an operand split on a dimension the op does not touch:
test_partition_rules checks that they emit no collective and keep the split."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

DIMS = (2, 4, 8, 6, 12)


def normal(rng, shape):
    return rng.normal(size=shape).astype(np.float32)


def _shape(rng, rank):
    return tuple(int(rng.choice(DIMS)) for _ in range(rank))


def case_complex(rng):
    x, y = normal(rng, _shape(rng, 2)), None
    y = normal(rng, x.shape)
    ops = [lambda x, y: jnp.real(lax.complex(x, y) * lax.complex(y, -x)),
           lambda x, y: jnp.imag(jnp.conj(lax.complex(x, y)) * lax.complex(x, x)),
           lambda x, y: jnp.abs(lax.complex(x, y)) + jnp.angle(lax.complex(y, x))]
    return ops[rng.integers(len(ops))], [x, y]


def case_bits(rng):
    x = rng.integers(-2 ** 30, 2 ** 30, size=_shape(rng, 2)).astype(np.int32)
    axis = int(rng.integers(2))
    # (mulhi has its rule, checked in UNTOUCHED; JAX 0.10 cannot lower it inside shard_map on CPU)
    ops = [lambda x: lax.clz(x) + lax.shift_right_arithmetic(x, 3),
           lambda x: lax.bitcast_convert_type(x, jnp.float32) * 0 + lax.bitcast_convert_type(x, jnp.uint32).astype(jnp.float32),
           lambda x: lax.bitcast_convert_type(x, jnp.int8).astype(jnp.int32).sum(-1),
           lambda x: lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int16), jnp.int32),
           lambda x: lax.reduce_xor_p.bind(x, axes=(axis,)),
           lambda x: ((x > 0).all(axis), (x > 0).any(axis), jnp.prod(jnp.sign(x), axis))]
    return ops[rng.integers(len(ops))], [x]


def maxpool(x, k=2):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, k, k), (1, 1, k, k), "VALID")


def avgpool(x, k=2):
    return lax.reduce_window(x, 0.0, lax.add, (1, 1, k, k), (1, 1, 1, 1), ((0, 0), (0, 0), (1, 0), (0, 1))) / k ** 2


def case_pooling(rng):
    x = normal(rng, (int(rng.choice([2, 4, 8])), int(rng.choice([2, 4])), 4, 6))
    ops = [maxpool, avgpool, lambda x: -lax.reduce_window(-x, jnp.inf, lax.min, (1, 1, 3, 1), (1, 1, 1, 1), "SAME"),
           jax.grad(lambda x: (maxpool(x) ** 2).sum()),
           lambda x: jax.jvp(maxpool, (x,), (x * 2,))[1]]
    return ops[rng.integers(len(ops))], [x]


def case_cond(rng):
    x = normal(rng, _shape(rng, 2))
    w = normal(rng, (x.shape[1], x.shape[1]))
    flag = np.float32(rng.choice([-1.0, 1.0]))
    return (lambda p, x, w: lax.cond(p > 0, lambda x: jnp.tanh(x @ w), lambda x: x.sum(0) * x, x)), [flag, x, w]


def case_update(rng):
    x = normal(rng, _shape(rng, 2))
    k = int(rng.integers(1, x.shape[1] + 1))
    start = int(rng.integers(0, x.shape[1] - k + 1))
    return (lambda x, u: lax.dynamic_update_slice(x, u[:, :k] * 2, (0, start))), [x, normal(rng, x.shape)]


def _argmax_pair(x, axis):
    idx = lax.broadcasted_iota(jnp.int32, x.shape, axis)

    def pick(a, b):
        take = a[0] >= b[0]
        return jnp.where(take, a[0], b[0]), jnp.where(take, a[1], b[1])

    return lax.reduce((x, idx), (-jnp.inf, 0), pick, (axis,))


def case_variadic_reduce(rng):
    x = normal(rng, _shape(rng, 2))
    axis = int(rng.integers(2))
    return (lambda x: _argmax_pair(x, axis)), [x]


CUMULATIVE = [jnp.cumsum, jnp.cumprod, lax.cummax, lax.cummin, lax.cumlogsumexp]


def case_cumulative(rng):
    x = normal(rng, _shape(rng, 2))
    axis, reverse = int(rng.integers(2)), bool(rng.integers(2))
    op = CUMULATIVE[rng.integers(len(CUMULATIVE))]
    if op in (jnp.cumsum, jnp.cumprod):
        x = (1 + 0.05 * x) if op is jnp.cumprod else x
        return (lambda x: op(x[::-1] if reverse else x, axis=axis)), [x]
    return (lambda x: op(x, axis=axis, reverse=reverse)), [x]


def case_fft(rng):
    x = normal(rng, _shape(rng, 2))
    ops = [lambda x: jnp.real(jnp.fft.fft(x, axis=-1)), lambda x: jnp.fft.irfft(jnp.fft.rfft(x, axis=-1), x.shape[-1]),
           lambda x: jnp.real(jnp.fft.fft2(x[None]))[0]]
    return ops[rng.integers(len(ops))], [x]


_DN = lax.ScatterDimensionNumbers(update_window_dims=(0,), inserted_window_dims=(1,), scatter_dims_to_operand_dims=(1,))


def case_scatter_combiners(rng):
    x, y = normal(rng, _shape(rng, 2)), None
    y = normal(rng, x.shape)
    col = int(rng.integers(x.shape[1]))
    rows = rng.integers(0, x.shape[0], size=(2,)).astype(np.int32)
    x_ = jnp.asarray
    ops = [lambda x, y: x_(x).at[:, col].multiply(y[:, 0]), lambda x, y: x_(x).at[:, col].min(y[:, 1 % y.shape[1]]),
           lambda x, y: x_(x).at[:, col].max(y[:, 0]),
           lambda x, y: lax.scatter_sub(x, jnp.array([[col]]), y[:, :1], _DN),
           lambda x, y: x_(x).at[rows].set(0.0) + y,  # an embedding's padding row zeroed
           lambda x, y: jnp.zeros_like(x).at[rows].add(y[:2]) * x]
    return ops[rng.integers(len(ops))], [x, y]


def case_stack(rng):
    x = normal(rng, _shape(rng, 2))
    ops = [lambda x: jnp.stack([-x[:, 1::2], x[:, ::2]], -1).reshape(x.shape[0], -1) if x.shape[1] % 2 == 0 else x,
           lambda x: jnp.stack([x, x * 2, x * 3], 1), lambda x: sum(jnp.unstack(x, axis=1)),
           lambda x: jnp.tile(x, (1, 2)), lambda x: jnp.tile(x, (2, 1)),
           lambda x: lax.optimization_barrier((x * 2, x + 1))]
    return ops[rng.integers(len(ops))], [x]


def merged_scores(x, bias):
    """Attention over batch x heads merged into one dim, as Bloom's baddbmm: (B, H, T, D) ->
    (B*H, T, D), scores plus a (B*H, 1, T) bias, back to (B, H, T, T)."""
    b, h, t, d = x.shape
    m = x.reshape(b * h, t, d)
    scores = lax.dot_general(m, m, (((2,), (2,)), ((0,), (0,)))) + bias
    return jax.nn.softmax(scores.reshape(b, h, t, t), -1)


def case_merged(rng):
    b, h = int(rng.choice([2, 4, 8])), int(rng.choice([2, 4, 8]))
    return merged_scores, [normal(rng, (b, h, 3, 2)), normal(rng, (b * h, 1, 3))]


CASES = {"complex": case_complex, "bits": case_bits, "pooling": case_pooling, "cond": case_cond,
         "dynamic_update_slice": case_update, "variadic_reduce": case_variadic_reduce, "cumulative": case_cumulative,
         "fft": case_fft, "scatter_combiners": case_scatter_combiners, "stack_tile": case_stack,
         "merged_heads": case_merged}

_ROWS = np.array([0, 3], np.int32)
_I = np.arange(48, dtype=np.int32).reshape(8, 6) * 977


def _f(shape=(8, 6)):
    return np.random.default_rng(0).normal(size=shape).astype(np.float32)


def depthwise(x, w=_f((8, 1, 3))):
    """A state-space mixer's short convolution: one group per channel, (batch, channels, length)."""
    return lax.conv_general_dilated(x, w, (1,), [(2, 0)], feature_group_count=8)


# family -> [(fn, args, split dim of args[0] (over "a"), the output dim that keeps it)]
UNTOUCHED = {
    "merged_heads": [(merged_scores, [_f((4, 8, 3, 2)), _f((32, 1, 3))], 1, 1),
                     (lambda x: (x.reshape(32, 3, 2) * jnp.arange(32.0)[:, None, None]).reshape(4, 8, 3, 2),
                      [_f((4, 8, 3, 2))], 1, 1)],
    "grouped_conv": [(depthwise, [_f((2, 8, 6))], 1, 1), (depthwise, [_f((4, 8, 6))], 0, 0),
                     (jax.grad(lambda x: (depthwise(x) ** 2).sum()), [_f((2, 8, 6))], 1, 1)],
    "complex": [(lambda x: jnp.real(lax.complex(x, x * 2) * jnp.conj(lax.complex(x, -x))), [_f()], 0, 0)],
    "bits": [(lambda x: lax.clz(x) + lax.mulhi(x, x), [_I], 0, 0),
             (lambda x: lax.bitcast_convert_type(x, jnp.int8), [_I], 0, 0),
             (lambda x: lax.reduce_xor_p.bind(x, axes=(1,)), [_I], 0, 0)],
    "pooling": [(maxpool, [_f((8, 2, 4, 4))], 0, 0), (avgpool, [_f((2, 8, 4, 4))], 1, 1),
                (jax.grad(lambda x: maxpool(x).sum()), [_f((8, 2, 4, 4))], 0, 0)],
    "cond": [(lambda x, p: lax.cond(p > 0, lambda x: x * 2, jnp.sin, x), [_f(), np.float32(1)], 0, 0)],
    "dynamic_update_slice": [(lambda x: lax.dynamic_update_slice(x, x[:, :2] * 3, (0, 3)), [_f()], 0, 0)],
    "variadic_reduce": [(lambda x: _argmax_pair(x, 1)[1], [_f()], 0, 0),
                        (lambda x: jnp.prod(x, 1) + jnp.max(x, 1), [_f()], 0, 0)],
    "cumulative": [(lambda x: op(x, axis=1), [_f()], 0, 0) for op in CUMULATIVE],
    "fft": [(lambda x: jnp.real(jnp.fft.fft(x, axis=-1)), [_f()], 0, 0)],
    "scatter_combiners": [(lambda x: jnp.asarray(x).at[:, 2].multiply(x[:, 0]).at[:, 1].max(x[:, 3]), [_f()], 0, 0),
                          (lambda x: jnp.asarray(x).at[_ROWS].set(0.0), [_f((16, 8))], 0, 0),
                          (lambda x: lax.scatter_sub(x, jnp.array([[2]]), x[:, :1], _DN), [_f()], 0, 0)],
    "stack_tile": [(lambda x: jnp.stack([-x[:, 1::2], x[:, ::2]], -1).reshape(8, 6), [_f()], 0, 0),
                   (lambda x: jnp.tile(x, (1, 3)), [_f()], 0, 0),
                   (lambda x: sum(jnp.unstack(x, axis=1)), [_f()], 0, 0)],
}
