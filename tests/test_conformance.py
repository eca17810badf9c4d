"""neuron_support.conformance: one deliberately bad JAX program per rule (compiled for real on the
8 emulated CPU devices), the good counterpart where there is one, and xtrain's own DP step."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import xtrain
from xtrain.errors import OptionsError
from neuron_support import conformance, emulate
from neuron_support.conformance import Severity, Target

from models import GPT, token_batches

TRN1 = Target.for_instance("trn1.32xlarge")
# Two trn1.32xlarge scaled onto the 8 CPU devices: 4 devices (2 chips x 2 cores) per node.
TWO_NODES = emulate.virtual_cluster("trn1.32xlarge:2", devices=8)
X = jnp.arange(4, dtype=jnp.float32)


def compiled(f, *args):
    return jax.jit(f).lower(*args).compile()


def findings(f, *args, target=TRN1):
    c = compiled(f, *args)
    return conformance.check(c.as_text(), target, device_ids=emulate.device_order(c))


def rules(found):
    return sorted({f.rule for f in found})


def on_mesh(body, mesh, spec):
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)


def mesh(shape, names, order=None):
    devices = np.array(jax.devices())[order if order is not None else slice(None)]
    return Mesh(devices[: int(np.prod(shape))].reshape(shape), names)


# -- unsupported ops and dtypes ------------------------------------------------------------------

@pytest.mark.e2e
def test_conditional():
    (found,) = findings(lambda x: lax.cond(x.sum() > 0, lambda x: x * 2, lambda x: x - 1, x), X)
    assert found.rule == "conditional" and found.severity is Severity.ERROR
    assert found.op.startswith("conditional %") and "jit(<lambda>)/cond" in found.source
    assert "test_conformance.py" in found.source  # the user's line, from the stack-frame table
    assert "jnp.where" in found.message


@pytest.mark.e2e
def test_dynamic_while_but_not_fori_loop():
    (found,) = findings(lambda x: lax.while_loop(lambda c: c.sum() < 100, lambda c: c * 2, x), X)
    assert found.rule == "dynamic-while" and "lax.fori_loop or lax.scan" in found.message
    assert findings(lambda x: lax.fori_loop(0, 10, lambda i, c: c * 2 + jnp.sin(c), x), X) == []
    assert findings(lambda x: lax.scan(lambda c, _: (c * 2, None), x, length=5)[0], X) == []


@pytest.mark.e2e
def test_host_callback():
    double = lambda a: np.asarray(a) * 2  # noqa: E731
    (found,) = findings(lambda x: jax.pure_callback(double, jax.ShapeDtypeStruct(x.shape, x.dtype), x), X)
    assert found.rule == "host-callback" and "xla_ffi_python_cpu_callback" in found.message


@pytest.mark.e2e
def test_integer_dot():
    (found,) = findings(lambda a: a @ a, jnp.ones((4, 4), jnp.int32))
    assert found.rule == "integer-dot" and "s32" in found.message
    assert findings(lambda a: a @ a, jnp.ones((4, 4), jnp.float32)) == []


@pytest.mark.e2e
def test_variadic_reduce():
    (found,) = findings(jnp.argmax, X)
    assert found.rule == "variadic-reduce" and "(f32[], s32[])" in found.message


@pytest.mark.e2e
def test_sort_comparator():
    # jnp.sort of floats: JAX's comparator orders NaN and -0.0 with EQ/NE compares.
    (found,) = findings(jnp.sort, X)
    assert found.rule == "sort-comparator" and "EQ/NE" in found.message
    # Several keys: tie-breaks with EQ.
    assert rules(findings(lambda a, b: lax.sort((a, b), num_keys=2), X.astype(jnp.int32), X.astype(jnp.int32))) == [
        "sort-comparator"]
    assert findings(jnp.sort, jnp.arange(4, dtype=jnp.int32)) == []  # one integer key: plain LT


@pytest.mark.e2e
def test_reduce_precision():
    assert rules(findings(lambda a: lax.reduce_precision(a * 3, 5, 10) + 1, X)) == ["reduce-precision"]


@pytest.mark.e2e
def test_fp64():
    with jax.enable_x64(True):
        found = findings(lambda a: a * 2.0, jnp.ones((4,), jnp.float64))
    assert rules(found) == ["fp64"] and len(found) == 1  # one finding per source op, not per constant
    assert "jit(<lambda>)/mul" in found[0].source


@pytest.mark.e2e
def test_complex():
    found = findings(lambda a: jnp.fft.fft(a).real, X)
    assert rules(found) == ["complex"] and all("c64" in f.message for f in found)


@pytest.mark.e2e
def test_int64_is_a_warning():
    with jax.enable_x64(True):
        text = compiled(lambda a: a + 1, jnp.ones((4,), jnp.int64)).as_text()
    (found,) = conformance.assert_conforms(text, TRN1)  # warnings do not fail
    assert found.rule == "int64" and found.severity is Severity.WARNING
    assert "downcast to int32" in found.message


# -- collectives -------------------------------------------------------------------------------

@pytest.mark.e2e
def test_replica_group_of_three():
    m = mesh((2, 3), ("a", "b"))
    (found,) = findings(on_mesh(lambda v: lax.psum(v, "b"), m, P(("a", "b"))), jnp.ones(6))
    assert found.rule == "replica-groups" and "group [0, 1, 2]" in found.message
    assert "1, 2, 4, 8, 32 cores starting at a multiple of the size" in found.message
    assert "shard_map/psum" in found.source


@pytest.mark.e2e
def test_replica_group_misaligned():
    # A mesh over devices 1..7,0: the pairs of axis "b" are physical {1,2}, {3,4}, ...
    m = mesh((4, 2), ("a", "b"), order=[1, 2, 3, 4, 5, 6, 7, 0])
    (found,) = findings(on_mesh(lambda v: lax.psum(v, "b"), m, P(("a", "b"))), jnp.ones(8))
    assert found.rule == "replica-groups" and "group [1, 2]" in found.message


@pytest.mark.e2e
def test_strided_data_groups_under_tensor_parallel_conform():
    m = mesh((2, 4), ("data", "tensor"))  # data groups {0,4}, {1,5}, ...: the other half of tensor=4
    assert findings(on_mesh(lambda v: lax.psum(v, "data"), m, P(("data", "tensor"))), jnp.ones(8)) == []
    assert findings(on_mesh(lambda v: lax.psum(v, "tensor"), m, P(("data", "tensor"))), jnp.ones(8)) == []


@pytest.mark.e2e
def test_groups_across_nodes_must_take_the_same_cores():
    target = TWO_NODES.target()
    good = mesh((2, 4), ("node", "core"))
    assert findings(on_mesh(lambda v: lax.psum(v, "node"), good, P(("node", "core"))), jnp.ones(8),
                    target=target) == []
    bad = mesh((2, 4), ("node", "core"), order=[0, 1, 2, 3, 4, 5, 7, 6])
    (found,) = findings(on_mesh(lambda v: lax.psum(v, "node"), bad, P(("node", "core"))), jnp.ones(8),
                        target=target)
    assert found.rule == "replica-groups" and "different cores on each" in found.message


@pytest.mark.e2e
def test_permute_must_follow_a_ring_of_adjacent_ranks():
    m = mesh((8,), ("i",))
    shift = lambda k: on_mesh(lambda v: lax.ppermute(v, "i", [(i, (i + k) % 8) for i in range(8)]), m, P("i"))  # noqa: E731
    assert findings(shift(1), jnp.ones(8)) == []
    (found,) = findings(shift(2), jnp.ones(8))
    assert found.rule == "permute-ring" and "0 -> 2 is not a step between adjacent ranks" in found.message
    # Between nodes: the same core on neighbouring nodes (a pipeline hop) is a ring step.
    nodes = mesh((2, 4), ("node", "core"))
    hop = on_mesh(lambda v: lax.ppermute(v, "node", [(0, 1), (1, 0)]), nodes, P(("node", "core")))
    assert findings(hop, jnp.ones(8), target=TWO_NODES.target()) == []


COUNT_SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, itertools
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    names = ("a", "b", "c", "d")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2, 2), names)
    def body(v):  # a psum over every non-empty subset of 4 axes: 15 distinct replica groups
        # (several also break the group-size rules; this test looks at the count only)
        return sum(lax.psum(v * i, axes) for i, axes in enumerate(
            s for r in range(1, 5) for s in itertools.combinations(names, r)))
    f = jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P(names))
    print(jax.jit(f).lower(jnp.ones(16)).compile().as_text())
""")


