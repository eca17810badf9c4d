"""cuDNN's fused attention (jax.nn.dot_product_attention on CUDA, xtrain.frontend.sdpa's choice there)
under a Megatron plan, on CPU with a GPU's backend stood in: the dimension flow carries the head split
through its primitives (xtrain.ir.analysis.per_head), so each device runs them on its own batch x heads shard
(xtrain.lowering.explicit.rules.attention), grouped-query and multi-query keys/values included. A CPU
lowering of the primitives computing their contract (softmax attention, each key/value head read by
its group of query heads) in plain jnp lets the split program train, against the same on one axis."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax._src.cudnn import fused_attention_stablehlo as cudnn
from jax.interpreters import mlir

from xtrain.frontend import sdpa
from xtrain.ir import attention as markers
from xtrain.ir import walk
from xtrain.ir.analysis import per_head

pytestmark = pytest.mark.e2e

HEADS = 4
LOWERED: list = []  # the query shapes the stand-in forward kernel was lowered for


def _reference(q, k, v, scale, causal):  # (b, t, n, h); keys / values (b, s, n_kv, h)
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2).astype(jnp.float32) for x in (k, v))
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), k) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", jnp.exp(s - lse[..., None]), v).astype(q.dtype), lse


def _forward(q, k, v, *placeholders, scale, mask_type, layout, is_training, **_):
    LOWERED.append(tuple(q.shape))  # lowered on each device's shard
    assert layout == cudnn.AttentionLayout.BTNH.value and all(p.size == 0 for p in placeholders)
    out, lse = _reference(q, k, v, scale, mask_type == cudnn.MaskType.CAUSAL)
    return [out, lse] if is_training else [out]


def _backward(q, k, v, *rest, scale, mask_type, layout, **_):
    *placeholders, _, _, dy = rest  # ..., statistics, forward output, its cotangent
    assert layout == cudnn.AttentionLayout.BTNH.value and all(p.size == 0 for p in placeholders)
    _, vjp = jax.vjp(lambda *x: _reference(*x, scale, mask_type == cudnn.MaskType.CAUSAL)[0], q, k, v)
    return list(vjp(dy))


# only these tests' programs contain the primitives on CPU (elsewhere they lower for CUDA alone)
for _prim, _fn in ((cudnn._dot_product_attention_fwd_p_wrapper, _forward),
                   (cudnn._dot_product_attention_bwd_p_wrapper, _backward)):
    mlir.register_lowering(_prim, mlir.lower_fun(_fn, multiple_results=True), platform="cpu")


@pytest.fixture
def on_cuda(monkeypatch):  # cuDNN's kernel cannot be traced without a GPU's backend
    monkeypatch.setattr(sdpa, "_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a: True)


def _llama(kv_heads: int, dtype):
    from test_hf_models import VOCAB
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=kv_heads, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)).to(dtype)


def _llama_step(kv_heads: int, sizes: dict):
    import xtrain
    from test_hf_models import lm_loss
    from xtrain import plans

    model = _llama(kv_heads, torch.bfloat16)
    plan = plans.megatron(model, sizes) if "tensor" in sizes else None
    return model, xtrain.compile(model, xtrain.Mesh(**sizes), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                 plan=plan, loss_fn=lm_loss)


@pytest.mark.parametrize("kv_heads", [2, 1])  # grouped-query, multi-query
def test_cudnn_attention_runs_on_each_devices_shard(on_cuda, kv_heads):
    """A bf16 HF Llama on data=4 x tensor=2 (Megatron): attention is cuDNN's, each device's query
    operand holds 2 of the 4 heads (and its share of the key/value heads; one whole), and nothing in
    the attention layer gathers over `tensor`; inside attention no collective, but the multi-query
    key/value gradients' sums over the query heads' devices."""
    from test_hf_models import lm_batches
    from xtrain.step import explain

    sizes = dict(data=4, tensor=2)
    model, step = _llama_step(kv_heads, sizes)
    batch = lm_batches(n=1)[0]
    program = step.program(*batch)
    sites = markers.sites(program.jaxpr, step.model.module_paths())
    assert {s.implementation for s in sites.values()} == {markers.Implementation.CUDNN}, sites
    kernels = [e for e, _ in walk.equations(program.jaxpr, frozenset()) if e.primitive.name in (
        per_head.CUDNN_FORWARD, per_head.CUDNN_BACKWARD)]
    assert {e.primitive.name for e in kernels} == {per_head.CUDNN_FORWARD, per_head.CUDNN_BACKWARD}
    local = 8 // sizes["data"]
    for e in kernels:  # (batch, length, heads, dim) per device
        q, k, v = (tuple(x.aval.shape) for x in e.invars[:3])
        assert (q, k, v) == ((local, 16, HEADS // 2, 8),) + ((local, 16, max(kv_heads // 2, 1), 8),) * 2, e
    found = explain.collectives(step, *batch)
    gathers = [c for c in found if c.kind == "all-gather" and "tensor" in c.axes and "self_attn" in c.source]
    assert not gathers, [(c.kind, c.axes, c.source) for c in gathers]
    inside = [(c.kind, c.axes) for c in found if "xtrain_attention" in c.source]
    assert inside == ([] if kv_heads > 1 else [("all-reduce", ("tensor",))] * 2 * 2), inside


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_cudnn_attention_split_over_heads_matches_torch(on_cuda, monkeypatch, kv_heads):
    """The parity standard (fp32, 4 SGD steps against torch on one device) on data=4 x tensor=2,
    Megatron, through the stand-in kernels (cuDNN's dtypes widened to fp32 for it): each device
    lowers them on 1 sample and 2 of the 4 query heads, and trains as torch does."""
    import xtrain
    from test_hf_models import lm_batches, lm_loss
    from xtrain import plans
    from xtrain.testing import assert_parity, run_parity

    monkeypatch.setattr(sdpa, "_CUDNN_DTYPES", (jnp.float32,))
    monkeypatch.setattr(cudnn, "check_layout", lambda *a, **kw: None)  # it refuses fp32 (the stand-in checks the layout)
    sizes = dict(data=4, tensor=2)
    model = _llama(kv_heads, torch.float32)
    LOWERED.clear()
    result = run_parity(model, lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), lm_batches(batch=4),
                        xtrain.Mesh(**sizes), plan=plans.megatron(model, sizes), loss_fn=lm_loss)
    assert set(LOWERED) == {(1, 16, HEADS // 2, 8)}, LOWERED
    assert_parity(result)


def test_bf16_plan_runs_cudnn_on_a_float32_model(monkeypatch):
    """Plan(precision="bf16") on a float32 model (fp32 master weights, the usual mixed precision):
    attention is cuDNN's on bf16 operands, as torch.autocast runs SDPA (it was the blockwise kernel:
    the trace saw float32 queries), and the step trains as the same plan with the blockwise kernel
    does, within bf16's rounding."""
    import copy

    import xtrain
    from test_hf_models import lm_batches, lm_loss

    model = _llama(2, torch.float32)
    twin = copy.deepcopy(model)
    batches = lm_batches(n=3)

    def train(m):
        step = xtrain.compile(m, xtrain.Mesh(data=-1), optimizer=torch.optim.SGD(m.parameters(), lr=0.5),
                              plan=xtrain.Plan(precision="bf16"), loss_fn=lm_loss)
        return step, [step(*b)["loss"] for b in batches]

    blockwise, expected = train(twin)
    assert {s.implementation for s in markers.sites(blockwise.program(*batches[0]).jaxpr,
                                                     blockwise.model.module_paths()).values()} == {
        markers.Implementation.BLOCKWISE}
    monkeypatch.setattr(sdpa, "_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a: True)
    step, losses = train(model)
    program = step.program(*batches[0])
    sites = markers.sites(program.jaxpr, step.model.module_paths())
    assert {s.implementation for s in sites.values()} == {markers.Implementation.CUDNN}, sites
    kernels = [e for e, _ in walk.equations(program.jaxpr, frozenset()) if e.primitive.name in (
        per_head.CUDNN_FORWARD, per_head.CUDNN_BACKWARD)]
    assert kernels and all(x.aval.dtype == jnp.bfloat16 for e in kernels for x in e.invars[:3]), kernels
    np.testing.assert_allclose(losses, expected, rtol=2e-2)
    for name, p in step.state_dict().items():
        np.testing.assert_allclose(np.asarray(p), np.asarray(blockwise.state_dict()[name]), atol=2e-2, err_msg=name)


def test_a_step_prepared_for_the_gpu_itself_keeps_cudnn(on_cuda):
    """xtrain.aot's prepare(on_device=True) (benchmarks/gpu_step.py: built here, compiled and run on
    the GPU) exports the step with cuDNN's kernels, under a bf16 plan of a float32 model."""
    import xtrain
    from test_hf_models import lm_loss
    from xtrain.aot import request, targets
    from xtrain.frontend.torch_module import wrap

    model = _llama(2, torch.float32)
    trainable = wrap(model, torch.optim.AdamW(model.parameters()), lm_loss)
    ids = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    prepared = request.prepare(trainable, xtrain.Mesh(data=-1), xtrain.Plan(precision="bf16"), (ids, ids),
                               targets.gpu_target("p5.48xlarge"), on_device=True)
    module = jax.export.deserialize(prepared.job["exported"]).mlir_module()
    assert module.count("__cudnn$fmhaSoftmax(") == 2 and module.count("__cudnn$fmhaSoftmaxBackward(") == 2  # 2 layers


def test_the_cost_model_prices_attention_a_gpu_fuses_as_fused(monkeypatch):
    """Planning for p5 on this CPU host traces attention with the blockwise kernel; the calls a
    CUDA host hands to cuDNN are marked (Site.fused_on) and priced without their softmax traffic,
    so the prediction matches the one for the step traced as on the GPU (cuDNN), where pricing
    the blockwise kernel's traffic made it 1.85x slower for a 1.1B Llama (measured on an H200:
    benchmarks/results/gpu_step_h200.md). A ring over `context` is not fused: no mark."""
    import dataclasses

    import xtrain
    from test_hf_models import lm_loss
    from transformers import LlamaConfig, LlamaForCausalLM
    from xtrain.cost import hardware, search
    from xtrain.cost import model as cost_model
    from xtrain.frontend.torch_module import wrap

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                             max_position_embeddings=2048, bos_token_id=0, eos_token_id=0))
    t = wrap(model, torch.optim.AdamW(model.parameters()), lm_loss)
    ids = jax.ShapeDtypeStruct((8, 2048), jnp.int32)
    profile, _ = hardware.target("p5.48xlarge")

    def predict(**candidate):
        row, = search.search(t.model, t.tx, (ids, ids), profile, 8, structure=t.structure, prune_remat=False,
                             candidate_list=[search.Candidate(precision="bf16", **candidate)]).rows
        return row.prediction.step_s

    here = predict(data=8)
    cost = search.step_cost(search.program_mod.abstract_step(
        search.program_mod.trainable_of(t.model, t.tx), {"data": 8}, xtrain.Plan(precision="bf16"), (ids, ids)),
        {"data": 8}, 8 * 2048)
    assert cost.flops.cuda_fused_elementwise > 0.5 * (cost.flops.elementwise + cost.flops.reduce)  # softmax-heavy
    unfused = dataclasses.replace(profile, name="p5-without-cudnn")
    assert unfused.fused_attention == "" and profile.fused_attention == "cuda"
    assert cost_model.compute_seconds(cost.flops, profile) < 0.7 * cost_model.compute_seconds(cost.flops, unfused)
    ring = search.step_cost(search.program_mod.abstract_step(
        search.program_mod.trainable_of(t.model, t.tx), {"data": 2, "context": 4}, xtrain.Plan(precision="bf16"),
        (ids, ids)), {"data": 2, "context": 4}, 8 * 2048)
    assert ring.flops.cuda_fused_elementwise == 0
    monkeypatch.setattr(sdpa, "_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda *a: True)
    on_gpu = predict(data=8)
    assert here == pytest.approx(on_gpu, rel=0.1), (here, on_gpu)
