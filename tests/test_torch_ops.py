"""xtrain's own lowerings of torch ops (xtrain/frontend/torch_ops.py): values and gradients
agree with torch's autograd, and the derivative rules keep one full-size residual per op."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from xtrain import errors
from xtrain.errors import UnsupportedOpError
from xtrain.frontend import sdpa, torch_ops
from xtrain.frontend.torch_module import TorchModel

RNG = np.random.default_rng(0)
X = (RNG.standard_normal((3, 5, 8)) * 3).astype(np.float32)
G = RNG.standard_normal((3, 5, 8)).astype(np.float32)


@pytest.mark.unit
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_value_and_gradient_match_torch(approximate):
    y, vjp = jax.vjp(lambda a: torch_ops._gelu(a, approximate=approximate), jnp.asarray(X))
    xt = torch.tensor(X, requires_grad=True)
    yt = torch.nn.functional.gelu(xt, approximate=approximate)
    yt.backward(torch.tensor(G))
    np.testing.assert_allclose(np.asarray(y), yt.detach().numpy(), atol=2e-6)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(G))[0]), xt.grad.numpy(), atol=2e-5)


@pytest.mark.unit
def test_silu_value_and_gradient_match_torch():
    y, vjp = jax.vjp(torch_ops._silu, jnp.asarray(X))
    xt = torch.tensor(X, requires_grad=True)
    yt = torch.nn.functional.silu(xt)
    yt.backward(torch.tensor(G))
    np.testing.assert_allclose(np.asarray(y), yt.detach().numpy(), atol=2e-6)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(G))[0]), xt.grad.numpy(), atol=2e-5)


@pytest.mark.unit
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_value_and_gradient_match_torch(masked):
    x = X.copy()
    if masked:  # a causal mask's -inf entries, as attention writes them
        x[..., 3:] = -np.inf
    y, vjp = jax.vjp(lambda a: torch_ops._softmax(a, -1), jnp.asarray(x))
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.softmax(xt, -1)
    yt.backward(torch.tensor(G))
    np.testing.assert_allclose(np.asarray(y), yt.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(np.asarray(vjp(jnp.asarray(G))[0]), xt.grad.numpy(), atol=1e-5)


@pytest.mark.unit
def test_softmax_over_a_leading_dim_and_in_a_given_dtype():
    y = torch_ops._softmax(jnp.asarray(X), 0)
    np.testing.assert_allclose(np.asarray(y), torch.softmax(torch.tensor(X), 0).numpy(), atol=1e-6)
    half = torch_ops._softmax_int(jnp.asarray(X, jnp.bfloat16), 1, torch.float32)
    assert half.dtype == jnp.float32


@pytest.mark.unit
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_value_and_gradients_match_torch(weighted):
    w = RNG.standard_normal(8).astype(np.float32)
    args = [jnp.asarray(X)] + ([jnp.asarray(w)] if weighted else [])

    def loss(x, *weight):
        return (torch_ops._rms_norm(x, [8], *(weight or (None,)), 1e-6) * G).sum()

    grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    xt = torch.tensor(X, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True) if weighted else None
    (torch.nn.functional.rms_norm(xt, (8,), wt, 1e-6) * torch.tensor(G)).sum().backward()
    for got, want in zip(grads, [xt.grad] + ([wt.grad] if weighted else [])):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.unit
def test_rms_norm_in_bfloat16_computes_as_torch():
    """16-bit inputs are normalized in float32 with float32's eps, scaled, then cast back."""
    x, w = torch.tensor(X).bfloat16(), torch.tensor(G[0, 0]).bfloat16()
    got = torch_ops._rms_norm(jnp.asarray(x.float().numpy(), jnp.bfloat16), (8,),
                              jnp.asarray(w.float().numpy(), jnp.bfloat16))
    assert got.dtype == jnp.bfloat16
    want = torch.nn.functional.rms_norm(x, (8,), w)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want.float().numpy())


@pytest.mark.unit
def test_gelu_rejects_an_unknown_approximation():
    with pytest.raises(UnsupportedOpError, match="approximate='erf'"):
        torch_ops._gelu(jnp.asarray(X), approximate="erf")


