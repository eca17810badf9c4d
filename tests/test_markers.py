"""One typed marker encoding for every traced name (xtrain.ir.markers): each kind reads back the
value it encoded, from inside a name stack, whatever its strings hold."""
import dataclasses

import jax
import jax.numpy as jnp
import pytest

from xtrain.ir import index_ops, markers
from xtrain.ir.kernels import blockwise, moe
from xtrain.ir.attention import Implementation, Site

pytestmark = pytest.mark.unit  # names encoded and decoded; nothing compiled

AWKWARD = "not cuDNN: a/b, 'quoted' \"double\" back\\slash ;|= {x: [1]} é"

VALUES = [
    Site(Implementation.EAGER, why=AWKWARD),
    Site(Implementation.BLOCKWISE, 256, 3, 4, "", "mask's static band"),
    blockwise.blocking_for(40, 24, 16, scale=0.35355339059327373, causal=False, dropout=0.1,
                           visible=lambda bq, bk: ((0, 1), (0, 2), (1, 2))),
    index_ops.IndexOp("cross_entropy/nll_loss target", negatives=False, float_index=True),
    moe.ExpertsSpec(activation="gelu_tanh", gated=False, transposed=True, compute=None),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_a_marker_reads_back_its_value_from_a_name_stack(value):
    name = markers.name(value)
    assert "/" not in name and '"' not in name  # a name-stack level; HLO quotes op_name with "
    stack = f"jit(train)/model.layers.0/{name}/dot_general"
    assert markers.found(type(value), stack) == [value]
    assert markers.outermost(type(value), stack) == value == markers.innermost(type(value), stack)
    assert markers.outermost(Site if type(value) is not Site else index_ops.IndexOp, stack) is None


def test_outermost_and_innermost_of_nested_markers():
    outer, inner = Site(Implementation.EAGER, why="outer"), Site(Implementation.CUDNN)
    stack = f"{markers.name(outer)}/attn/{markers.name(inner)}"
    assert markers.found(Site, stack) == [outer, inner]
    assert markers.outermost(Site, stack) == outer and markers.innermost(Site, stack) == inner
    # index ops: the outermost names the op, a float index at any level is one
    embedding, gather = index_ops.IndexOp("embedding"), index_ops.IndexOp("torch.gather", float_index=True)
    both = f"{markers.name(embedding)}/{markers.name(gather)}"
    assert index_ops.marker_in(both) == dataclasses.replace(embedding, float_index=True)


def test_a_jitted_calls_name_carries_its_marker():
    spec = moe.ExpertsSpec(activation="silu", compute="bfloat16")
    x, ids, w = jnp.ones((4, 8)), jnp.zeros((4, 1), jnp.int32), jnp.ones((4, 1))
    up, down = jnp.ones((2, 16, 8)), jnp.ones((2, 8, 8))
    jaxpr = jax.make_jaxpr(moe.traced_call(spec))(x, ids, w, up, down)
    (call,) = [e for e in jaxpr.eqns if "name" in e.params]
    assert markers.outermost(moe.ExpertsSpec, call.params["name"]) == spec


def test_a_kind_is_registered_once():
    with pytest.raises(TypeError, match="once per kind"):
        markers.marker("attention")(dataclasses.make_dataclass("Other", [("x", int)], frozen=True))
