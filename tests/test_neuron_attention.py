"""Neuron's NKI flash-attention path (xtrain.ir.kernels.neuron_attention) on CPU: which calls get it, and
its plumbing (layouts, custom_vjp, GQA repeat, per-device grid, partition rule) run through a
stand-in lowered for CPU that computes the kernels' documented contract in plain jnp. The kernels
themselves run only on Trainium (neuronxcc and jax_neuronx are not installed here)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.interpreters import mlir

from xtrain.errors import UnsupportedError
from xtrain.frontend import sdpa
from xtrain.ir import attention as markers
from xtrain.ir import markers as codec
from xtrain.ir.kernels import neuron_attention as nki
from xtrain.ir import walk

NKI, BLOCKWISE = markers.Implementation.NKI_FLASH, markers.Implementation.BLOCKWISE


def _lse_of(rows):  # (b, h, s) -> the kernel's (b, h, 128, s / 128): query = tile * 128 + partition
    b, h, s = rows.shape
    return jnp.swapaxes(rows.reshape(b, h, s // nki.LSE_ROWS, nki.LSE_ROWS), 2, 3)


def _rows_of(lse):
    b, h, p, t = lse.shape
    return jnp.swapaxes(lse, 2, 3).reshape(b, h, p * t)


def _scores(q_t, k_t, scale, causal):  # q_t, k_t: (b, h, d, s) as the kernels take them
    s = jnp.einsum("bhdq,bhdk->bhqk", q_t.astype(jnp.float32), k_t.astype(jnp.float32)) * scale
    if causal:
        n = s.shape[-1]
        s = jnp.where(jnp.arange(n)[None, :] <= jnp.arange(n)[:, None], s, -jnp.inf)
    return s


def contract_forward(q_t, k_t, v, seed, *, softmax_scale, use_causal_mask, mixed_precision, dropout_p, config):
    assert seed.shape == (1,) and seed.dtype == jnp.int32 and dropout_p == 0.0 and mixed_precision
    assert config["seq_tile_size"] >= 512 and k_t.shape[-1] % config["seq_tile_size"] == 0
    s = _scores(q_t, k_t, softmax_scale, use_causal_mask)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhqk,bhkd->bhqd", jnp.exp(s - lse[..., None]), v.astype(jnp.float32))
    return o.astype(v.dtype), _lse_of(lse)


def contract_backward(q_t, k_t, v_t, o_t, dy_t, lse, seed, *, use_causal_mask, mixed_precision, dropout_p,
                      softmax_scale):
    assert seed.shape == (1,) and dropout_p == 0.0
    f32 = lambda x: x.astype(jnp.float32)
    p = jnp.exp(_scores(q_t, k_t, softmax_scale, use_causal_mask) - _rows_of(lse)[..., None])  # (b, h, q, k)
    dv = jnp.einsum("bhqk,bhdq->bhdk", p, f32(dy_t))
    dp = jnp.einsum("bhdq,bhdk->bhqk", f32(dy_t), f32(v_t))
    ds = p * (dp - jnp.sum(f32(dy_t) * f32(o_t), axis=2)[..., None])
    dq = jnp.einsum("bhqk,bhdk->bhdq", ds, f32(k_t)) * softmax_scale
    dk = jnp.einsum("bhqk,bhdq->bhdk", ds, f32(q_t)) * softmax_scale
    return tuple(g.astype(x.dtype) for g, x in ((dq, q_t), (dk, k_t), (dv, v_t)))


class StandIn:
    """`kernel[grid](...)` as NKI launches it; checks the grid is the operands' batch x heads (per device)."""

    def __init__(self, fn):
        self.fn, self.grids = fn, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            assert grid == tuple(args[0].shape[:2]), (grid, args[0].shape)
            self.grids.append(grid)
            return self.fn(*args, **kwargs)
        return launch


STAND_IN = nki.Kernels(StandIn(contract_forward), StandIn(contract_backward), lambda **kw: kw, lambda b, h: (b, h))
nki.register_lowerings(STAND_IN, "cpu")  # only these tests' programs contain the primitives


@pytest.fixture
def on_neuron(monkeypatch):
    monkeypatch.setattr(sdpa, "_backend", lambda: "neuron")
    monkeypatch.setattr(nki, "unavailable", lambda: "")


