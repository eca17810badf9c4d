"""Differential fuzzer of the explicit lowering's partition rules.

For each rule: random operand shapes and random valid layouts (splits over mesh axes, and
pending partial sums); the function run partitioned must equal the function run whole.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from xtrain.ir.kernels import moe
from xtrain.lowering import accounting
from xtrain.sharding.fallback import FallbackPolicy
from xtrain.lowering.explicit.check import run_partitioned
from xtrain.lowering.sharded import Layout
from xtrain.lowering.explicit.registry import RULES

import rule_cases
from xtrain import errors

SIZES = {"a": 2, "b": 4}
DIMS = (2, 4, 8, 6, 12)


@functools.cache
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))


def random_layout(rng, shape, partial_ok=True) -> Layout:
    """Each dim split by at most one unused axis that divides it; maybe a partial axis."""
    free, dims = list(SIZES), []
    for size in shape:
        options = [a for a in free if size % SIZES[a] == 0]
        axis = rng.choice(options + [None] * 2) if options else None
        dims.append((axis,) if axis else ())
        if axis:
            free.remove(axis)
    partial = (rng.choice(free),) if partial_ok and free and rng.random() < 0.3 else ()
    return Layout(tuple(dims), partial)


def rand_shape(rng, rank):
    return tuple(int(rng.choice(DIMS)) for _ in range(rank))


def check_many(cases, partial_ok=True, tol=1e-4):
    """Runs many (fn, args, rng) cases as one partitioned program (one compile), then
    compares each case's outputs with the whole computation."""
    fns, args, layouts, spans = [], [], [], []
    for fn, case_args, rng in cases:
        spans.append((len(args), len(args) + len(case_args)))
        fns.append(fn)
        args += case_args
        layouts += [random_layout(rng, np.shape(a), partial_ok and np.issubdtype(a.dtype, np.floating))
                    for a in case_args]

    def combined(*flat):
        return [jax.tree.leaves(f(*flat[lo:hi])) for f, (lo, hi) in zip(fns, spans)]

    got, found = run_partitioned(combined, args, layouts, mesh())
    want = combined(*args)
    got_iter = iter(got)
    for index, (outs, (lo, hi)) in enumerate(zip(want, spans)):
        for w in outs:
            np.testing.assert_allclose(next(got_iter), np.asarray(w), rtol=tol, atol=tol,
                                       err_msg=f"case {index}, layouts {[str(l) for l in layouts[lo:hi]]}")
    return found


def normal(rng, shape):
    return rng.normal(size=shape).astype(np.float32)


UNARY = [jnp.tanh, jnp.exp, jnp.negative, jax.nn.relu, jax.nn.sigmoid, lax.rsqrt, jnp.square,
         lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), lambda x: x ** 3, jax.lax.stop_gradient]
BINARY = [jnp.add, jnp.subtract, jnp.multiply, jnp.maximum, lambda x, y: x / (jnp.abs(y) + 1),
          lambda x, y: jnp.where(x > y, x, y)]


def case_unary(rng):
    x = normal(rng, rand_shape(rng, rng.integers(1, 4)))
    f = UNARY[rng.integers(len(UNARY))]
    if f is lax.rsqrt:
        x = np.abs(x) + 1
    return f, [x]


def case_binary(rng):
    shape = rand_shape(rng, rng.integers(1, 4))
    other = tuple(1 if rng.random() < 0.3 else s for s in shape)  # size-1 dims broadcast
    return BINARY[rng.integers(len(BINARY))], [normal(rng, shape), normal(rng, other)]


def case_reduce(rng):
    x = normal(rng, rand_shape(rng, rng.integers(1, 4)))
    axes = tuple(sorted(rng.choice(x.ndim, rng.integers(1, x.ndim + 1), replace=False).tolist()))
    reducer = [jnp.sum, jnp.max, jnp.min, jnp.mean][rng.integers(4)]
    if rng.random() < 0.2:
        return (lambda x: jnp.argmax(x, axis=axes[0])), [x]
    return (lambda x: reducer(x, axis=axes)), [x]


