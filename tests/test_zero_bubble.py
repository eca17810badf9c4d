"""Zero-bubble pipelines: the zbh1 table (every F, B and W once, in dependency order, W's in
1F1B's bubbles), durations and the lockstep bubble of every schedule, the backward split into B
and W without doing work twice, the dependence analysis that decides which residuals a stage
keeps, and the refusal on Trainium; the zbv table (two chunks per stage as a V). The training parity
of zbh1 and zbv is in test_zero_bubble_parity.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import xtrain
from xtrain.errors import PlanError
from xtrain.ir.analysis import depends, flops
from xtrain.lowering.pipeline import schedule
from xtrain.lowering.pipeline.executors import tick_tables
from xtrain.lowering.pipeline.schedule import Kind
from xtrain.lowering.pipeline.split_backward import SplitBackward

pytestmark = pytest.mark.unit

SIZES = [(2, 4), (4, 8), (4, 16), (3, 5), (8, 16), (4, 2), (4, 1)]


def _when(table):
    seen = {}
    for t, row in enumerate(table.ticks):
        for s, op in enumerate(row):
            if op is not None:
                key = (op.kind, op.microbatch, s)
                assert key not in seen, f"{key} scheduled twice"
                seen[key] = t
    return seen


@pytest.mark.parametrize("p,m", SIZES)
def test_zbh1_runs_every_f_b_w_once_in_dependency_order(p, m):
    table = schedule.build("zbh1", p, m)
    when = _when(table)
    assert len(when) == 3 * m * p
    for i in range(m):
        for s in range(p):
            f, b, w = (when[(k, i, s)] for k in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT))
            assert f < b < w
            if s:
                assert when[(Kind.FORWARD, i, s - 1)] < f
            if s < p - 1:
                assert when[(Kind.BACKWARD, i, s + 1)] < b


@pytest.mark.parametrize("p,m", SIZES)
def test_zbv_runs_every_f_b_w_once_per_virtual_stage_down_the_v_and_back(p, m):
    """zbv: stage s runs virtual stages s (chunk 0) and 2p - 1 - s (chunk 1); every F, B and W of
    every (microbatch, virtual stage) once, F's in order down the V and back up, B's the reverse,
    W after its B; at most 2p chunk activations held (1F1B's first-stage peak, in half-stage units);
    a bubble below zbh1's. The tick tables deliver each activation and cotangent to the stage of the
    next virtual stage: over the ring one way for chunk 0, the other way for chunk 1, and without a
    send at the turn (the last stage's chunk 0 to its chunk 1), into slots of one pool per stage."""
    table = schedule.build("zbv", p, m)
    assert table.chunks == 2 and table.place(0) == (0, 0) and table.place(2 * p - 1) == (0, 1)
    assert table.place(p - 1) == table.place(p)[:1] + (0,) and table.place(p) == (p - 1, 1)
    from test_pipeline_schedule import _when as by_virtual_stage

    when = by_virtual_stage(table)
    assert len(when) == 3 * m * 2 * p
    for i in range(m):
        for vs in range(2 * p):
            f, b, w = (when[(k, i, vs)] for k in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT))
            assert f < b < w
            assert vs == 0 or when[(Kind.FORWARD, i, vs - 1)] < f
            assert vs == 2 * p - 1 or when[(Kind.BACKWARD, i, vs + 1)] < b
    assert max(table.held(s) for s in range(p)) <= 2 * p
    assert table.bubble() < schedule.build("zbh1", p, m).bubble()
    _check_deliveries(table)


def _check_deliveries(table):
    """The executor's data flow on tokens: each tick a stage's F output ("act", microbatch, next
    virtual stage) or B output ("cot", microbatch, previous one) goes around the ring both ways
    (one way for 2 stages) and stays on the stage; the tick tables' entries store them in the
    stage's slots; then every F, B and W (but the first virtual stage's) finds its own activation
    in its slot, and every B and W (but the last virtual stage's) its own cotangent."""
    tables = tick_tables(table)
    p, last = table.stages, table.virtual_stages - 1
    inputs, cotangents = [{} for _ in range(p)], [{} for _ in range(p)]
    for t, row in enumerate(table.ticks):
        out = [None] * p
        for s, op in enumerate(row):
            if op is None:
                continue
            vs, slot = table.virtual_stage(s, op.chunk), tables.pool[t, s]
            if vs:  # the first virtual stage's input is the prologue's, not a buffer's
                assert inputs[s].get(slot) == ("act", op.microbatch, vs), (t, s, str(op))
            if op.kind != Kind.FORWARD and vs != last:
                assert cotangents[s].get(slot) == ("cot", op.microbatch, vs), (t, s, str(op))
            if op.kind == Kind.FORWARD:
                out[s] = ("act", op.microbatch, vs + 1)
            elif op.kind == Kind.BACKWARD:
                out[s] = ("cot", op.microbatch, vs - 1)
        for s in range(p):
            left, right, own = out[(s - 1) % p], out[(s + 1) % p], out[s]
            arrivals = [(tables.act_in[t, s], left, inputs), (tables.grad_in[t, s], right, cotangents)]
            if tables.turned is not None:
                arrivals += [(tables.turned[t, s, 0], right, inputs), (tables.turned[t, s, 1], own, inputs),
                             (tables.turned[t, s, 2], left, cotangents), (tables.turned[t, s, 3], own, cotangents)]
            for (ok, _, slot), token, buffers in arrivals:
                if ok:
                    buffers[s][slot] = token


@pytest.mark.parametrize("p,m", SIZES)
def test_zbh1_tick_tables_deliver_every_input_to_its_slot(p, m):
    _check_deliveries(schedule.build("zbh1", p, m))


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (3, 5)])
def test_zbh1_reaches_the_zero_bubble_length_and_holds_at_most_p_plus_1(p, m):
    """3m + p - 1 unit ticks (F = B = W = 1): the bubble is only the warm-up's p - 1 ticks,
    against 1F1B's p - 1 ticks of F + B + W."""
    table, one_f_one_b = schedule.build("zbh1", p, m), schedule.build("1f1b", p, m)
    assert len(table.ticks) == table.time() == 3 * m + p - 1
    assert table.bubble() == pytest.approx((p - 1) / (3 * m + p - 1))
    assert table.bubble() < 0.6 * one_f_one_b.bubble()
    assert max(table.held(s) for s in range(p)) <= p + 1
    assert max(table.held(s) for s in range(p)) <= max(one_f_one_b.held(s) for s in range(p)) + 1


