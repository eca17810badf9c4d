"""Activation annotations (xtrain.shard) and Megatron sequence parallelism on Mesh(data=4, tensor=2).

The residual stream between blocks is annotated (batch over data, sequence over tensor): each
all-reduce of Megatron's row-parallel outputs becomes a reduce-scatter onto the sequence, and
the column-parallel matmuls all-gather the sequence first (and the reverse in backward).
"""
import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import torch.nn.functional as F

import xtrain
from models import GPT, SequenceParallelGPT, token_batches
from xtrain import plans
from xtrain.errors import PlanError
from xtrain.testing import assert_parity, run_parity, torch_reference

MESH = dict(data=4, tensor=2)
SP = ("data", "tensor", None)  # (B, T, D)
BATCH, SEQ, WIDTH = 16, 16, 32


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


@functools.cache
def case():
    torch.manual_seed(0)
    model, batches = SequenceParallelGPT(), token_batches(n=4, batch=BATCH, seq=SEQ)
    return model, batches, torch_reference(model, sgd, batches)


@pytest.mark.e2e
@pytest.mark.parametrize("lowering", ["explicit", "xla"])
def test_sequence_parallel_megatron_parity(lowering):
    model, batches, reference = case()
    assert_parity(run_parity(model, sgd, batches, xtrain.Mesh(**MESH), plan=plans.megatron(model, MESH),
                             reference=reference, lowering=lowering))


# -- accounting -------------------------------------------------------------------------------
def block_collectives(sequence_parallel: bool) -> dict:
    """{(block, 'forward'|'backward', kind): count} of the collectives over 'tensor' that move
    one block activation (the local batch's B x T x D floats)."""
    torch.manual_seed(0)
    model = SequenceParallelGPT(sequence_parallel)
    step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()),
                          plan=plans.megatron(model, MESH), scan_layers=False)
    step(*token_batches(n=1, batch=BATCH, seq=SEQ)[0])
    activation = BATCH // MESH["data"] * SEQ * WIDTH * 4
    counts = collections.Counter()
    for c in step.report().collectives:
        block = c.source.split(" ")[0].split(".")[:2]
        if c.axes == ("tensor",) and c.payload_bytes == activation and block[0] == "blocks":
            counts[(int(block[1]), "backward" if "transpose(" in c.source else "forward", c.kind)] += 1
    return dict(counts)


def per_block(fwd: dict, bwd: dict) -> dict:
    return {(b, phase, kind): n for b in range(2) for phase, kinds in (("forward", fwd), ("backward", bwd))
            for kind, n in kinds.items()}


@pytest.mark.e2e
def test_megatron_all_reduces_twice_per_block_each_way():
    assert block_collectives(False) == per_block({"all-reduce": 2}, {"all-reduce": 2})


@pytest.mark.e2e
def test_sequence_parallel_replaces_each_all_reduce_by_reduce_scatter_and_all_gather():
    pair = {"reduce-scatter": 2, "all-gather": 2}
    assert block_collectives(True) == per_block(pair, pair)


# -- the annotation outside xtrain, in JAX code, and its errors ------------------------------------
@pytest.mark.unit
def test_shard_is_the_identity_outside_xtrain():
    t = torch.ones(4, 2, 3)
    assert xtrain.shard(t, SP) is t
    a = jnp.ones((4, 2, 3))
    assert xtrain.shard(a, ("nope",)) is a  # nothing to check against without a mesh


def jax_loss(params, x, y):
    h = xtrain.shard(jnp.tanh(x @ params["w1"]), ("data", "tensor"))  # (B, H): hidden split
    return jnp.mean((h @ params["w2"] - y) ** 2)


@pytest.mark.e2e
def test_shard_in_jax_code_keeps_parity_with_an_unannotated_run():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(6, 8)).astype(np.float32), "w2": rng.normal(size=(8, 2)).astype(np.float32)}
    x, y = rng.normal(size=(16, 6)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32)
    losses = {}
    for lowering in ("explicit", "xla"):
        step = xtrain.compile(jax_loss, xtrain.Mesh(**MESH), params=params, optimizer=optax.sgd(0.1),
                              lowering=lowering)
        losses[lowering] = [step(x, y)["loss"] for _ in range(4)]
    want, p = [], params
    for _ in range(4):
        loss, grads = jax.value_and_grad(jax_loss)(p, x, y)
        want.append(float(loss))
        p = jax.tree.map(lambda w, g: w - 0.1 * g, p, grads)
    np.testing.assert_allclose(losses["explicit"], want, rtol=1e-5)
    np.testing.assert_allclose(losses["xla"], want, rtol=1e-5)


class Annotated(torch.nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x):
        return xtrain.shard(self.fc(x), self.spec)


class Outer(torch.nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.body = Annotated(spec)

    def forward(self, x):
        return self.body(x).sum()


@pytest.mark.e2e
@pytest.mark.parametrize("spec,message", [
    (("data", "model"), r"xtrain.shard in module 'body': spec \('data', 'model'\) for tensor of shape \(16, 6\) names axis 'model', which the mesh \(data=4, tensor=2\) "
                        r"does not have; use one of \['data', 'tensor'\]"),
    (("data",), r"spec \('data',\) has 1 entries for a tensor of shape \(16, 6\) \(2 dims\)"),
    ((None, "data"), r"dim 1 of tensor of shape \(16, 6\) \(size 6\) is not divisible by data=4"),
    (("data", "data"), r"uses a mesh axis twice"),
], ids=["unknown-axis", "wrong-rank", "not-divisible", "axis-twice"])
def test_shard_errors_name_the_tensor_and_the_fix(spec, message):
    model = Outer(spec)
    step = xtrain.compile(model, xtrain.Mesh(**MESH), optimizer=sgd(model.parameters()),
                          loss_fn=lambda m, x: m(x))
    with pytest.raises(PlanError, match=message):
        step(torch.ones(16, 6))