def _factor_pairs(n):
    return [(d, n // d) for d in range(1, n + 1) if n % d == 0]


def case_reshape(rng):
    shape = rand_shape(rng, rng.integers(2, 4))
    if rng.random() < 0.5:  # merge two neighbouring dims
        i = rng.integers(shape.__len__() - 1)
        new = shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:]
    else:  # split one dim
        i = rng.integers(len(shape))
        a, b = _factor_pairs(shape[i])[rng.integers(len(_factor_pairs(shape[i])))]
        new = shape[:i] + (a, b) + shape[i + 1:]
    return (lambda x: jnp.reshape(x, new) * 2), [normal(rng, shape)]


def case_transpose(rng):
    x = normal(rng, rand_shape(rng, rng.integers(2, 4)))
    perm = tuple(rng.permutation(x.ndim).tolist())
    return (lambda x: jnp.transpose(x, perm) + 1), [x]


def case_broadcast(rng):
    shape = rand_shape(rng, rng.integers(1, 3))
    lead = int(rng.choice(DIMS))
    return (lambda x: jnp.broadcast_to(x[None], (lead,) + shape) * 3), [normal(rng, shape)]


EINSUMS = ["ij,jk->ik", "bij,bjk->bik", "ij,kj->ik", "bti,io->bto", "ij,ij->i", "bhtd,bhsd->bhts", "i,i->"]


def _einsum_shapes(rng, spec):
    letters = {c: int(rng.choice(DIMS)) for c in set(spec) if c.isalpha()}
    ins = spec.split("->")[0].split(",")
    return [tuple(letters[c] for c in s) for s in ins]


def case_dot(rng):
    spec = EINSUMS[rng.integers(len(EINSUMS))]
    return (lambda x, y: jnp.einsum(spec, x, y)), [normal(rng, s) for s in _einsum_shapes(rng, spec)]


def case_conv(rng):
    groups = int(rng.choice([1, 1, 4, 8]))  # grouped and depthwise: their channels keep a split
    channels = 3 if groups == 1 else 8
    x = normal(rng, (int(rng.choice([2, 4, 8])), channels, 6, 6))
    w = normal(rng, (4 if groups == 1 else 8, channels // groups, 3, 3))
    return (lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                                  feature_group_count=groups)), [x, w]


def case_gather(rng):
    b, n = int(rng.choice(DIMS)), int(rng.choice(DIMS))
    if rng.random() < 0.5:  # embedding lookup
        table, idx = normal(rng, (n, 4)), rng.integers(0, n, size=(b, 2)).astype(np.int32)
        return (lambda t, i: jnp.take(t, i, axis=0)), [table, idx]
    logits, target = normal(rng, (b, n)), rng.integers(0, n, size=(b, 1)).astype(np.int32)
    return (lambda x, t: jnp.take_along_axis(x, t, axis=1)), [logits, target]


def case_scatter(rng):
    """Writes into rows (HF's shift of labels to decoder inputs), at the start, at a column."""
    b, n = int(rng.choice(DIMS)), int(rng.choice(DIMS[1:]))
    x, y = normal(rng, (b, n)), normal(rng, (b, n))
    ops = [
        lambda x, y: jnp.asarray(x).at[:, 1:].set(y[:, :-1]),
        lambda x, y: jnp.asarray(x).at[:, 0].set(y[:, 1]),
        lambda x, y: jnp.asarray(x).at[: b // 2].set(y[b // 2:]),
        lambda x, y: jnp.zeros_like(x).at[:, 1:].set(y[:, :-1]).at[:, 0].set(7.0),
    ]
    return ops[int(rng.integers(len(ops)))], [x, y]


def case_structural(rng):
    x = normal(rng, rand_shape(rng, 2))
    ops = [
        lambda x: jnp.concatenate([x, 2 * x], axis=1),
        lambda x: x[:, 1:],
        lambda x: jnp.pad(x, ((0, 0), (1, 2))),
        lambda x: lax.dynamic_slice(x, (0, 1), (x.shape[0], 1)),
        lambda x: jnp.cumsum(x, axis=1),
        lambda x: jnp.squeeze(x[:, :1], 1),
        lambda x: jax.nn.softmax(x, axis=-1),
        lambda x: jax.nn.logsumexp(x, axis=0),
    ]
    return ops[rng.integers(len(ops))], [x]


def case_call(rng):
    shape = rand_shape(rng, 2)
    inner = jax.jit(lambda x, y: jnp.tanh(x) @ y.T)
    return (lambda x, y: inner(x, y).sum(0)), [normal(rng, shape), normal(rng, shape)]


def case_loop(rng):
    shape = rand_shape(rng, 2)
    w = normal(rng, (shape[1], shape[1])) / shape[1]
    if rng.random() < 0.5:  # a scan carrying activations through a stacked weight
        ws = np.stack([w, 2 * w, -w])
        return (lambda x, ws: lax.scan(lambda h, m: (jnp.tanh(h @ m), h.sum(1)), x, ws)), [normal(rng, shape), ws]
    return (lambda x, w: lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + i, x)), [normal(rng, shape), w]


def _constraint(x, layout: Layout):
    spec = jax.P(*[(d if len(d) > 1 else d[0]) if d else None for d in layout.dims])
    return lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh(), spec))


