"""step.report(): training state per device, the plan's notes, the largest whole tensors."""
import functools

import pytest
import torch
from torch import nn

import xtrain
from xtrain import plans


class Wide(nn.Module):
    """Every dimension divisible by 8: every tensor splits evenly over data=8."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(16, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x))))), y)


def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 16, generator=g), torch.randint(0, 8, (16,), generator=g)


PARAM_BYTES = (16 * 64 + 64 + 64 * 64 + 64 + 64 * 8 + 8) * 4


@functools.cache
def report(stage):
    torch.manual_seed(0)
    model = Wide()
    plan = plans.fsdp(model, xtrain.Mesh(data=8), min_size=1) if stage == 3 else plans.zero(stage)
    step = xtrain.compile(model, xtrain.Mesh(data=8), plan=plan,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    return step.report(*batch())


def adam_state(param_bytes):
    return 2 * param_bytes  # mu and nu; the step count is a few bytes more


@pytest.mark.e2e
def test_ddp_holds_everything_whole():
    state = report(0).state_memory
    assert state["parameters"] == state["gradients"] == PARAM_BYTES
    assert adam_state(PARAM_BYTES) <= state["optimizer"] <= adam_state(PARAM_BYTES) + 16


@pytest.mark.e2e
@pytest.mark.parametrize("stage, params, grads", [(1, 1, 1), (2, 1, 1 / 8), (3, 1 / 8, 1 / 8)])
def test_zero_stages_split_what_they_claim(stage, params, grads):
    state = report(stage).state_memory
    assert state["parameters"] == PARAM_BYTES * params
    assert state["gradients"] == PARAM_BYTES * grads
    assert adam_state(PARAM_BYTES) / 8 <= state["optimizer"] <= adam_state(PARAM_BYTES) / 8 + 16


@pytest.mark.e2e
def test_report_lists_plan_notes_and_largest_whole_tensors():
    ddp = report(0)
    assert [n for n, _ in ddp.largest_replicated][:2] == ["fc2.weight", "fc1.weight"]
    assert ddp.plan_notes == ["DDP: every parameter replicated, batch split over 'data'"]
    text = str(ddp)
    assert "training state per device (bytes): parameters=" in text
    assert "largest tensors whole on every device: fc2.weight (64, 64)" in text
    assert "plan: DDP: every parameter replicated" in text
    assert not any("layers)" in n for n in ddp.notes), ddp.notes  # no repeated blocks: no note on them
    rows = [line for line in text.splitlines() if line.startswith("all-reduce")]
    # sources clipped on the right: the op or scope that names them stays readable
    assert any(line.endswith("xtrain.grad_sync.bucket0[head.weight..fc1.bias]") for line in rows), rows
    assert any("  jvp(aten::nll_loss_forward)" in line for line in rows), rows
    fsdp = report(3)
    assert fsdp.largest_replicated == []
    assert any(n.startswith("FSDP: parameters split over data=8") for n in fsdp.plan_notes)


@pytest.mark.e2e
def test_memory_analysis_sits_next_to_state_bytes():
    rep = report(3)
    assert {"arguments", "outputs", "temporaries"} <= set(rep.memory)
    # the step's arguments hold at least the training state
    assert rep.memory["arguments"] >= sum(rep.state_memory[k] for k in ("parameters", "optimizer"))


@pytest.mark.unit
def test_hlo_tuple_all_reduce_counts_every_operand():
    from xtrain.lowering.report import collectives_from_hlo

    line = ("  %all-reduce.1 = (f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, f32[4]{0}, /*index=5*/f32[8,2]{1,0}) "
            "all-reduce(%a, %b, %c, %d, %e, %f), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add")
    [found] = collectives_from_hlo(line, {"data": 8})
    assert (found.kind, found.axes, found.payload_bytes) == ("all-reduce", ("data",), (5 * 4 + 16) * 4)


@pytest.mark.unit
def test_overlap_counts_only_independent_matmuls():
    """A collective overlaps the matmuls that neither feed it nor consume its result."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from xtrain.lowering import accounting

    mesh = jax.make_mesh((8,), ("data",))
    specs = [P("data"), P(), P(), P()]

    def per_device(x, w1, w2, w3):
        reduced = jax.lax.psum(x @ w1, "data")  # fed by x @ w1 (8x16x32 -> 2*8*16*32 FLOPs)
        side = x @ w2                           # independent: 2*8*16*64 FLOPs
        return (reduced @ w3).sum() + side.sum()  # reduced @ w3 consumes it

    f = jax.shard_map(per_device, mesh=mesh, in_specs=tuple(specs), out_specs=P(),
                      check_vma=False)
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=jax.sharding.NamedSharding(mesh, p))
              for s, p in zip([(64, 16), (16, 32), (16, 64), (32, 4)], specs)]
    (found,) = accounting.collectives(jax.make_jaxpr(f)(*shapes), {"data": 8})
    assert found.kind == "all-reduce" and found.overlap_flops == 2 * 8 * 16 * 64


@pytest.mark.e2e
def test_fsdp_gathers_can_hide_behind_other_layers_matmuls():
    rep = report(3)
    assert "overlap MFLOP" in str(rep)
    gathers = [c for c in rep.collectives if c.kind == "all-gather" and "fc2" in c.source]
    # fc2's weight gather needs nothing from fc1's matmul (batch 2 per device: 2*2*16*64 FLOPs)
    assert gathers and all(c.overlap_flops >= 2 * 2 * 16 * 64 for c in gathers), gathers