@pytest.mark.multiprocess
def test_distinct_replica_group_cap_per_runtime():
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="16", JAX_PLATFORMS="cpu")
    text = subprocess.run([sys.executable, "-c", COUNT_SCRIPT], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout
    target = lambda runtime: Target.for_instance("trn1.32xlarge", runtime=runtime)  # noqa: E731
    count = lambda runtime: [f for f in conformance.check(text, target(runtime))  # noqa: E731
                             if f.rule == "replica-group-count"]
    (found,) = count("recent-runtime")
    assert "15 distinct replica groups" in found.message and "allows 12 per program" in found.message
    assert count("older-docs") == []  # 16 in the older documentation
    with pytest.raises(OptionsError, match="runtime='2.99' is not one of 'older-docs', 'recent-runtime'"):
        target("2.99")


# -- xtrain's own step -------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["explicit", "xla"])
def gpt_step(request):
    torch.manual_seed(0)
    model = GPT()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                          lowering=request.param)
    return step, token_batches(n=1)[0]


@pytest.mark.e2e
def test_xtrain_data_parallel_gpt_step_conforms(gpt_step):
    step, batch = gpt_step
    # One trn1.32xlarge (all 8 devices in one node) and two scaled nodes (data across nodes).
    for cluster in (emulate.virtual_cluster("trn1.32xlarge"), TWO_NODES):
        assert emulate.check_step(step, *batch, cluster=cluster) == []
    # Both lowerings emit gradient all-reduces over all 8 devices (XLA's CPU pipeline merges
    # them into one) and, for the cross-entropy's count of targets, an s32 one; no s64, no
    # gathers of indices, no loops without a static trip count (the layer scan has one).
    assert emulate.check_step(step, *batch, cluster=emulate.virtual_cluster("p4d.24xlarge")) == []


