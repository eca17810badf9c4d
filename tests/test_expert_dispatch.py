"""Expert parallel dispatch by ragged all-to-all, the GPU path (xtrain.lowering.explicit.rules.experts).

A drop-free MoE layer built for CUDA sends only its routed rows: one all-gather of every device's
rows per peer gives each device where its rows land at each peer and what it receives, and the
combine (and each transpose) sends them back by the same offsets reversed. XLA:CPU has no ragged
all-to-all, so here the collective is `lax.ragged_all_to_all`'s documented semantics written with
all-gathers (checked on a hand-worked exchange first), and the layer's output and gradients are
compared with the single-device MoE (xtrain.ir.kernels.moe) and with the fixed-buffer path CPU
runs. The real collective is compiled for 8 x H100 in tests/test_aot.py."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from xtrain.ir.kernels import moe
from xtrain.lowering import collectives
from xtrain.lowering.explicit.rules import experts

pytestmark = pytest.mark.unit


def emulated_ragged_all_to_all(x, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis):
    """lax.ragged_all_to_all from all-gathers: device i's rows [input_offsets[j], + send_sizes[j])
    written on device j at output_offsets[j], the rest of `output` kept. Receive sizes that
    disagree with what the peers send poison the result (NaN)."""
    xs, starts, sizes, at = (lax.all_gather(a, axis) for a in (x, input_offsets, send_sizes, output_offsets))
    here = lax.axis_index(axis)
    r = jnp.arange(output.shape[0])[:, None]  # (R, 1) rows of the output
    lo, n, src = at[:, here][None], sizes[:, here][None], starts[:, here][None]  # (1, P): from each device i
    hit = (r >= lo) & (r < lo + n)  # (R, P)
    rows = jnp.clip(src + r - lo, 0, x.shape[0] - 1)
    values = xs[jnp.arange(xs.shape[0])[None], rows]  # (R, P, W)
    got = jnp.where(jnp.any(hit, axis=1)[:, None], jnp.sum(jnp.where(hit[..., None], values, 0), axis=1), output)
    return jnp.where(jnp.any(recv_sizes != sizes[:, here]), jnp.nan, got)


def _devices(n):
    return Mesh(np.array(jax.devices()[:n]), ("expert",))


def test_the_emulation_follows_the_documented_exchange():
    """2 devices: device 0 sends row a to itself and b, c to device 1; device 1 sends d, e to
    device 0 and f to itself. Written where the senders say: device 0 gets [a, d, e, 0],
    device 1 [f, b, c, 0] (its own row first, as its output offsets put it)."""
    x = jnp.array([[1.], [2.], [3.], [4.], [5.], [6.]])  # a b c | d e f
    offsets = jnp.array([0, 1, 0, 2])      # input offsets: device 0 (0, 1), device 1 (0, 2)
    send = jnp.array([1, 2, 2, 1])         # device 0 sends 1 to 0, 2 to 1; device 1: 2 to 0, 1 to 1
    out_at = jnp.array([0, 1, 1, 0])       # where they land: 0's a at 0 on 0, b c at 1 on 1; 1's d e at 1 on 0
    recv = jnp.array([1, 2, 2, 1])         # device 0 gets 1 from 0, 2 from 1; device 1: 2 from 0, 1 from 1

    def local(x, o, s, a, r):
        return emulated_ragged_all_to_all(x, jnp.zeros((4, 1)), o, s, a, r, "expert")

    f = jax.shard_map(local, mesh=_devices(2), in_specs=(P("expert"),) * 5, out_specs=P("expert"))
    np.testing.assert_array_equal(f(x, offsets, send, out_at, recv)[:, 0], [1, 4, 5, 0, 6, 2, 3, 0])
    wrong = f(x, offsets, send, out_at, jnp.array([1, 2, 1, 1]))  # device 1 expects 1 row from device 0, not 2
    assert np.isnan(wrong[4:]).all() and not np.isnan(wrong[:4]).any()


PEERS, TOKENS, K, EXPERTS, HIDDEN, FFN = 4, 6, 2, 8, 8, 16  # per device 6 tokens (2 chunks of 3)
SPEC = moe.ExpertsSpec(activation="silu")


def _layer():
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (PEERS * TOKENS, HIDDEN))
    ids = jnp.argsort(jax.random.uniform(keys[1], (PEERS * TOKENS, EXPERTS)), axis=1)[:, :K]
    # device 0's tokens all go to experts 0-3 (devices 0 and 1): devices 2 and 3 get nothing from it
    ids = ids.at[:TOKENS].set(jnp.array([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1], [2, 0]]))
    weights = jax.nn.softmax(jax.random.normal(keys[2], (PEERS * TOKENS, K)), axis=-1)
    up = jax.random.normal(keys[3], (EXPERTS, 2 * FFN, HIDDEN)) / 3
    down = jax.random.normal(keys[4], (EXPERTS, HIDDEN, FFN)) / 4
    return x, ids, weights, up, down


@pytest.mark.parametrize("skip", [True, False], ids=["padding skipped (CUDA)", "padding computed (CPU, Neuron)"])
@pytest.mark.parametrize("ragged", [True, False], ids=["ragged (GPU)", "fixed buffers (CPU)"])
def test_expert_parallel_layer_equals_the_single_device_moe(monkeypatch, ragged, skip):
    sent = []  # the rows of each ragged all-to-all traced
    def ragged_all_to_all(x, output, offsets, sizes, *rest):  # poisoned if a device sends itself rows
        sent.append(x.shape)
        to_self = sizes[lax.axis_index("expert")] > 0
        return emulated_ragged_all_to_all(x, output, offsets, sizes, *rest) + jnp.where(to_self, jnp.nan, 0)

    monkeypatch.setattr(collectives, "ragged_all_to_all", ragged_all_to_all)
    x, ids, weights, up, down = _layer()
    counts = np.bincount(np.asarray(ids).reshape(PEERS, -1)[0] // (EXPERTS // PEERS), minlength=PEERS)
    assert (counts == 0).any() and len(set(counts)) > 1  # device 0 sends unequal rows, nothing to some peer

    def local(x, ids, weights, up, down):
        return experts.routed_experts(x, ids, weights, up, down, spec=SPEC, peers=PEERS, ragged=ragged,
                                      skip_padding=skip)

    split = P("expert")
    layer = jax.shard_map(local, mesh=_devices(PEERS), in_specs=(split,) * 5, out_specs=split)
    whole = functools.partial(moe.routed_experts, spec=SPEC)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda x, w, u, d: jnp.sum(jnp.sin(f(x, ids, w, u, d))),
                                                argnums=(0, 1, 2, 3)))
    (want, want_grads), (got, got_grads) = loss(whole)(x, weights, up, down), loss(layer)(x, weights, up, down)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5)
    sent.clear()
    text = str(jax.make_jaxpr(layer)(x, ids, weights, up, down))
    if ragged:  # per chunk a dispatch of its routed rows (+ the id column) and a combine; no all-to-all
        rows = TOKENS * K // experts.CHUNKS
        assert sent == [(rows, HIDDEN + 1)] * experts.CHUNKS + [((PEERS - 1) * rows, HIDDEN)] * experts.CHUNKS
        # chunk after chunk (2 per later chunk); the own rows during the first dispatch (1) and the last combine (2)
        assert text.count("optimization_barrier") == 2 * (experts.CHUNKS - 1) + 3 and "all_to_all" not in text
    else:
        assert not sent and text.count("all_to_all") == 2
    assert ("while[" in text) == skip  # the GEMMs' loops run the rows held, a count known at run time


@pytest.mark.parametrize("ragged", [True, False], ids=["ragged (GPU)", "fixed buffers (CPU)"])
def test_rows_cross_in_the_experts_bf16_with_the_same_values(monkeypatch, ragged):
    """A bf16 layer whose input is float32 (torch autocast's residual stream): its rows are sent
    in bf16, half the bytes, and the output and gradients equal those of the rows sent in float32
    bit for bit (the first GEMM casts the rows to bf16 and the last one's products are bf16)."""
    sent = []
    record = lambda collective: lambda x, *a: sent.append(x.dtype) or collective(x, *a)
    monkeypatch.setattr(collectives, "ragged_all_to_all", record(emulated_ragged_all_to_all))
    monkeypatch.setattr(collectives, "all_to_all", record(collectives.all_to_all))
    spec = moe.ExpertsSpec(activation="silu", compute="bfloat16")
    x, ids, weights, up, down = _layer()

    def local(x, ids, weights, up, down):
        return experts.routed_experts(x, ids, weights, up, down, spec=spec, peers=PEERS, ragged=ragged)

    layer = jax.shard_map(local, mesh=_devices(PEERS), in_specs=(P("expert"),) * 5, out_specs=P("expert"))
    step = lambda: jax.jit(jax.value_and_grad(lambda x, w, u, d: jnp.sum(jnp.sin(layer(x, ids, w, u, d))),
                                              argnums=(0, 1, 2, 3)))(x, weights, up, down)
    bf16 = step()
    assert sent and set(sent) == {jnp.dtype(jnp.bfloat16)}, sent  # dispatch and combine, both ways
    sent.clear()
    monkeypatch.setattr(experts, "wire_dtype", lambda dtype, *_: jnp.dtype(dtype))
    f32 = step()
    assert set(sent) == {jnp.dtype(jnp.float32)}
    for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(f32)):
        np.testing.assert_array_equal(a, b)