def case_sharding_constraint(rng):
    """xtrain.shard's primitive: any layout to any layout; after a matmul whose contraction
    is split, the pending sum lands on the constraint's split dims (a reduce-scatter)."""
    if rng.random() < 0.5:
        x = normal(rng, rand_shape(rng, rng.integers(1, 4)))
        target = random_layout(rng, x.shape, partial_ok=False)
        return (lambda x: _constraint(x * 2, target) + 1), [x]
    m, k, n = (int(rng.choice(DIMS)) for _ in range(3))
    target = random_layout(rng, (m, n), partial_ok=False)
    return (lambda x, y: jnp.tanh(_constraint(x @ y, target))), [normal(rng, (m, k)), normal(rng, (k, n))]


@jax.custom_vjp
def scaled_tanh(x, w):
    """A custom_vjp op: tanh(x) * w with a hand-written backward."""
    return jnp.tanh(x) * w


def _scaled_tanh_fwd(x, w):
    y = jnp.tanh(x)
    return y * w, (y, w)


def _scaled_tanh_bwd(res, g):
    y, w = res
    return g * w * (1 - y * y), (g * y).reshape(-1, w.shape[0]).sum(0)


scaled_tanh.defvjp(_scaled_tanh_fwd, _scaled_tanh_bwd)


def case_custom_vjp(rng):
    shape = rand_shape(rng, 2)
    return (lambda x, w: scaled_tanh(x, w).sum(0)), [normal(rng, shape), normal(rng, shape[1:])]


def case_routing(rng):
    """Mixture-of-experts routing: top-k, sorts and argsorts, flips, grouped matmuls,
    histograms (scatter-add) and the routed-experts call (xtrain.ir.kernels.moe)."""
    kind = rng.integers(6)
    x = normal(rng, rand_shape(rng, rng.integers(1, 4)))
    axis = int(rng.integers(x.ndim))
    if kind == 0:
        return (lambda x: lax.top_k(x, 2)), [x]
    if kind == 1:
        return (lambda x: (jnp.sort(x, axis=axis), jnp.argsort(x, axis=axis, stable=True))), [x]
    if kind == 2:
        return (lambda x: jnp.flip(x, axis) * 2), [x]
    experts, rows, k = 4, int(rng.choice([8, 12])), int(rng.choice([2, 4]))
    if kind == 3:  # rows grouped by expert, some rows past the last group
        sizes = rng.multinomial(rows - 2, [0.25] * experts).astype(np.int32)
        return (lambda a, b, g: lax.ragged_dot(a, b, g)), [normal(rng, (rows, 6)), normal(rng, (experts, 6, k)), sizes]
    ids = rng.integers(0, experts, size=(rows, 2)).astype(np.int32)
    if kind == 4:
        return (lambda ids, u: (jnp.zeros(experts).at[ids.reshape(-1)].add(u.reshape(-1)),
                                jnp.zeros((experts, 2)).at[ids[:, 0]].add(u))), [ids, normal(rng, (rows, 2))]
    spec = moe.ExpertsSpec(activation="silu", gated=bool(rng.integers(2)), concatenated=bool(rng.integers(2)))
    ffn = 4 * (2 if spec.gated else 1)
    return (moe.traced_call(spec)), [normal(rng, (rows, 6)), ids, normal(rng, (rows, 2)),
                                     normal(rng, (experts, ffn, 6)), normal(rng, (experts, 6, 4))]