@pytest.mark.e2e
def test_conformance_error_lists_findings():
    text = compiled(lambda x: lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x), X).as_text()
    with pytest.raises(conformance.ConformanceError, match=r"does not fit trn1.32xlarge \(1 findings\)"):
        conformance.assert_conforms(text, TRN1)
    assert conformance.assert_conforms(text, TRN1, allow=["conditional"]) == conformance.check(text, TRN1)


@pytest.fixture(scope="module", params=["explicit", "xla"])
def tensor_parallel_step(request):
    from xtrain import plans

    torch.manual_seed(0)
    model = GPT()
    mesh = xtrain.Mesh(data=4, tensor=2)
    step = xtrain.compile(model, mesh, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          plan=plans.megatron(model, dict(data=4, tensor=2)), lowering=request.param)
    return step, token_batches(n=1)[0]


@pytest.mark.e2e
def test_xtrain_tensor_parallel_gpt_step_conforms(tensor_parallel_step):
    """Megatron TP2 x DP4: tensor pairs are adjacent cores (groups of 2 at even offsets), data
    groups strided by 2 inside an aligned block of 8: both allowed within a trn1 node."""
    step, batch = tensor_parallel_step
    assert emulate.check_step(step, *batch, cluster=emulate.virtual_cluster("trn1.32xlarge")) == []