@pytest.mark.unit
@pytest.mark.parametrize("dtype,dropout,mask,length,dim,want", [
    (jnp.bfloat16, 0.0, None, 1024, 64, ""),
    (jnp.float16, 0.0, None, 512, 128, ""),
    (jnp.float32, 0.0, None, 1024, 64, "float32 (the kernel multiplies in bf16"),
    (jnp.bfloat16, 0.1, None, 1024, 64, "dropout (xtrain's dropout masks do not depend on the mesh"),
    (jnp.bfloat16, 0.0, True, 1024, 64, "an attention mask"),
    (jnp.bfloat16, 0.0, None, 640, 64, "sequence 640 (the kernel tiles it by a multiple of 512)"),
    (jnp.bfloat16, 0.0, None, 1024, 256, "head dim 256 / 256 (at most 128)"),
])
def test_nki_is_chosen_on_neuron_where_it_applies(monkeypatch, dtype, dropout, mask, length, dim, want):
    monkeypatch.setattr(nki, "unavailable", lambda: "")
    q = jax.ShapeDtypeStruct((2, 4, length, dim), dtype)
    m = None if mask is None else jax.ShapeDtypeStruct((2, 1, length, length), jnp.bool_)
    kind, why = sdpa.choose("neuron", q, q, m, dropout)
    assert (kind, why.startswith("not NKI flash attention: ")) == ((NKI, False) if not want else (BLOCKWISE, True))
    assert want in why
    monkeypatch.setattr(nki, "unavailable", lambda: "neuronxcc's NKI kernels are not installed")
    kind, why = sdpa.choose("neuron", q, q, m, dropout)
    assert kind is BLOCKWISE and ("not installed" in why) == (not want), why


@pytest.mark.unit
def test_without_neuronxcc_the_kernels_are_unavailable():
    assert nki.unavailable() == "neuronxcc's NKI kernels are not installed"  # this machine has no Neuron SDK
    q = jax.ShapeDtypeStruct((2, 4, 1024, 64), jnp.bfloat16)
    assert sdpa.choose("neuron", q, q, None, 0.0) == (
        BLOCKWISE, "not NKI flash attention: neuronxcc's NKI kernels are not installed")


@pytest.mark.unit
@pytest.mark.parametrize("length,tile", [(512, 512), (1024, 1024), (1536, 1536), (3072, 1536), (4096, 2048),
                                         (2560, 512), (640, 0), (256, 0)])
def test_sequence_tile_is_the_largest_multiple_of_512_dividing_it(length, tile):
    assert nki.seq_tile(length) == tile


def _reference(q, k, v, causal, scale):
    k, v = (jnp.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


def _out_and_grads(f, q, k, v):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape).astype(out.dtype))