CASES = {"routing": case_routing, "custom_vjp": case_custom_vjp, "loop": case_loop, "unary": case_unary, "binary": case_binary, "reduce": case_reduce, "reshape": case_reshape,
         "transpose": case_transpose, "broadcast": case_broadcast, "dot_general": case_dot,
         "conv": case_conv, "gather": case_gather, "scatter": case_scatter, "structural": case_structural, "call": case_call,
         "sharding_constraint": case_sharding_constraint, **rule_cases.CASES}
PER_FAMILY = 32
MORE = {"routing": 96}  # six kinds of op, each wanting several random layouts
MORE.update({family: 8 for family in rule_cases.CASES})  # few kinds each; UNTOUCHED checks their splits


@pytest.mark.e2e
@pytest.mark.parametrize("family", CASES)
def test_rule_matches_whole_computation(family):
    cases = []
    for seed in range(MORE.get(family, PER_FAMILY)):
        rng = np.random.default_rng(seed)
        fn, args = CASES[family](rng)
        cases.append((fn, args, rng))
    check_many(cases)


def _spd(x):
    """A batch of symmetric positive definite matrices (cholesky's operand)."""
    return x @ jnp.swapaxes(x, -1, -2) + 4 * jnp.eye(x.shape[-1])


@pytest.mark.unit
def test_op_without_rule_runs_replicated_and_is_recorded():
    """cholesky (a factorization kept whole: no rule) on a batch-split operand: replicated when
    the policy allows it, an UnsupportedOpError naming it, its split and bytes otherwise."""
    x = normal(np.random.default_rng(0), (8, 3, 3))
    fn = lambda x: jnp.linalg.cholesky(_spd(x)) * 2
    split = Layout((("a",), (), ()))
    got, found = run_partitioned(fn, [x], [split], mesh())
    np.testing.assert_allclose(got[0], np.asarray(fn(x)), rtol=1e-5)
    assert "cholesky" in found.fallbacks and "cholesky" not in RULES and found.fallback_bytes["cholesky"] == 8 * 9 * 4
    with pytest.raises(errors.UnsupportedOpError, match=r"no partition rule for cholesky .*split \[a, -, -\].*288 bytes") as err:
        run_partitioned(fn, [x], [split], mesh(), fallback=FallbackPolicy())
    assert (err.value.primitive, err.value.splits, err.value.gathered_bytes) == ("cholesky", ((("a",), (), ()),), 288)
    assert isinstance(err.value, ValueError)


def _collectives_of(fn, args, dim: int, out_dim: int, axis: str = "a") -> list:
    """The collectives (lowering.report.Collective) the lowering emits for `fn` with args[0]
    split on `dim` over `axis` (the rest whole); checks the output keeps that split on `out_dim`."""
    from xtrain.lowering.context import Context
    from xtrain.lowering.sharded import Sharded
    from xtrain.lowering.explicit.interpreter import interpret

    closed = jax.make_jaxpr(fn)(*args)
    entry = lambda i, d: axis if i == 0 and d == dim else None
    layouts = [Layout(tuple((entry(i, d),) if entry(i, d) else () for d in range(np.ndim(a)))) for i, a in enumerate(args)]

    def per_device(*local):
        ins = [Sharded(v, l, np.shape(a), np.asarray(a).dtype) for v, l, a in zip(local, layouts, args)]
        (out,) = interpret(Context.of(SIZES, fallback=FallbackPolicy()), closed.jaxpr, closed.consts, ins)
        want = tuple((axis,) if d == out_dim else () for d in range(out.ndim))
        assert out.layout == Layout(want), (out.layout, want)
        return out.value

    in_specs = tuple(jax.P(*[entry(i, d) for d in range(np.ndim(a))]) for i, a in enumerate(args))
    program = jax.make_jaxpr(jax.shard_map(per_device, mesh=mesh(), in_specs=in_specs,
                                           out_specs=jax.P(*[None] * out_dim, axis), check_vma=False))(*args)
    return accounting.collectives(program, SIZES)


@pytest.mark.unit
@pytest.mark.parametrize("family", rule_cases.UNTOUCHED)
def test_split_on_an_untouched_dim_moves_nothing(family):
    """An operand split on a dimension the op does not touch keeps its split and moves nothing
    (a rule that gathered it would be a fallback in disguise); no fallback is taken either."""
    for index, (fn, args, dim, out_dim) in enumerate(rule_cases.UNTOUCHED[family]):
        assert [c.kind for c in _collectives_of(fn, args, dim, out_dim)] == [], f"{family} case {index}"


