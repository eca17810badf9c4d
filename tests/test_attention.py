"""The blockwise attention kernel (xtrain.ir.kernels.blockwise) against torch's SDPA, forward and
gradient, with blocks small enough that every case spans several (and padded) blocks."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from xtrain import errors
from xtrain.frontend import sdpa
from xtrain.ir.kernels import blockwise as attention
from xtrain.ir import attention as markers
from xtrain.ir import markers as codec
from xtrain.ir import walk
from xtrain.ir.analysis import flops

B, HQ, L, S, D = 2, 4, 10, 13, 8


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    # blocks of 4: L=10 and S=13 need 3 and 4 blocks, the last ones padded
    monkeypatch.setitem(markers.DEFAULT_BLOCK, "cpu", 4)


def alibi(heads, length, source):
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)])
    distance = torch.arange(source)[None, :] - torch.arange(length)[:, None]
    return (slopes[:, None, None] * distance[None]).unsqueeze(0)  # (1, H, L, S)


def window(length, source, size):
    i, j = torch.arange(length)[:, None], torch.arange(source)[None, :]
    return (j <= i) & (j > i - size)


def case(kind):
    """(q, k, v, sdpa keyword arguments) of a named case."""
    g = torch.Generator().manual_seed(0)
    hk = {"gqa": 2, "mqa": 1}.get(kind, HQ)
    source = L if kind in ("causal", "window") else S
    q = torch.randn(B, HQ, L, D, generator=g)
    k, v = torch.randn(B, hk, source, D, generator=g), torch.randn(B, hk, source, D + 2, generator=g)
    kwargs = {"gqa": dict(enable_gqa=True, is_causal=True), "mqa": dict(is_causal=True),
              "causal": dict(is_causal=True), "causal-wide": dict(is_causal=True),
              "window": dict(attn_mask=window(L, L, 3)), "alibi": dict(attn_mask=alibi(HQ, L, S)),
              "scale": dict(scale=0.3), "plain": {}}.get(kind)
    if kind == "padded":  # key padding per sample, one sample with rows that see nothing
        keep = torch.ones(B, 1, L, S, dtype=torch.bool)
        keep[0, :, :, 9:] = False
        keep[1, :, 6:, :] = False
        kwargs = dict(attn_mask=keep)
    return q, k, v, kwargs


KINDS = ["plain", "causal", "causal-wide", "window", "gqa", "mqa", "alibi", "padded", "scale"]


def torch_sdpa(q, k, v, kwargs):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    mask = kwargs.get("attn_mask")
    if mask is not None and mask.is_floating_point():
        kwargs = {**kwargs, "attn_mask": mask.clone().requires_grad_()}
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    out.backward(torch.cos(torch.arange(out.numel(), dtype=out.dtype)).reshape(out.shape))
    grads = [x.grad for x in (q, k, v)]
    if mask is not None and mask.is_floating_point():
        grads.append(kwargs["attn_mask"].grad)
    return out.detach(), grads


def xtrain_sdpa(q, k, v, kwargs):
    j = {n: jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x for n, x in kwargs.items()}
    mask = j.pop("attn_mask", None)
    differentiable = mask is not None and mask.dtype != jnp.bool_

    def f(q, k, v, mask):
        return sdpa.sdpa(q, k, v, attn_mask=mask, **j)

    @jax.jit
    def out_and_grads(*args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape))

    out, grads = out_and_grads(*[jnp.asarray(x.numpy()) for x in (q, k, v)], mask)
    return out, list(grads[:3]) + ([grads[3]] if differentiable else [])


@pytest.mark.e2e
@pytest.mark.parametrize("kind", KINDS)
def test_blockwise_matches_torch_sdpa(kind):
    q, k, v, kwargs = case(kind)
    want, want_grads = torch_sdpa(q, k, v, kwargs)
    got, got_grads = xtrain_sdpa(q, k, v, kwargs)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-5, rtol=1e-5)
    assert len(got_grads) == len(want_grads)
    for name, g, w in zip("q k v mask".split(), got_grads, want_grads):
        assert np.isfinite(np.asarray(g)).all(), name
        np.testing.assert_allclose(np.asarray(g), w.numpy(), atol=5e-5, rtol=1e-4, err_msg=name)


@pytest.mark.unit
def test_fully_masked_rows_are_zero_not_nan():
    q, k, v, kwargs = case("padded")
    out, grads = xtrain_sdpa(q, k, v, kwargs)
    assert np.all(np.asarray(out)[1, :, 6:] == 0)
    assert np.all(np.asarray(grads[0])[1, :, 6:] == 0)


@pytest.mark.unit
def test_mismatched_heads_message_names_the_fix():
    q, k, v = jnp.zeros((1, 6, 4, 8)), jnp.zeros((1, 4, 4, 8)), jnp.zeros((1, 4, 4, 8))
    with pytest.raises(errors.UnsupportedOpError, match="6 query heads and 4 key/value heads; 4 does not divide 6"):
        sdpa.sdpa(q, k, v, enable_gqa=True)
    with pytest.raises(errors.UnsupportedOpError, match="pass enable_gqa=True .* or 1 key/value head"):
        sdpa.sdpa(q, k, v)


def _step_flops(causal: bool, length=256, block=32) -> float:
    b = attention.blocking_for(length, length, block, scale=0.1, causal=causal)
    q, k, v = (jnp.zeros((1, 2, 1, length, 16)), jnp.zeros((1, 2, length, 16)), jnp.zeros((1, 2, length, 16)))
    loss = lambda q, k, v: jnp.sum(attention.blockwise(q, k, v, None, None, b))
    return flops.count(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)).matmul


@pytest.mark.unit
def test_causal_skips_masked_blocks():
    """FLOPs counted on the forward + backward program: causal <= 0.6 x full at 8 blocks."""
    full, causal = _step_flops(False), _step_flops(True)
    assert full >= 4 * 2 * 256 * 256 * 16 * 2 * 0.99  # QK^T, PV forward; recomputed QK^T, dP, dV, dQ, dK
    assert causal <= 0.6 * full, (causal, full)


@pytest.mark.unit
def test_one_block_keeps_its_weights_and_recomputes_nothing():
    """A sequence within one block: forward + backward matmuls are 3 x the forward's, as for
    full attention (model FLOPs stay 6N + attention)."""
    length, heads, dim = 32, 2, 16
    forward = 2 * (2 * length * length * dim * heads)  # q.k and p.v
    assert _step_flops(False, length=length, block=32) == 3 * forward


@pytest.mark.e2e
def test_backward_keeps_no_score_matrix():
    """The residuals of the derivative rule: inputs, output and log-sum-exp, nothing L x S."""
    length = 64
    b = attention.blocking_for(length, length, 16, scale=0.25, causal=True)
    q, k, v = jnp.ones((1, 1, 1, length, 8)), jnp.ones((1, 1, length, 8)), jnp.ones((1, 1, length, 8))
    _, residuals = jax.vjp(lambda q, k, v: attention.blockwise(q, k, v, None, None, b), q, k, v)
    sizes = [x.size for x in jax.tree.leaves(residuals)]
    assert max(sizes) < length * length, sizes


@pytest.mark.e2e
def test_dropout_draws_the_same_mask_forward_and_backward():
    """With dropout, the gradient is that of the function the forward computed (checked by a
    finite difference along a random direction) and the output differs from no dropout."""
    q, k, v, _ = case("causal")
    b = attention.blocking_for(L, L, 5, scale=1 / math.sqrt(D), causal=True, dropout=0.3)
    key = jax.random.key(3)
    x = [jnp.asarray(t.numpy()) for t in (q, k, v)]
    x[0] = x[0].reshape(B, HQ, 1, L, D)
    f = jax.jit(lambda q, k, v: jnp.sum(jnp.sin(attention.blockwise(q, k, v, None, key, b))))
    g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(*x)
    rng = np.random.default_rng(0)
    dirs = [jnp.asarray(rng.standard_normal(t.shape), t.dtype) for t in x]
    eps = 1e-3
    numeric = (f(*[t + eps * d for t, d in zip(x, dirs)]) - f(*[t - eps * d for t, d in zip(x, dirs)])) / (2 * eps)
    analytic = sum(jnp.vdot(gi, d) for gi, d in zip(g, dirs))
    np.testing.assert_allclose(float(analytic), float(numeric), rtol=2e-2)
    plain = attention.blocking_for(L, L, 5, scale=1 / math.sqrt(D), causal=True)
    run = jax.jit(attention.blockwise, static_argnums=5)
    assert not np.allclose(run(*x, None, key, b), run(*x, None, None, plain))


@pytest.mark.unit
@pytest.mark.parametrize("dtype,dropout,mask,want", [
    (jnp.bfloat16, 0.0, None, markers.Implementation.CUDNN),
    (jnp.float32, 0.0, None, markers.Implementation.BLOCKWISE),
    (jnp.bfloat16, 0.1, None, markers.Implementation.BLOCKWISE),
    (jnp.bfloat16, 0.0, (2, 1, 16, 16), markers.Implementation.BLOCKWISE),
])
def test_cudnn_is_chosen_on_cuda_where_it_applies(dtype, dropout, mask, want):
    q = jax.ShapeDtypeStruct((2, 4, 16, 64), dtype)
    m = None if mask is None else jax.ShapeDtypeStruct(mask, jnp.bool_)
    kind, why = sdpa.choose("gpu", q, q, m, dropout)
    assert kind is want
    assert (why == "") == (want is markers.Implementation.CUDNN)
    assert sdpa.choose("cpu", q, q, m, dropout) == (markers.Implementation.BLOCKWISE, "")


def _band(length, size):
    """A sliding-window mask built inside the traced function from positions, as HF builds it."""
    i, j = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
    return ((j <= i) & (j > i - size))[None, None]


@pytest.mark.e2e
def test_sliding_window_mask_built_from_positions_matches_torch_and_skips_blocks():
    q, k, v, _ = case("window")
    want, want_grads = torch_sdpa(q, k, v, dict(attn_mask=window(L, L, 3)))
    f = lambda q, k, v: sdpa.sdpa(q, k, v, attn_mask=_band(L, 3) & (q[:1, :1, :, :1] == q[:1, :1, :, :1]))

    @jax.jit
    def out_and_grads(*args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape))

    x = [jnp.asarray(t.numpy()) for t in (q, k, v)]
    got, got_grads = out_and_grads(*x)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(g), w.numpy(), atol=5e-5, rtol=1e-4, err_msg=name)
    sites = {codec.outermost(markers.Site, e.source_info.name_stack) for e, _ in walk.equations(jax.make_jaxpr(f)(*x).jaxpr, frozenset())}
    site = next(s for s in sites if s is not None)
    # 3 query blocks of 4 over a window of 3: 1 + 2 + 2 pairs of 9 (the padding operand is runtime, the band static)
    assert (site.blocks, site.total, site.skipped_by) == (5, 9, "mask's static band"), site


def _window_flops(mask_of, length=256, block=32) -> float:
    q = jnp.zeros((1, 2, length, 16))
    loss = lambda q, k, v: jnp.sum(sdpa.sdpa(q, k, v, **mask_of(length)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(markers.DEFAULT_BLOCK, "cpu", block)
        return flops.count(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, q, q)).matmul


@pytest.mark.unit
def test_sliding_window_skips_blocks_outside_the_window():
    """FLOPs counted on the forward + backward program, window 32 at 256 tokens in blocks of 32:
    15 block pairs against causal's 36 and no mask's 64."""
    causal = _window_flops(lambda n: dict(is_causal=True))
    windowed = _window_flops(lambda n: dict(attn_mask=_band(n, 32)))
    assert windowed <= 0.45 * causal, (windowed, causal)
    full = _window_flops(lambda n: {})
    assert windowed <= 0.25 * full, (windowed, full)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_drops_the_weights_the_whole_call_drops(causal):
    """Attention dropout on a sequence split over `context` (ring attention, load-balanced when
    causal, in blocks of 8) keeps the weights the kernel on the whole sequence keeps (blocks of
    16): the mask is a hash of global (batch, head, query, key), not of the blocking or the device
    (xtrain.ir.kernels.attention_dropout). Output and gradients."""
    from jax.sharding import Mesh, PartitionSpec as P
    from xtrain.ir.kernels import attention_dropout
    from xtrain.lowering import ring_attention as ra

    n, c = 64, 4
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 2, 2, n, 8))  # (B, Hk, G, L, D): grouped-query heads
    k, v = (jax.random.normal(x, (2, 2, n, 8)) for x in keys[1:])
    b = attention.blocking_for(n, n, 16, scale=0.3, causal=causal, dropout=0.3)
    ring, key = ra.Ring(b, "context", c), jax.random.key(7)

    def local(q, k, v):
        drop = (key, attention_dropout.flat_index(q.shape[:-2]))
        if not causal:
            return ra.ring_attention(ring, q, k, v, None, drop)
        q, k, v = ra.balance(q, ring, 3), ra.balance(k, ring, 2), ra.balance(v, ring, 2)
        return ra.unbalance(ra.ring_attention(ring, q, k, v, None, drop), ring, 3)

    seq = P(None, None, None, "context")
    split = jax.shard_map(local, mesh=Mesh(np.array(jax.devices()[:c]), ("context",)),
                          in_specs=(seq, P(None, None, "context"), P(None, None, "context")), out_specs=seq)
    whole = lambda q, k, v: attention.blockwise(q, k, v, None, key, b)
    loss = lambda f: jax.jit(jax.value_and_grad(lambda *x: jnp.sum(jnp.sin(f(*x))), argnums=(0, 1, 2)))
    (want, want_grads), (got, got_grads) = loss(whole)(q, k, v), loss(split)(q, k, v)
    # a sum of 4096 terms near 21.7: reduction order moves it by ~1e-6 relative; a mask that kept
    # other weights would move it by whole terms
    np.testing.assert_allclose(got, want, rtol=5e-6)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5)
    plain = attention.blocking_for(n, n, 16, scale=0.3, causal=causal)
    assert abs(float(want) - float(jnp.sum(jnp.sin(attention.blockwise(q, k, v, None, None, plain))))) > 1e-2
