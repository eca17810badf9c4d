"""The explicit lowering's interpreter state split in three: frozen options, a cursor moved only
by context managers, and findings returned with the program (StepProgram.findings), which the
report reads instead of a strategy's trace leftovers."""
import dataclasses

import jax
import numpy as np
import pytest
import torch
from jax import lax
from torch import nn

import xtrain
from xtrain.lowering.context import Context, Cursor, LoweringOptions
from xtrain.lowering.explicit import rules  # noqa: F401  (registers the partition rules)
from xtrain.lowering.explicit.interpreter import interpret
from xtrain.lowering.findings import Findings, Record, collected
from xtrain.lowering.sharded import Layout, Sharded
from xtrain.sharding.fallback import FallbackPolicy

from models import mlp_batches

SIZES = {"a": 2, "b": 4}


@pytest.mark.unit
def test_the_cursor_moves_only_inside_its_blocks_and_comes_back_after_an_error():
    cursor = Cursor()
    with cursor.at("blocks.0"), cursor.in_layer(("blocks.0", "blocks.3")):
        assert (cursor.path, cursor.layer) == ("blocks.0", ("blocks.0", "blocks.3"))
        with pytest.raises(RuntimeError), cursor.at("blocks.0.mlp"):
            raise RuntimeError("a rule failed")
        assert cursor.path == "blocks.0"
    assert (cursor.path, cursor.layer) == ("", None)
    cursor.memo["key"] = "outer conversion"
    with cursor.fresh_memo():
        assert cursor.memo == {}
        cursor.memo["key"] = "inner conversion"
    assert cursor.memo == {"key": "outer conversion"}


@pytest.mark.unit
def test_context_and_options_are_frozen_and_a_derivative_rule_gets_a_new_context():
    ctx = Context.of(SIZES, remat="remat policy stand-in")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.path = "blocks.0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.options.unroll = True
    with pytest.raises(TypeError):
        ctx.sizes["a"] = 4  # a read-only view of the mesh sizes
    inner = ctx.in_derivative_rule()
    assert (inner.remat, ctx.remat) == (None, "remat policy stand-in")
    assert (inner.options.derivative_rule, ctx.options.derivative_rule) == (True, False)
    assert inner.cursor is ctx.cursor and inner.record is ctx.record  # the same interpretation
    with ctx.cursor.at("blocks.1"):
        inner.note_fallback("sort")
    assert collected([ctx.record]).fallbacks == {"sort": ("blocks.1",)}


@pytest.mark.unit
def test_records_collect_into_findings_in_order_once():
    first, second = Record(), Record()
    first.note("ring attention in 'blocks.0'")
    first.fallback("bessel_i0e", "")
    first.count("expert_tokens", "moe.1", value=None)
    second.note("ring attention in 'blocks.0'")
    second.note("capacity_factor=1.25 in 'moe.1'")
    second.fallback("bessel_i0e", "blocks.1")
    second.count("expert_tokens", "moe.0", value=None)
    found = collected([first, second], block_notes=("blocks: one family",))
    assert found.notes == ("ring attention in 'blocks.0'", "capacity_factor=1.25 in 'moe.1'")
    assert dict(found.fallbacks) == {"bessel_i0e": ("<top level>", "blocks.1")}
    assert found.counts == (("expert_tokens", "moe.1"), ("expert_tokens", "moe.0"))
    assert found.report_notes() == [
        "no partition rule for bessel_i0e: gathered and run replicated in ['<top level>', 'blocks.1']",
        "blocks: one family", "ring attention in 'blocks.0'", "capacity_factor=1.25 in 'moe.1'"]
    assert Findings().report_notes() == []


@pytest.mark.unit
def test_a_fallback_is_recorded_under_the_module_it_runs_in():
    """The interpreter attributes each equation to its module (named scopes in the jaxpr) through
    the cursor; a fallback lands in the record under that path."""
    def fn(x):
        with jax.named_scope("net.act"):
            return lax.linalg.cholesky(x @ x.transpose(0, 2, 1) + 4 * np.eye(3, dtype=np.float32)) * 2

    x = np.linspace(-1, 1, 72, dtype=np.float32).reshape(8, 3, 3)
    closed = jax.make_jaxpr(fn)(x)
    ctx = Context(LoweringOptions(sizes=SIZES, module_paths=frozenset({"net", "net.act"}),
                                  fallback=FallbackPolicy(modules=("net.*",))))

    def per_device(x):
        (out,) = interpret(ctx, closed.jaxpr, closed.consts, [Sharded(x, Layout((("a",), (), ())), (8, 3, 3), x.dtype)])
        return out.value

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("a", "b"))
    jax.make_jaxpr(jax.shard_map(per_device, mesh=mesh, in_specs=jax.P("a"), out_specs=jax.P(), check_vma=False))(x)
    assert collected([ctx.record]).fallbacks == {"cholesky": ("net.act",)}
    assert ctx.path == "" and ctx.cursor.memo == {}  # the interpretation left the cursor where it found it


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, h):
        g = torch.tanh(self.fc(h))
        m = g.reshape(-1, 3, 4)
        spd = m @ m.transpose(1, 2) + torch.diag_embed(torch.full_like(m[..., 0], 4.0))
        return g + torch.linalg.cholesky(spd).sum((1, 2))[:, None]  # cholesky: no partition rule


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(12, 5)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


@pytest.mark.e2e
def test_a_step_returns_its_findings_and_the_report_reads_them():
    torch.manual_seed(0)
    model, batches = Blocks(), mlp_batches(n=1)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          plan=xtrain.Plan(fallback_modules=("blocks.*",)))
    step(*batches[0])
    found = step.lowered.findings
    assert [(b.prefix, b.length) for b in found.repeated] == [("blocks", 2)]
    # the layer scan interprets block 0's equations once for every layer
    assert set(found.fallbacks) >= {"cholesky"} and set(found.fallbacks["cholesky"]) == {"blocks.0"}
    assert found.counts == () and found.stage_layers == ()
    line = "no partition rule for cholesky: gathered and run replicated in ['blocks.0']"
    assert line in step.lowered.notes() and line in step.report().notes