@pytest.mark.unit
@pytest.mark.parametrize("shape,affine", [((8,), True), ((5, 8), True), ((8,), False)])
def test_layer_norm_gradients_match_torch(shape, affine):
    w = RNG.standard_normal(shape).astype(np.float32) if affine else None
    b = RNG.standard_normal(shape).astype(np.float32) if affine else None
    args = [jnp.asarray(X)] + ([jnp.asarray(w), jnp.asarray(b)] if affine else [])

    def loss(x, *wb):
        out, _, _ = torch_ops._native_layer_norm(x, list(shape), *(wb or (None, None)), 1e-5)
        return (out * G).sum()

    grads = jax.grad(loss, argnums=tuple(range(len(args))))(*args)
    xt = torch.tensor(X, requires_grad=True)
    wt = torch.tensor(w, requires_grad=True) if affine else None
    bt = torch.tensor(b, requires_grad=True) if affine else None
    out = torch.nn.functional.layer_norm(xt, shape, wt, bt, 1e-5)
    (out * torch.tensor(G)).sum().backward()
    expected = [xt.grad] + ([wt.grad, bt.grad] if affine else [])
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=2e-5)


@pytest.mark.unit
def test_layer_norm_statistics_outputs_are_differentiable():
    """The mean and 1/std outputs' cotangents count as under autodiff of the plain formula."""
    def ours(x):
        out, mean, rstd = torch_ops._native_layer_norm(x, [8], None, None, 1e-5)
        return (out * G).sum() + 0.3 * mean.sum() + 0.7 * rstd.sum()

    def plain(x):
        mean = x.mean(-1, keepdims=True)
        rstd = jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
        return (((x - mean) * rstd) * G).sum() + 0.3 * mean.sum() + 0.7 * rstd.sum()

    np.testing.assert_allclose(np.asarray(jax.grad(ours)(jnp.asarray(X))),
                               np.asarray(jax.grad(plain)(jnp.asarray(X))), atol=1e-5)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(16)
        self.fc = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 16)

    def forward(self, x, y):
        return ((x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x))))) - y).pow(2).mean()


def backward_residuals(module: torch.nn.Module) -> list:
    """The arrays the backward pass of `module(x, y)` reads, x and y of shape (4, 6, 16)."""
    torch.manual_seed(0)
    model = TorchModel(module)
    params = {n: jnp.asarray(v) for n, v in model.initial_params().items()}
    x = jnp.asarray(RNG.standard_normal((4, 6, 16)).astype(np.float32))
    y = jnp.asarray(RNG.standard_normal((4, 6, 16)).astype(np.float32))
    key = jax.random.key_data(jax.random.key(0))
    _, vjp = jax.vjp(lambda p: model.apply(p, model.initial_buffers(), key, (x, y), training=True)[0], params)
    return [r for r in jax.tree.leaves(vjp) if hasattr(r, "shape")]


def hidden_residuals(module: torch.nn.Module) -> list[tuple]:
    """Shapes of what the backward pass reads that are as wide as the hidden layer (4, 6, 32)."""
    return [r.shape for r in backward_residuals(module) if r.shape == (4, 6, 32)]


@pytest.mark.unit
def test_gelu_backward_keeps_one_residual():
    """GELU keeps its slope beside the second matmul's input. JAX's autodiff of the erf formula
    kept four 32-wide values."""
    wide = hidden_residuals(_Block())
    assert len(wide) == 2, wide


class _SwiGLU(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(16, 32, bias=False)
        self.out = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x, y):
        return (self.out(torch.nn.functional.silu(self.gate(x))) - y).pow(2).mean()