def test_zbv_virtual_stages_are_checked():
    assert xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule="zbv").pipeline.virtual_stages == 2
    with pytest.raises(PlanError, match="zbv lays two chunks per stage"):
        xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule="zbv", virtual_stages=3)


def test_durations_a_whole_backward_lasts_two():
    """F = B = W = 1 and a combined backward 2: GPipe's and 1F1B's time is 3(m + p - 1) units
    and their bubble (p - 1) / (m + p - 1), zbh1's 3m + p - 1 units."""
    p, m = 4, 8
    for name in ("gpipe", "1f1b"):
        table = schedule.build(name, p, m)
        assert table.duration(schedule.Op(Kind.BACKWARD, 0)) == 2
        assert table.time() == 3 * (m + p - 1) and table.bubble() == pytest.approx((p - 1) / (m + p - 1))
    zero = schedule.build("zbh1", p, m)
    assert [zero.duration(schedule.Op(k, 0)) for k in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT)] == [1, 1, 1]


def test_zbh1_prints_its_w_entries_and_buffers_stay_flat():
    text = str(schedule.build("zbh1", 2, 4))
    assert "W3" in text and "bubble 7.7%" in text
    assert tick_tables(schedule.build("zbh1", 4, 8)).slots == tick_tables(schedule.build("zbh1", 4, 32)).slots


# -- which residuals depend on the microbatch -------------------------------------------------

def test_dependence_follows_scans_and_calls():
    def f(w, x):
        wt = w.T * 2.0                                          # the weights alone
        y, per_layer = lax.scan(lambda h, _: (jnp.tanh(h @ wt), h.sum()), x, None, length=3)
        cast = jax.jit(lambda a: a.astype(jnp.bfloat16))(w)     # a call of the weights alone
        return wt, y, per_layer, cast, w

    closed = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert depends.outputs(closed, [False, True]) == [False, True, True, False, False]
    assert depends.outputs(closed, [True, False]) == [True, True, True, True, True]


# -- B and W: the backward cut in two ----------------------------------------------------------

def _layers(ws, x):
    def layer(h, w):
        return jnp.tanh(h @ w["a"]) @ w["b"] + h, None

    return lax.scan(layer, x, ws)[0].sum()


def test_split_backward_equals_the_whole_backward_and_does_no_work_twice():
    L, d, n = 3, 8, 16
    keys = jax.random.split(jax.random.key(0), 3)
    ws = {"a": jax.random.normal(keys[0], (L, d, 2 * d)), "b": jax.random.normal(keys[1], (L, 2 * d, d)) / 4}
    x = jax.random.normal(keys[2], (n, d))
    _, pull = jax.vjp(_layers, ws, x)
    leaves = jax.tree.leaves(pull)
    tree = jax.tree.structure(pull)

    def backward(res, ct):
        dw, dx = jax.tree.unflatten(tree, res)(ct)
        return dx, dw

    closed = jax.make_jaxpr(backward)(leaves, jnp.float32(1.0))
    split = SplitBackward(closed, [True] + [False] * (len(closed.out_avals) - 1))
    (dx,), edge = split.b(*leaves, jnp.float32(1.0))
    dw = split.w(edge, *leaves, jnp.float32(1.0))
    want_dw, want_dx = pull(jnp.float32(1.0))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6)
    for got, want in zip(dw, jax.tree.leaves(want_dw)):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # matmul FLOPs: B + W = the whole backward; W holds only the weight-gradient matmuls
    whole = flops.count(closed).matmul
    b_flops = flops.count(jax.make_jaxpr(lambda *a: split.b(*a))(*leaves, jnp.float32(1.0))).matmul
    w_flops = flops.count(jax.make_jaxpr(lambda e, *a: split.w(e, *a))(edge, *leaves, jnp.float32(1.0))).matmul
    weight_grads = L * 2 * (2 * n * d * 2 * d)  # dA and dB per layer
    assert w_flops == weight_grads and b_flops + w_flops == whole


@pytest.mark.parametrize("name", ["zbh1", "zbv"])
def test_zero_bubble_is_refused_for_trainium(name):
    import torch

    from models import GPT
    from xtrain.cost.program import abstract_step, trainable_of
    from xtrain.frontend.torch_module import wrap

    model = GPT(layers=4)
    wrapped = wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    batch = (np.zeros((8, 16), np.int32),) * 2
    plan = xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule=name)
    with pytest.raises(PlanError, match=f"{name}.*Trainium.*1f1b"):
        abstract_step(trainable_of(wrapped.model, wrapped.tx), {"pipe": 2}, plan, batch, platform="neuron")
