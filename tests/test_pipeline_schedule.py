"""Pipeline schedule tables and stage partitioning: properties asserted on the tables and on
costs measured from a traced model (no training; fast)."""
import jax
import pytest
import torch
from torch import nn

import xtrain
from xtrain.errors import PlanError
from xtrain.lowering.pipeline import partition, schedule
from xtrain.lowering.pipeline.executors import tick_tables
from xtrain.lowering.pipeline.schedule import Kind

pytestmark = pytest.mark.unit

CASES = [("gpipe", 2, 4, 1), ("gpipe", 4, 8, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 16, 1),
         ("1f1b", 4, 2, 1), ("interleaved", 2, 4, 2), ("interleaved", 4, 8, 2), ("interleaved", 4, 8, 3)]


def _when(table):
    """(kind, microbatch, virtual stage) -> tick; fails on a duplicate."""
    seen = {}
    for t, row in enumerate(table.ticks):
        for s, op in enumerate(row):
            if op is not None:
                key = (op.kind, op.microbatch, table.virtual_stage(s, op.chunk))
                assert key not in seen, f"{key} scheduled twice"
                seen[key] = t
    return seen


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_forward_and_backward_once_in_dependency_order(name, p, m, v):
    table = schedule.build(name, p, m, v)
    when = _when(table)
    vs = p * v
    assert len(when) == 2 * m * vs
    for i in range(m):
        for k in range(vs):
            f, b = when[(Kind.FORWARD, i, k)], when[(Kind.BACKWARD, i, k)]
            assert f < b
            if k:
                assert when[(Kind.FORWARD, i, k - 1)] < f
            if k < vs - 1:
                assert when[(Kind.BACKWARD, i, k + 1)] < b


@pytest.mark.parametrize("name,p,m", [("gpipe", 2, 4), ("gpipe", 4, 8), ("1f1b", 2, 4), ("1f1b", 4, 8),
                                      ("1f1b", 4, 16), ("1f1b", 3, 5)])
def test_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, p, m):
    table = schedule.build(name, p, m)
    assert table.bubble() == pytest.approx((p - 1) / (m + p - 1))
    assert len(table.ticks) == 2 * (m + p - 1)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4)])
def test_interleaved_bubble_is_smaller(p, m, v):
    assert schedule.build("interleaved", p, m, v).bubble() < (p - 1) / (m + p - 1)


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 16)])
def test_held_activations_1f1b_p_minus_s_gpipe_m(p, m):
    one_f_one_b, gpipe = schedule.build("1f1b", p, m), schedule.build("gpipe", p, m)
    assert [one_f_one_b.held(s) for s in range(p)] == [p - s for s in range(p)]
    assert [gpipe.held(s) for s in range(p)] == [m] * p


def test_1f1b_warmup_is_min_p_minus_s_minus_1_and_m():
    for p, m in [(4, 8), (4, 2)]:
        table = schedule.build("1f1b", p, m)
        for s in range(p):
            ops = [row[s] for row in table.ticks if row[s] is not None]
            first_b = next(k for k, op in enumerate(ops) if op.kind == Kind.BACKWARD)
            assert first_b == min(p - s - 1, m) + (1 if m > p - s - 1 else 0)


def test_executor_buffers_do_not_grow_with_microbatches():
    assert tick_tables(schedule.build("1f1b", 4, 8)).slots == tick_tables(schedule.build("1f1b", 4, 32)).slots
    assert tick_tables(schedule.build("interleaved", 4, 8, 2)).slots == \
        tick_tables(schedule.build("interleaved", 4, 32, 2)).slots


def test_schedule_table_prints():
    text = str(schedule.build("1f1b", 2, 4))
    assert "bubble 20.0%" in text and "stage 1:" in text and "B3" in text


# -- partitioning -----------------------------------------------------------------------------

class Wide(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Unequal(nn.Module):
    """Layers of very different cost (hidden widths 16 .. 512)."""

    def __init__(self, widths=(16, 512, 32, 64, 256, 16, 128, 32)):
        super().__init__()
        self.blocks = nn.ModuleList(Wide(32, w) for w in widths)
        self.head = nn.Linear(32, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


def _traced_costs(model, batch):
    from xtrain.frontend.torch_module import TorchModel

    wrapped = TorchModel(model)
    params = wrapped.initial_params()
    key = jax.random.key_data(jax.random.key(0))
    closed = jax.make_jaxpr(lambda p, k, b: wrapped.apply(p, {}, k, b, training=True))(params, key, batch)
    return partition.layer_costs(closed.jaxpr, wrapped.module_paths(), closed.jaxpr.invars[:len(params)])


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_auto_split_of_unequal_layers_is_within_one_layer_of_ideal(stages):
    batch = (torch.randn(64, 32).numpy(), torch.randint(0, 4, (64,)).numpy())
    costs = _traced_costs(Unequal(), batch)
    assert [p for p, _ in costs] == [f"blocks.{k}" for k in range(8)]
    times = [c.time for _, c in costs]
    assert max(times) > 10 * min(times)  # measured, not counted: the 512-wide layer dominates
    starts = partition.balance(times, stages)
    bounds = starts + [len(times)]
    loads = [sum(times[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert all(b > a for a, b in zip(bounds, bounds[1:]))
    assert max(loads) <= sum(times) / stages + max(times)
    # and it is the best contiguous split: no other split of these costs has a smaller maximum
    import itertools
    best = min(max(sum(times[a:b]) for a, b in zip((0,) + c, c + (len(times),)))
               for c in itertools.combinations(range(1, len(times)), stages - 1))
    assert max(loads) == pytest.approx(best)


def test_flops_of_a_matmul_layer():
    batch = (torch.randn(64, 32).numpy(), torch.randint(0, 4, (64,)).numpy())
    (_, cost), *_ = _traced_costs(Unequal(widths=(16, 16)), batch)
    assert cost.flops >= 2 * 2 * 64 * 32 * 16  # two matmuls of 64 x 32 x 16
    assert cost.param_bytes == 4 * (32 * 16 + 16 + 16 * 32 + 32)


# -- configuration errors -------------------------------------------------------------------

def test_interleaved_needs_microbatches_divisible_by_stages():
    with pytest.raises(PlanError, match=r"microbatches=6 is not divisible by stages=4; use a multiple of 4"):
        xtrain.Plan().with_pipeline(stages=4, microbatches=6, schedule="interleaved", virtual_stages=2)


def test_pipeline_config_errors_name_the_field():
    with pytest.raises(PlanError, match=r"schedule='zigzag'"):
        xtrain.Plan().with_pipeline(stages=2, microbatches=4, schedule="zigzag")
    with pytest.raises(PlanError, match=r"virtual_stages=2\) needs schedule='interleaved'"):
        xtrain.Plan().with_pipeline(stages=2, microbatches=4, virtual_stages=2)
    with pytest.raises(PlanError, match=r"names 1 cut points; 4 stages need 3"):
        xtrain.Plan().with_pipeline(stages=4, microbatches=4, split=["blocks.2"])
