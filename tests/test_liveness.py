"""The cost model's graph memory (xtrain.cost.liveness): what XLA fuses takes no bytes, a call's
results are counted once, in-place updates take their operand's buffer; and on the suite's small
GPT the graph estimate stays within 15% of XLA's compiled memory for every plan family."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import xtrain
from xtrain.cost import liveness, search
from xtrain.cost.program import abstract_step, trainable_of
from xtrain.frontend.torch_module import wrap

from models import GPT

N = 1 << 20  # elements: a 4 MiB f32 value
MiB4 = 4 * N


def peak(f, *shapes) -> int:
    return liveness.peak_live_bytes(jax.make_jaxpr(f)(*(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)))


@pytest.mark.unit
def test_an_elementwise_chain_into_a_reduction_stores_nothing_between():
    # exp, mul, add feed each other and a sum: XLA computes them in the reduction's kernel
    assert peak(lambda x: jnp.sum(jnp.exp(x) * 2.0 + 1.0), (N,)) == 4
    # a matmul's result is stored; the elementwise ops on it before the next matmul are not
    w = (1024, 1024)
    stored = peak(lambda x, w: jnp.tanh(x @ w * 2.0) @ w, w, w)
    assert stored == 2 * MiB4, stored  # x @ w, and the second product: the scaled tanh is fused


@pytest.mark.unit
def test_a_value_used_by_a_matmul_is_stored():
    assert peak(lambda x, w: jnp.exp(x) @ w, (1024, 1024), (1024, 1024)) == 2 * MiB4


@pytest.mark.unit
def test_a_calls_results_count_once():
    inner = jax.jit(lambda x: (jnp.sin(x) @ x, jnp.cos(x) @ x))  # a pjit call returning two stored values
    single = peak(lambda x: sum(jnp.sum(y) for y in inner(x)), (1024, 1024))
    assert single <= 3 * MiB4 + 16, single  # sin/cos stored for the matmuls (one at a time) and the two products


@pytest.mark.unit
def test_a_scatter_into_zeros_takes_the_zeros_buffer():
    def onehot_grad(idx):
        return jnp.zeros((1024, 1024), jnp.float32).at[jnp.arange(1024), idx].add(1.0)

    got = liveness.peak_live_bytes(jax.make_jaxpr(onehot_grad)(jax.ShapeDtypeStruct((1024,), jnp.int32)))
    assert got < 1.1 * MiB4, got  # one 4 MiB buffer, not zeros and a copy


@pytest.mark.unit
def test_a_reshape_is_its_operands_buffer():
    def f(x, w):
        y = x @ w
        return y.reshape(2048, 512) @ w[:512, :512], jnp.sum(y)  # y lives past the reshape

    # y (4 MiB), the slice of w (1 MiB), the product (4 MiB); a copy for the reshape would be 4 MiB more
    got = peak(f, (1024, 1024), (1024, 1024))
    assert got == 9 * (1 << 20), got


@pytest.mark.unit
def test_a_donated_state_is_updated_in_place():
    """A training step donates its state: the new moments and parameters, made elementwise from
    the old ones (and chosen against them by a select in its own jit, as a step that skips
    non-finite gradients ends), are written over them, with no new bytes (calls are inlined, as
    XLA inlines them); without donation each is a new buffer. XLA's compiled memory of the
    donated update agrees within one tensor (XLA:CPU keeps one 4 MiB temporary, not two)."""
    select = jax.jit(lambda ok, new, old: jnp.where(ok, new, old))

    def update(p, m, g):
        m2 = 0.9 * m + 0.1 * g
        ok = jnp.isfinite(jnp.sum(g))
        return select(ok, p - 0.01 * m2, p), select(ok, m2, m)

    shapes = [jax.ShapeDtypeStruct((N,), jnp.float32)] * 3
    jaxpr = jax.make_jaxpr(update)(*shapes)
    assert liveness.peak_live_bytes(jaxpr, donated=True) < 64
    assert liveness.peak_live_bytes(jaxpr) >= 2 * MiB4
    compiled = jax.jit(update, donate_argnums=(0, 1)).lower(*shapes).compile().memory_analysis()
    assert compiled.temp_size_in_bytes < MiB4 + 64 and compiled.alias_size_in_bytes == 2 * MiB4


PLANS = [search.Candidate(data=8), search.Candidate(data=8, zero=1), search.Candidate(data=8, zero=3),
         search.Candidate(data=4, tensor=2), search.Candidate(data=4, pipe=2, microbatches=2)]


@pytest.mark.e2e
def test_graph_memory_is_within_15_percent_of_the_compiled_memory():
    """The constants of xtrain/cost/liveness.py were set on these programs (CPU compiles of the small
    GPT); benchmarks/real_configs.py tests them on GPU compiles of real-size models."""
    torch.manual_seed(0)
    model = GPT(vocab=64, d=64, layers=2, seq=32)
    x = np.zeros((16, 32), np.int32)
    t = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    tensor = search.tensor_plan(t.model, (x, x))
    ratios = {}
    for c in PLANS:
        plan = c.plan(tensor)
        step = xtrain.compile(model, xtrain.Mesh(**c.mesh), optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                              plan=plan, scan_layers=True)
        compiled = search.compiled_step_cost(step, x, x).memory.total
        graph = search.step_cost(abstract_step(trainable_of(t.model, t.tx), c.mesh, plan, (x, x)), c.mesh,
                                 x.size).memory.total
        ratios[c.name] = graph / compiled
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), str(ratios)