@pytest.mark.unit
@pytest.mark.parametrize("op", rule_cases.CUMULATIVE, ids=lambda op: op.__name__)
def test_cumulative_op_over_a_split_dim_gathers_only_block_totals(op):
    """A scan along the split dim: one all-gather of each block's totals (one row per shard:
    4 x 6 float32 = 96 bytes), not of the operand (192 bytes)."""
    x = normal(np.random.default_rng(0), (6, 8))
    found = _collectives_of(lambda x: op(x, axis=1), [x], 1, 1, axis="b")
    assert [(c.kind, c.payload_bytes) for c in found] == [("all-gather", 96)]


@pytest.mark.unit
def test_data_parallel_matmul_emits_no_collective_until_output():
    """Batch-split activations times a replicated weight stay local: the only collective is
    the final gather the checker itself asks for."""
    x, w = normal(np.random.default_rng(0), (8, 6)), normal(np.random.default_rng(1), (6, 4))
    closed = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(x, w)
    from xtrain.lowering.context import Context
    from xtrain.lowering.sharded import Sharded
    from xtrain.lowering.explicit.interpreter import interpret

    def per_device(x, w):
        ctx = Context.of(SIZES)
        (out,) = interpret(ctx, closed.jaxpr, closed.consts,
                           [Sharded(x, Layout((("a", "b"), ())), (8, 6), x.dtype), Sharded(w, Layout(((), ())), (6, 4), w.dtype)])
        assert out.layout == Layout((("a", "b"), ()))
        return out.value

    program = jax.make_jaxpr(jax.shard_map(per_device, mesh=mesh(), in_specs=(jax.P(("a", "b")), jax.P()),
                                           out_specs=jax.P(("a", "b")), check_vma=False))(x, w)
    assert not [e for e in program.jaxpr.eqns[0].params["jaxpr"].eqns if "psum" in str(e.primitive) or "gather" in str(e.primitive)]


@pytest.mark.unit
def test_pending_sum_onto_a_split_dim_is_one_reduce_scatter():
    """(m, k) @ (k, n) with k split over `a` leaves a partial sum; a constraint splitting m
    over `a` resolves it with psum_scatter, not psum + slice."""
    from xtrain.lowering.context import Context
    from xtrain.lowering.sharded import Sharded
    from xtrain.lowering.explicit.interpreter import interpret

    x, w = normal(np.random.default_rng(0), (8, 6)), normal(np.random.default_rng(1), (6, 4))
    closed = jax.make_jaxpr(lambda x, w: _constraint(x @ w, Layout((("a",), ()))))(x, w)

    def per_device(x, w):
        ins = [Sharded(x, Layout(((), ("a",))), (8, 6), x.dtype), Sharded(w, Layout((("a",), ())), (6, 4), w.dtype)]
        (out,) = interpret(Context.of(SIZES), closed.jaxpr, closed.consts, ins)
        assert out.layout == Layout((("a",), ()))
        return out.value

    program = jax.make_jaxpr(jax.shard_map(per_device, mesh=mesh(), in_specs=(jax.P(None, "a"), jax.P("a")),
                                           out_specs=jax.P("a"), check_vma=False))(x, w)
    prims = [str(e.primitive) for e in program.jaxpr.eqns[0].params["jaxpr"].eqns]
    assert "psum_scatter" in prims or "reduce_scatter" in prims, prims
    assert "psum" not in prims and "all_gather" not in prims, prims


@pytest.mark.unit
def test_a_shift_of_batch_split_rows_is_written_in_place():
    """HF's shift of labels into decoder inputs (a scatter into zeros) keeps the batch split."""
    rng = np.random.default_rng(0)
    x, y = normal(rng, (8, 6)), normal(rng, (8, 6))
    shift = lambda x, y: jnp.asarray(x).at[:, 1:].set(y[:, :-1])
    split = Layout((("a",), ()))
    got, found = run_partitioned(shift, [x, y], [split, split], mesh())
    np.testing.assert_array_equal(got[0], np.asarray(shift(x, y)))
    assert "scatter" not in found.fallbacks