@pytest.mark.unit
@pytest.mark.parametrize("heads", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("causal", [True, False])
def test_nki_path_equals_softmax_attention(on_neuron, heads, causal):
    """fp32 through the primitives (layouts, custom_vjp, the repeat's summed gradient) equals plain
    softmax attention tightly; bf16 through sdpa, which picks NKI, within bf16 rounding."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 4, 512, 16))
    k, v = (jax.random.normal(x, (2, heads, 512, 16)) for x in keys[1:])
    want, want_grads = jax.jit(lambda *x: _out_and_grads(lambda *a: _reference(*a, causal, 0.25), *x))(q, k, v)
    direct = lambda q, k, v: nki.flash(q, jnp.repeat(k, 4 // heads, 1), jnp.repeat(v, 4 // heads, 1), causal, 0.25, 512)
    got, got_grads = jax.jit(lambda *x: _out_and_grads(direct, *x))(q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-4)
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    through_sdpa = lambda q, k, v: sdpa.sdpa(q, k, v, is_causal=causal, scale=0.25, enable_gqa=True)
    jaxpr = jax.make_jaxpr(through_sdpa)(*half)
    assert {codec.outermost(markers.Site, e.source_info.name_stack) for e, _ in walk.equations(jaxpr.jaxpr, frozenset())} \
        >= {markers.Site(NKI, block=512)}
    got, got_grads = jax.jit(lambda *x: _out_and_grads(through_sdpa, *x))(*half)
    np.testing.assert_allclose(got.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)
    for g, w in zip(got_grads, want_grads):  # bf16: 8 bits of mantissa on O(1..10) values
        np.testing.assert_allclose(g.astype(jnp.float32), w, atol=6e-2, rtol=3e-2)


def _llama_step(sizes, plan=None, **compile_kwargs):
    import xtrain
    from test_hf_models import lm_loss, llama
    from xtrain import plans

    torch.manual_seed(0)
    model = llama().to(torch.bfloat16)
    plan = plans.megatron(model, sizes) if "tensor" in sizes else plan
    return model, xtrain.compile(model, xtrain.Mesh(**sizes), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 plan=plan, loss_fn=lm_loss, **compile_kwargs)


@pytest.mark.e2e
def test_nki_attention_runs_on_each_devices_shard(monkeypatch, on_neuron):
    """A bf16 HF Llama (grouped-query heads, 512 tokens) on data=4 x tensor=2 (Megatron): attention is
    the NKI primitives, each device launches them on its own batch x heads shard (grid (1, 2): one
    sample, 2 of 4 query heads) with no collective inside attention, and the losses of 3 SGD steps
    and attention weights' updates match the blockwise kernel's within bf16 rounding."""
    from test_hf_models import lm_batches
    from xtrain.step import explain

    sizes = dict(data=4, tensor=2)
    model, step = _llama_step(sizes)
    batches = lm_batches(n=3, batch=4, seq=512)
    program = step.program(*batches[0])
    prims = {str(e.primitive) for e, _ in walk.equations(program.jaxpr, frozenset())}
    assert {nki.forward_p.name, nki.backward_p.name} <= prims
    inside = [c for c in explain.collectives(step, *batches[0]) if "xtrain_attention" in c.source]
    assert not inside, [(c.kind, c.axes, c.source) for c in inside]
    sites = markers.sites(program.jaxpr, step.model.module_paths())
    assert {s.implementation for s in sites.values()} == {NKI}, sites
    STAND_IN.forward.grids.clear()
    start = {n: p.float() for n, p in model.state_dict().items() if "self_attn" in n}
    nki_losses = [float(step(*b)["loss"]) for b in batches]
    assert set(STAND_IN.forward.grids) == {(1, 2)}, STAND_IN.forward.grids
    monkeypatch.setattr(sdpa, "_backend", lambda: "cpu")
    _, blockwise = _llama_step(sizes)
    block_sites = markers.sites(blockwise.program(*batches[0]).jaxpr, blockwise.model.module_paths())
    assert {s.implementation for s in block_sites.values()} == {BLOCKWISE}
    block_losses = [float(blockwise(*b)["loss"]) for b in batches]
    # bf16 throughout: the kernels round probabilities and outputs differently (relative 2^-8), but
    # the loss at init hardly depends on attention (a non-causal stand-in moves it by 5e-5), so the
    # loss bound is loose and the attention weights' 3 updates are the sharp check: an update near
    # half a bf16 weight ulp rounds either way (measured: <= 6% of the update's norm; non-causal: >= 70%)
    np.testing.assert_allclose(nki_losses, block_losses, rtol=1e-3)
    got, want = step.state_dict(), blockwise.state_dict()
    for name, p0 in start.items():
        moved = want[name].float() - p0
        assert float((got[name].float() - p0 - moved).norm()) <= 0.2 * float(moved.norm()) + 1e-6, name


@pytest.mark.e2e
def test_nki_attention_under_ulysses_sees_whole_sequences(monkeypatch, on_neuron):
    """Plan(context="ulysses") on data=2 x context=4: the sequence split over `context` becomes a
    head split around the NKI kernels (all-to-alls, no all-gather over `context` in attention);
    each device launches them on (2 samples, 1 of 4 heads) over all 512 tokens, and training
    matches the blockwise kernel's under the same plan within bf16 rounding."""
    import xtrain
    from test_hf_models import lm_batches
    from xtrain.step import explain

    sizes, plan = dict(data=2, context=4), xtrain.Plan(context="ulysses")
    STAND_IN.forward.grids.clear()
    model, step = _llama_step(sizes, plan=plan)
    batches = lm_batches(n=3, batch=4, seq=512)
    sites = markers.sites(step.program(*batches[0]).jaxpr, step.model.module_paths())
    assert {s.implementation for s in sites.values()} == {NKI}, sites
    inside = {(c.kind, c.axes) for c in explain.collectives(step, *batches[0]) if "self_attn" in c.source}
    assert ("all-to-all", ("context",)) in inside and ("all-gather", ("context",)) not in inside, inside
    assert any("Ulysses over 'context'=4" in n and "NKI" in n for n in step.report(*batches[0]).notes)
    start = {n: p.float() for n, p in model.state_dict().items() if "self_attn" in n}
    nki_losses = [float(step(*b)["loss"]) for b in batches]
    assert set(STAND_IN.forward.grids) == {(2, 1)}, STAND_IN.forward.grids
    monkeypatch.setattr(sdpa, "_backend", lambda: "cpu")
    _, blockwise = _llama_step(sizes, plan=plan)
    block_losses = [float(blockwise(*b)["loss"]) for b in batches]
    np.testing.assert_allclose(nki_losses, block_losses, rtol=1e-3)  # bf16: see the test above
    got, want = step.state_dict(), blockwise.state_dict()
    for name, p0 in start.items():
        moved = want[name].float() - p0
        assert float((got[name].float() - p0 - moved).norm()) <= 0.2 * float(moved.norm()) + 1e-6, name


@pytest.mark.e2e
def test_step_lowered_for_neuron_on_cpu_keeps_the_blockwise_kernel():
    """Lowered for Neuron on this CPU host (no plugin), attention is traced for the host's backend:
    the blockwise kernel, and nothing in the program needs the NKI kernels' lowering."""
    from test_hf_models import lm_batches

    model, step = _llama_step(dict(data=8))
    batch = lm_batches(n=1, batch=8, seq=16)[0]
    text = step.lower(*batch, platform="neuron").as_text(dialect="hlo")
    assert "nki" not in text.lower()
    sites = markers.sites(step.program(*batch).jaxpr, step.model.module_paths())
    assert {(s.implementation, s.why) for s in sites.values()} == {(BLOCKWISE, "")}, sites


@pytest.mark.e2e
def test_context_meshes_and_xlas_partitioner_get_the_blockwise_kernel(on_neuron, monkeypatch):
    """xtrain.compile rules the NKI kernels out where they cannot run split: a sequence split over
    `context` (ring attention) and lowering='xla' (the kernel call is opaque to XLA's partitioner).
    Forced onto a context mesh anyway, the partition rule refuses rather than gather the sequence."""
    from test_hf_models import lm_batches
    from xtrain.sharding import plan as plan_mod

    assert "split over 'context'" in plan_mod.no_nki(dict(data=4, context=2), "explicit")
    assert plan_mod.no_nki(dict(data=8), "explicit") == ""
    model, step = _llama_step(dict(data=8), lowering="xla")
    batch = lm_batches(n=1, batch=8, seq=512)[0]
    sites = markers.sites(step.program(*batch).jaxpr, step.model.module_paths())
    assert {s.implementation for s in sites.values()} == {BLOCKWISE}
    assert all("lowering='xla' (XLA's partitioner cannot split the kernel call)" in s.why for s in sites.values())
    monkeypatch.setattr(plan_mod, "no_nki", lambda *_: "")  # what compile would not do
    model, step = _llama_step(dict(data=4, context=2))
    with pytest.raises(UnsupportedError, match="NKI flash-attention kernel on a mesh with 'context'=2"):
        step.program(*batch)


@pytest.mark.unit
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_flops_are_counted(causal):
    """The kernels' matmuls count as model FLOPs (MFU, the cost model): forward q.k and p.v,
    backward those recomputed and dp, dq, dk; a causal mask skips half."""
    from xtrain.ir.analysis import flops

    x = jnp.zeros((2, 4, 1024, 64), jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(nki.flash(q, k, v, causal, 0.125, 1024).astype(jnp.float32))
    counted = flops.count(jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, x, x)).matmul
    assert counted == 7 * 2.0 * 2 * 4 * 1024 * 1024 * 64 * (0.5 if causal else 1.0)