@pytest.mark.unit
def test_silu_backward_keeps_one_residual():
    """SiLU keeps its slope beside the second matmul's input; JAX's autodiff of x * sigmoid(x)
    kept the input and the sigmoid as well."""
    wide = hidden_residuals(_SwiGLU())
    assert len(wide) == 2, wide


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48, bias=False)

    def forward(self, x, y):
        q, k, v = self.qkv(x).split(16, dim=-1)
        causal = torch.ones(6, 6, dtype=torch.bool).tril()
        weights = (q @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf")).softmax(-1)
        return ((weights @ v) - y).pow(2).mean()


@pytest.mark.unit
def test_softmax_backward_keeps_only_its_output():
    """The attention weights are what the backward pass reads of the softmax: its own
    derivative and the weights @ v product both use them. JAX's autodiff of the formula
    (jax.nn.softmax without the global jax_softmax_custom_jvp flag) kept the exponentials and
    the row sums instead, and divided again in the backward."""
    kept = [np.asarray(r) for r in backward_residuals(_Attention())
            if r.shape[:2] == (4, 6) and r.shape[2:] in ((6,), (1,)) and r.dtype == jnp.float32]
    kept = [r for r in kept if r.any()]  # masked_fill's tangent keeps a zero array: not the softmax's
    assert [r.shape for r in kept] == [(4, 6, 6)]
    np.testing.assert_allclose(kept[0].sum(-1), 1.0, rtol=1e-5)  # rows of probabilities


def _llama_norm_block(norm_cls):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(16, 32, bias=False)
            self.norm = norm_cls(32, eps=1e-6)
            self.down = torch.nn.Linear(32, 16, bias=False)

        def forward(self, x, y):
            return (self.down(self.norm(self.up(x))) - y).pow(2).mean()

    return Block()


def _norm_residuals(module) -> list[np.ndarray]:
    """The distinct (4, 6, 32) values the backward pass of `_llama_norm_block` reads."""
    with torch.no_grad():
        module.norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    distinct: list[np.ndarray] = []
    for r in backward_residuals(module):
        if r.shape == (4, 6, 32) and not any(np.array_equal(r, d) for d in distinct):
            distinct.append(np.asarray(r))
    return distinct


@pytest.mark.unit
def test_hf_rms_norm_modules_get_the_derivative_rule(monkeypatch):
    """HF's RMSNorm (separate torch ops) is traced through F.rms_norm: the backward reads the
    normalized input and the scaled one (the next matmul's input), not the input besides.
    A module whose forward differs keeps its own ops."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm

    class ScaledRMSNorm(LlamaRMSNorm):  # a forward of its own: not HF Llama's
        def forward(self, hidden_states):
            return 2.0 * super().forward(hidden_states)

    for cls in (LlamaRMSNorm, MistralRMSNorm):  # Mistral's is a copy of Llama's
        with torch_ops.module_rules(_llama_norm_block(cls)) as patched:
            assert len(patched) == 1
        assert len(_norm_residuals(_llama_norm_block(cls))) == 2
    with torch_ops.module_rules(_llama_norm_block(ScaledRMSNorm)) as patched:
        assert patched == []
    monkeypatch.setattr(torch_ops, "_hf_rms_norm_code", lambda: None)  # the rule off: torch's ops
    assert len(_norm_residuals(_llama_norm_block(LlamaRMSNorm))) == 4  # + the input and 2 x (pow's slope)


@pytest.mark.unit
def test_hf_rms_norm_rule_matches_torch_and_leaves_the_module_as_it_was():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    block = _llama_norm_block(LlamaRMSNorm)
    with torch.no_grad():
        block.norm.weight.copy_(torch.linspace(0.5, 1.5, 32))
    model = TorchModel(block)
    params = {n: jnp.asarray(v) for n, v in model.initial_params().items()}
    x = RNG.standard_normal((4, 6, 16)).astype(np.float32)
    y = RNG.standard_normal((4, 6, 16)).astype(np.float32)
    key = jax.random.key_data(jax.random.key(0))
    loss, grads = jax.value_and_grad(
        lambda p: model.apply(p, model.initial_buffers(), key, (jnp.asarray(x), jnp.asarray(y)), training=True)[0])(params)
    want = block(torch.tensor(x), torch.tensor(y))
    want.backward()
    np.testing.assert_allclose(float(loss), want.item(), rtol=1e-6)
    for name in ("norm.weight", "up.weight"):
        np.testing.assert_allclose(np.asarray(grads[name]), block.get_parameter(name).grad.numpy(), rtol=1e-5, atol=1e-6)
    assert "forward" not in vars(block.norm)  # the patch is undone after tracing


def _sdpa_case(rng, hq=4, hk=4):
    q = rng.standard_normal((2, hq, 5, 8)).astype(np.float32)
    k = rng.standard_normal((2, hk, 6, 8)).astype(np.float32)
    v = rng.standard_normal((2, hk, 6, 3)).astype(np.float32)
    return q, k, v


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["plain", "causal", "bool-mask", "float-mask", "per-head-mask", "gqa",
                                  "gqa-per-head-mask", "scale"])
def test_sdpa_matches_torch(kind):
    rng = np.random.default_rng(1)
    hk = 2 if kind.startswith("gqa") else 4
    q, k, v = _sdpa_case(rng, hk=hk)
    kwargs = {}
    if kind == "causal":  # square scores, as torch's causal mask is the upper-left triangle
        k, v = k[:, :, :5], v[:, :, :5]
        kwargs["is_causal"] = True
    if kind == "bool-mask":
        kwargs["attn_mask"] = rng.random((5, 6)) > 0.3
    if kind == "float-mask":
        kwargs["attn_mask"] = rng.standard_normal((2, 1, 5, 6)).astype(np.float32)
    if kind in ("per-head-mask", "gqa-per-head-mask"):
        kwargs["attn_mask"] = rng.standard_normal((2, 4, 5, 6)).astype(np.float32)
    if kind.startswith("gqa"):
        kwargs["enable_gqa"] = True
    if kind == "scale":
        kwargs["scale"] = 0.3
    if "attn_mask" in kwargs and kwargs["attn_mask"].dtype == bool:
        kwargs["attn_mask"][:, 0] = True  # no fully masked row (NaN in both)
    t = {n: torch.tensor(a) if isinstance(a, np.ndarray) else a for n, a in kwargs.items()}
    want = torch.nn.functional.scaled_dot_product_attention(torch.tensor(q), torch.tensor(k), torch.tensor(v),
                                                            **t)
    j = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kwargs.items()}
    got = sdpa.sdpa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), **j)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5)


@pytest.mark.unit
def test_sdpa_rejects_mismatched_heads_without_gqa():
    rng = np.random.default_rng(1)
    q, k, v = _sdpa_case(rng, hk=2)
    with pytest.raises(errors.UnsupportedOpError, match="enable_gqa=True"):
        sdpa.sdpa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))


@pytest.mark.e2e
def test_tensor_parallel_attention_stays_on_local_heads():
    """HF Llama (SDPA, grouped-query) under Megatron TP2 x DP4 trains like torch, with no
    collective over 'tensor' inside attention (torchax's reference SDPA, flattened by torch
    to 3-D bmm, gathered q, k and v's heads on every layer)."""
    import xtrain
    from test_hf_models import adamw, lm_batches, lm_loss, llama
    from xtrain import plans
    from xtrain.testing import assert_parity, run_parity, torch_reference

    torch.manual_seed(0)
    model, batches = llama(), lm_batches()
    sizes = dict(data=4, tensor=2)
    result = run_parity(model, adamw, batches, xtrain.Mesh(**sizes), plan=plans.megatron(model, sizes),
                        loss_fn=lm_loss, reference=torch_reference(model, adamw, batches, lm_loss))
    assert_parity(result)
    step = xtrain.compile(model, xtrain.Mesh(**sizes), optimizer=adamw(model.parameters()),
                          plan=plans.megatron(model, sizes), loss_fn=lm_loss)
    step(*batches[0])
    inside = [c for c in step.report().collectives if "tensor" in c.axes and "scaled_dot_product" in c.source]
    assert not inside, [(c.kind, c.source) for c in inside]
    # RMSNorm runs through its derivative rule (F.rms_norm): no pow in the layer scan at all
    pows = _layer_scan_pows(step.program(*batches[0]).jaxpr)
    assert not pows, pows


@pytest.mark.e2e
def test_a_squaring_pow_in_the_layer_scan_is_integer_pow(monkeypatch):
    """x.pow(2) (here HF Llama's RMSNorm with the module rule off) runs as integer_pow, a
    multiply: as a pow, the layer scan hoisted the cast exponent out of the loop and XLA:CPU
    ran exp/log on every activation."""
    import xtrain
    from test_hf_models import adamw, lm_batches, lm_loss, llama

    monkeypatch.setattr(torch_ops, "_hf_rms_norm_code", lambda: None)
    torch.manual_seed(0)
    model, batches = llama(), lm_batches()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=adamw(model.parameters()), loss_fn=lm_loss)
    pows = _layer_scan_pows(step.program(*batches[0]).jaxpr)
    assert "pow" not in pows and pows.get("integer_pow"), pows


def _layer_scan_pows(jaxpr, in_scan=False) -> dict:
    """{primitive: count} of pow and integer_pow inside the scans of a program."""
    from collections import Counter

    from jax.extend import core as jcore

    found = Counter()
    for eqn in jaxpr.eqns:
        if in_scan and str(eqn.primitive) in ("pow", "integer_pow"):
            found[str(eqn.primitive)] += 1
        for sub in jcore.jaxprs_in_params(eqn.params):
            found.update(_layer_scan_pows(sub, in_scan or str(eqn.primitive) == "scan"))
    return dict(found)
