"""ZeRO-3's backward re-gathers one layer ahead (xtrain.lowering.regather), and the XLA options of
a step compiled for CUDA (xtrain.lowering.gpu_options). The compiled GPU schedule they make is
checked in tests/test_aot.py (ZeRO-3's re-gathers overlap GEMMs)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import xtrain
from xtrain.lowering import gpu_options, regather, zero
from xtrain.lowering.gradient_sync import GradSync
from xtrain.sharding import layout as layout_mod

pytestmark = pytest.mark.unit
LAYERS, N, D = 3, 8, 16


def _body(carry, xs):
    (x,), (w,) = carry, xs
    whole = lax.all_gather(w, "data", tiled=True)  # a ZeRO-3 shard gathered for use
    return [jnp.tanh(x @ whole)], jnp.sum(whole)


def _loss(ahead: bool):
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",))
    policy = zero.RegatherPolicy(("data",))
    layer = regather.regathered(_body, policy) if ahead else jax.checkpoint(_body, policy=policy)

    def local(ws, x):
        carry = [x] + ([regather.token()] if ahead else [])
        rows = []
        for w in ws:
            carry, row = layer(carry, [w])
            rows.append(row)
        return lax.psum(jnp.sum(carry[0] ** 2) + sum(rows) / N, "data")

    return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())


def test_one_layer_ahead_is_the_checkpoint_in_value_and_gradients_and_gathers_again():
    keys = jax.random.split(jax.random.key(0), LAYERS + 1)
    ws = [jax.random.normal(k, (D, D)) / 4 for k in keys[:LAYERS]]
    x = jax.random.normal(keys[-1], (N * 2, D))
    ahead, plain = (jax.jit(jax.value_and_grad(_loss(a), argnums=(0, 1))) for a in (True, False))
    (value, grads), (want, want_grads) = ahead(ws, x), plain(ws, x)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # the backward pass gathers each layer again (last layer first), and each re-gather waits for the
    # backward GEMMs of the layers after the next only: the next layer's backward runs beside it
    assert _backward_gemms_before_each_regather(ahead.lower(ws, x).as_text()) == [0, 0, 1]
    assert _backward_gemms_before_each_regather(plain.lower(ws, x).as_text()) == [0, 1, 2]


def _backward_gemms_before_each_regather(module: str) -> list[int]:
    """Per all-gather of the backward pass (the program's last shard_map body), how many of that
    body's dot_generals it depends on."""
    body = module.split("sdy.manual_computation")[-1]
    defs = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(%\w+)(?::\d+)? = (.*)$", body, re.M)}
    memo: dict[str, frozenset] = {}

    def upstream(name: str) -> frozenset:
        if name not in memo:
            operands = set(re.findall(r"%\w+", defs.get(name, ""))) & defs.keys()
            memo[name] = frozenset(operands).union(*(upstream(o) for o in operands))
        return memo[name]

    gathers = [n for n, d in defs.items() if "stablehlo.all_gather" in d]
    assert len(gathers) == LAYERS, gathers
    return [sum("stablehlo.dot_general" in defs[d] for d in upstream(g)) for g in gathers]


SHAPES = {"w": jax.ShapeDtypeStruct((64, 32), jnp.float32), "b": jax.ShapeDtypeStruct((32,), jnp.float32)}


def _layout(plan, **sizes):
    return layout_mod.resolve(plan, sizes, SHAPES, optimized=SHAPES, lr_groups=None, scan_layers=False)


def test_a_cuda_steps_reduce_scatters_combine_up_to_one_bucket_of_gradients():
    # XLA's combiners measure a collective by its result: a reduce-scatter's is 1/n of its gradients
    bucket = GradSync(bucket_bytes=8 << 20)
    zero3 = _layout(xtrain.Plan(zero=3), data=8)
    assert gpu_options.scatter_group(zero3) == 8
    options = gpu_options.compiler_options(bucket, zero3, regather=True)
    assert options == {"xla_gpu_all_reduce_combine_threshold_bytes": 8 << 20,
                       "xla_gpu_all_gather_combine_threshold_bytes": 8 << 20,
                       "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 20,
                       "xla_gpu_experimental_parallel_collective_overlap_limit": 2}
    # ZeRO-2 scatters over its optimizer state's split; HSDP over its inner (data) axis only
    assert gpu_options.scatter_group(_layout(xtrain.Plan(zero=2), data=4, tensor=2)) == 4
    hsdp = xtrain.plans.hybrid({n: s.shape for n, s in SHAPES.items()}, {"replicate": 2, "data": 4}, min_size=0)
    assert gpu_options.scatter_group(_layout(hsdp, replicate=2, data=4)) == 4
    # DDP scatters nothing; without the re-gather (or below ZeRO-3) one collective in flight
    ddp = gpu_options.compiler_options(GradSync(), _layout(xtrain.Plan(), data=8), regather=True)
    assert ddp["xla_gpu_reduce_scatter_combine_threshold_bytes"] == GradSync().bucket_bytes
    assert ddp["xla_gpu_experimental_parallel_collective_overlap_limit"] == 1
    assert gpu_options.compiler_options(bucket, zero3, regather=False)[
        "xla_gpu_experimental_parallel_collective_overlap_limit"] == 1
    # a mesh with experts split over `expert`: one more, a MoE layer's dispatch or combine in flight
    zero3 = xtrain.Plan(zero=3)
    for plan, regather, limit in ((xtrain.Plan(), True, 2), (zero3, True, 3), (zero3, False, 2)):
        options = gpu_options.compiler_options(GradSync(), _layout(plan, data=2, expert=4), regather=regather)
        assert options["xla_gpu_experimental_parallel_collective_overlap_limit"] == limit, (plan, regather)
