"""Plan(precision="fp8"): matmuls with float8_e4m3fn operands and float8_e5m2 gradients, per-tensor
current scaling (xtrain.lowering.fp8). On CPU XLA computes FP8 dots by upcasting, so the recipe is
checked bit for bit against a plain numpy reference, the matmul's gradients exactly on values the
formats hold, training against bf16, and the program compiled for H100 keeps its FP8 GEMMs."""
import copy
import functools
import dataclasses
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import xtrain
from xtrain.cost import hardware
from xtrain.errors import OptionsError, PlanError, UnsupportedError
from xtrain.lowering import fp8
from xtrain.sharding.precision import Precision

pytestmark = pytest.mark.e2e


def _reference(x: np.ndarray, fmt, out) -> np.ndarray:
    """The recipe in numpy: scale = amax x (1 / largest), round x / scale into the format, back times scale."""
    amax = np.max(np.abs(x)).astype(np.float32)
    largest = np.float32(ml_dtypes.finfo(fmt).max)
    scale = amax * np.float32(1 / largest) if amax > 0 else np.float32(1)
    q = np.clip(x / scale, -largest, largest).astype(fmt)
    return q.astype(out) * np.asarray(scale).astype(out)


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_quantize_dequantize_equals_a_numpy_reference_bit_for_bit(fmt):
    rng = np.random.default_rng(0)
    for x in (rng.normal(size=(64, 48)) * 3, rng.standard_cauchy(size=(128,)), np.zeros((4, 4)),
              np.exp(rng.uniform(-20, 20, size=(256,))) * rng.choice([-1, 1], size=256)):
        x = x.astype(np.float32)
        got = np.asarray(fp8.quantize_dequantize(jnp.asarray(x), fmt, jnp.bfloat16))
        want = _reference(x, np.dtype(fmt), ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


DIMENSION_NUMBERS = [((4, 8), (8, 16), (((1,), (0,)), ((), ()))),           # x @ w
                     ((2, 5, 8), (16, 8), (((2,), (1,)), ((), ()))),        # torch's linear: ...a,ba->...b
                     ((3, 4, 8), (3, 8, 6), (((2,), (1,)), ((0,), (0,)))),  # batched
                     ((8, 3, 4), (6, 8), (((0,), (1,)), ((), ())))]          # contracting a leading dim


@pytest.mark.parametrize("x_shape,w_shape,dims", DIMENSION_NUMBERS)
def test_fp8_matmul_and_its_gradients_are_exact_on_values_the_formats_hold(x_shape, w_shape, dims):
    """Operands of e4m3 values whose amax is its largest (scale 1) and a cotangent of e5m2 values
    scaled by a power of two: the FP8 matmul, its forward and both gradients (the backward's FP8
    matmuls, transposed by hand for every dimension layout) equal float32's exactly."""
    rng = np.random.default_rng(1)

    def held(shape, top):
        v = rng.choice([0.0, 0.5, -1.0, 2.0, -3.0, 1.5, 4.0], size=shape).astype(np.float32)
        v.flat[0] = top
        return jnp.asarray(v)

    x, w = held(x_shape, 448.0), held(w_shape, -448.0)
    out = jax.eval_shape(lambda a, b: jax.lax.dot_general(a, b, dims), x, w)
    c = held(out.shape, 57344.0) / 1024
    fp8_loss = lambda a, b: jnp.sum(fp8.matmul(a, b, dims, jnp.dtype(jnp.float32)) * c)
    plain_loss = lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dims) * c)
    assert float(fp8_loss(x, w)) == float(plain_loss(x, w))
    want = jax.grad(plain_loss, (0, 1))(x, w)
    # under jax.checkpoint too (remat, ZeRO-3's re-gather save or recompute the FP8 operands; a
    # saved e4m3fn value of 448 once came back NaN through JAX's reduce_precision(4, 3))
    for policy in (None, jax.checkpoint_policies.everything_saveable, jax.checkpoint_policies.nothing_saveable):
        loss = fp8_loss if policy is None else jax.checkpoint(fp8_loss, policy=policy)
        for got, expected in zip(jax.grad(loss, (0, 1))(x, w), want):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def _fp8_dots(jaxpr) -> int:
    from xtrain.ir import walk

    return sum(1 for e, _ in walk.equations(jaxpr, frozenset()) if e.primitive.name == "dot_general"
               and all(str(v.aval.dtype).startswith("float8") for v in e.invars))


def test_fp8_plan_trains_as_bf16_does_on_data_and_tensor_parallel():
    """A float32 HF Llama under Plan(precision="fp8"): every linear layer's matmul and its two
    backward matmuls take FP8 operands (one layer's body, shared by both layers, and the LM head:
    8 x 3 distinct equations; bf16_modules keeps the LM head's in bf16),
    and 5 AdamW steps track the bf16 plan's losses, on data=8, on Megatron data=2 x tensor=4 and
    under ZeRO-3
    (one scale per tensor: the amax of a split tensor is max-reduced over its axes)."""
    from test_cudnn_attention import _llama
    from test_hf_models import lm_batches, lm_loss
    from xtrain import plans

    model = _llama(2, torch.float32)
    batches = lm_batches(n=5)

    def compiled(precision, sizes, **policy):
        m = copy.deepcopy(model)
        plan = plans.megatron(m, sizes) if "tensor" in sizes else xtrain.Plan()
        plan = dataclasses.replace(plan, precision=Precision(compute=precision, **policy))
        return xtrain.compile(m, xtrain.Mesh(**sizes), optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2),
                              plan=plan, loss_fn=lm_loss)

    def train(precision, sizes, **policy):
        step = compiled(precision, sizes, **policy)
        return step, np.array([step(*b)["loss"] for b in batches])

    _, bf16 = train("bf16", dict(data=8))
    step, data = train("fp8", dict(data=8))
    assert _fp8_dots(step.program(*batches[0]).jaxpr) == 8 * 3
    kept = compiled("fp8", dict(data=8), bf16_modules=("lm_head",))  # traced, not run
    assert _fp8_dots(kept.program(*batches[0]).jaxpr) == 7 * 3
    _, tensor = train("fp8", dict(data=2, tensor=4))
    np.testing.assert_allclose(data, bf16, rtol=5e-3)
    np.testing.assert_allclose(tensor, data, rtol=5e-3)
    m = copy.deepcopy(model)  # ZeRO-3 with its backward re-gather (a jax.checkpoint policy)
    zero3 = xtrain.compile(m, xtrain.Mesh(data=8), optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2),
                           plan=xtrain.Plan(zero=3, precision="fp8"), loss_fn=lm_loss)
    np.testing.assert_allclose([zero3(*b)["loss"] for b in batches], data, rtol=5e-3)


def test_fp8_is_refused_where_the_hardware_has_none():
    for instance in ("p4d.24xlarge", "p4de.24xlarge", "trn1.32xlarge"):
        profile, _ = hardware.target(instance)
        with pytest.raises(UnsupportedError, match=f"{re.escape(instance)} has no FP8"):
            profile.check_precision("fp8")
    for instance in ("p5.48xlarge", "p5e.48xlarge", "trn2.48xlarge"):
        hardware.target(instance)[0].check_precision("fp8")
    with pytest.raises(UnsupportedError, match="A100-SXM4-40GB has no FP8"):
        hardware.check_device_precision("NVIDIA A100-SXM4-40GB", "fp8")
    hardware.check_device_precision("NVIDIA H100 80GB HBM3", "fp8")
    assert hardware.peak_flops("NVIDIA H200", "float8_e4m3fn") == pytest.approx(2 * hardware.peak_flops("NVIDIA H200", "bf16"),
                                                                           rel=1e-3)
    with pytest.raises(PlanError, match="bf16_modules"):
        Precision(compute="bf16", bf16_modules=("lm_head",))


@pytest.mark.parametrize("scaling", ["current", "delayed", "rowwise"])
def test_fp8_gemms_survive_the_gpu_compiler(scaling):
    """Compiled for 8 x H100 (deviceless): the GEMMs of the linear layers take FP8 operands, with
    current, delayed and rowwise scaling. (A quantize-dequantize round trip feeding a bf16 dot does not:
    XLA's GPU compiler drops it as excess precision, and the matmul would run in bf16.)"""
    from test_hf_models import lm_loss
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    ids = jax.ShapeDtypeStruct((16, 64), np.int32)
    program = xtrain.aot.compile(model, xtrain.Mesh(data=-1), target="p5.48xlarge", loss_fn=lm_loss,
                                 optimizer=torch.optim.AdamW(model.parameters()),
                                 plan=xtrain.Plan(precision=Precision(compute="fp8", scaling=scaling)), batch=(ids, ids))
    types = dict(re.findall(r"%([\w.\-]+) = ([a-z0-9]+)\[", program.text))
    gemms = [re.findall(r"%([\w.\-]+)", re.search(r"fusion\(([^)]*)\)", line).group(1))
             for line in program.text.splitlines() if '"kind":"__triton_nested_gemm_fusion"' in line]
    fp8_gemms = [g for g in gemms if any(types.get(n, "").startswith("f8") for n in g)]
    # 8 linear layers x 3 matmuls (XLA merges those sharing an operand) and attention's 6 float32 ones
    assert len(fp8_gemms) >= 16 and len(gemms) - len(fp8_gemms) <= 6, (len(fp8_gemms), len(gemms))


@functools.cache
def _meta_llama():
    """A 2-layer Llama of 1024 hidden on the meta device, wrapped, and its batch's shape."""
    from test_hf_models import lm_loss
    from transformers import LlamaConfig, LlamaForCausalLM
    from xtrain.frontend.torch_module import wrap

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=4096,
                                             num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8,
                                             max_position_embeddings=512, bos_token_id=0, eos_token_id=0))
    return wrap(model, torch.optim.AdamW(model.parameters()), lm_loss), jax.ShapeDtypeStruct((64, 512), np.int32)


def test_the_default_search_lists_fp8_beside_the_pick_where_the_target_has_it():
    """Without a precision the search on p5 also costs the fastest candidates with FP8 matmuls and
    lists them, never picked (FP8 changes the numerics: the script asks for it); p4d lists none.
    (`fp8_rows`: the default candidates get them; here a short list stands in for them.)"""
    from xtrain.cost import search

    t, ids = _meta_llama()
    listed = []
    for instance in ("p5.48xlarge", "p4d.24xlarge"):
        profile, devices = hardware.target(instance)
        plain = [search.Candidate(data=devices, precision="bf16"), search.Candidate(data=devices, zero=3, precision="bf16")]
        result = search.search(t.model, t.tx, (ids, ids), profile, devices, structure=t.structure,
                               candidate_list=plain, prune_remat=False, fp8_rows=search.FP8_ROWS)
        fp8 = [r for r in result.rows if r.candidate.precision == "fp8"]
        listed.append(len(fp8))
        assert result.best is not None and result.best.candidate.precision == "bf16"
        assert all(r.listed_only and not r.usable and r.reason == search.FP8_LISTED and r.prediction.fits
                   for r in fp8), fp8
        if fp8:  # the listing shows them with their own predictions
            assert search.FP8_LISTED in result.listing() and {r.candidate.zero for r in fp8} == {0, 3}
    assert listed == [2, 0], listed
    with pytest.raises(OptionsError, match=r"search\(fp8_rows=-1\)"):
        search.search(t.model, t.tx, (ids, ids), profile, devices, fp8_rows=-1)


def test_the_plan_search_costs_fp8_where_the_target_has_it():
    """`xtrain plan --precision fp8` (search(precision="fp8")): on p5 the candidates are costed with
    FP8 matmuls, their MFU against the H100's FP8 peak (twice bf16's: the same model FLOPs over
    step x peak); on p4d refused, naming the instance."""
    from xtrain.cost import search

    t, ids = _meta_llama()
    rows = {}
    for instance, precision in (("p5.48xlarge", "bf16"), ("p5.48xlarge", "fp8"), ("p4d.24xlarge", "fp8")):
        profile, devices = hardware.target(instance)
        row, = search.search(t.model, t.tx, (ids, ids), profile, devices, structure=t.structure, precision=precision,
                             candidate_list=[search.Candidate(data=devices)], prune_remat=False).rows
        if instance == "p4d.24xlarge":
            assert row.prediction is None and "p4d.24xlarge has no FP8 arithmetic" in row.reason, row.reason
        else:
            assert row.usable, row.reason
            rows[precision] = row.prediction
    useful = {k: p.mfu * p.step_s * hardware.peak_flops("H100 80GB HBM3", k) for k, p in rows.items()}
    assert useful["fp8"] == pytest.approx(useful["bf16"], rel=1e-3), useful


def _quantized(x: np.ndarray, amax, fmt) -> tuple[np.ndarray, np.float32]:
    """numpy's delayed-scaling quantization: the scale from the history's amax (1 when it is 0)."""
    largest = np.float32(ml_dtypes.finfo(fmt).max)
    scale = np.float32(amax) * np.float32(1 / largest) if amax > 0 else np.float32(1)
    return np.clip(x / scale, -largest, largest).astype(fmt), np.float32(scale)


def test_delayed_scaling_quantizes_from_the_history_and_records_each_steps_amaxes_bit_for_bit():
    """Delayed scaling (Precision(scaling="delayed")): four steps of x @ w, each quantizing with the
    largest amax of the (3, H) history (a fresh history: scale 1; values past the format's range
    saturate), and leaving this step's amaxes of x, w and the cotangent as the history's
    cotangent; rolled in (newest first, the oldest dropped) they equal numpy's record bit for bit,
    and the product and both gradients are those of numpy's quantized operands."""
    rng = np.random.default_rng(3)
    dims = (((1,), (0,)), ((), ()))
    history = np.zeros((3, 3), np.float32)
    f32 = jnp.dtype(jnp.float32)
    for step in range(4):
        x, w = (rng.normal(size=s).astype(np.float32) * 10.0 ** rng.uniform(-3, 3) for s in ((6, 8), (8, 5)))
        g = rng.normal(size=(6, 5)).astype(np.float32) * 1e-3
        y, vjp = jax.vjp(lambda a, b, h: fp8.delayed_matmul(a, b, h, dims, f32), jnp.asarray(x), jnp.asarray(w),
                         jnp.asarray(history))
        dx, dw, record = vjp(jnp.asarray(g))
        (qx, sx), (qw, sw), (qg, sg) = (_quantized(t, np.max(history[i]), fmt) for i, (t, fmt) in
                                        enumerate([(x, ml_dtypes.float8_e4m3fn), (w, ml_dtypes.float8_e4m3fn),
                                                   (g, ml_dtypes.float8_e5m2)]))
        dot = lambda a, b, d: jax.lax.dot_general(jnp.asarray(a), jnp.asarray(b), d, preferred_element_type=jnp.float32)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(dot(qx, qw, dims) * (sx * sw)))
        np.testing.assert_array_equal(np.asarray(dx), np.asarray(dot(qg, qw, (((1,), (1,)), ((), ()))) * (sg * sw)))
        np.testing.assert_array_equal(np.asarray(dw), np.asarray(dot(qx, qg, (((0,), (0,)), ((), ()))) * (sg * sx)))
        amaxes = np.array([np.max(np.abs(t)) for t in (x, w, g)], np.float32)
        np.testing.assert_array_equal(np.asarray(record)[:, 0], amaxes)
        assert not np.any(np.asarray(record)[:, 1:])
        rolled = np.concatenate([amaxes[:, None], history[:, :-1]], axis=1)  # numpy's record
        np.testing.assert_array_equal(np.asarray(fp8.recorded(jnp.asarray(history), np.asarray(record)[:, 0])), rolled)
        history = rolled


DELAYED = Precision(compute="fp8", scaling="delayed", amax_history=4)


def _histories(step) -> dict[str, np.ndarray]:
    return {n: np.asarray(v) for n, v in jax.device_get(step.state.buffers).items() if n.endswith(".amax_history")}


def test_delayed_scaling_records_the_same_amaxes_on_every_layout_and_trains_as_bf16():
    """HF Llama under Precision(scaling="delayed"): one amax history per linear weight (buffers
    `<weight>.amax_history`; the LM head's kept bf16 has none). After the first step each weight's
    row holds its initial amax exactly, on data=8, Megatron data=2 x tensor=4, ZeRO-3 (amaxes of
    split tensors max-reduced) and XLA's partitioner alike, the activations' and cotangents' rows
    agree; four more steps track bf16; gradient accumulation records the larger micro-batch amax."""
    from test_cudnn_attention import _llama
    from test_hf_models import lm_batches, lm_loss
    from xtrain import plans

    model = _llama(2, torch.float32)
    batches = lm_batches(n=5)
    weights = {n: np.abs(p.detach().numpy()).max() for n, p in model.named_parameters() if p.ndim == 2}

    def compiled(precision, sizes=dict(data=8), megatron=False, lowering="explicit", accumulate=1, **kw):
        m = copy.deepcopy(model)
        plan = dataclasses.replace(plans.megatron(m, sizes) if megatron else xtrain.Plan(**kw), precision=precision)
        return xtrain.compile(m, xtrain.Mesh(**sizes), optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2),
                              plan=plan, loss_fn=lm_loss, lowering=lowering, accumulate=accumulate)

    step = compiled(DELAYED)
    first = step(*batches[0])["loss"]
    base = _histories(step)
    assert len(base) == 16  # 7 linears x 2 layers, the LM head, the embedding (read by no matmul: all zeros)
    for name, h in base.items():
        weight = name.removesuffix(".amax_history")
        assert h[1, 0] == weights[weight] if "embed" not in weight else not np.any(h), name
        assert not np.any(h[:, 1:]) and ("embed" in weight or np.all(h[:, 0] > 0)), name
    for other in (compiled(DELAYED, dict(data=2, tensor=4), megatron=True), compiled(DELAYED, zero=3),
                  compiled(DELAYED, lowering="xla")):
        assert other(*batches[0])["loss"] == pytest.approx(first, rel=1e-4)  # FP8 rounding of other sum orders
        for name, h in _histories(other).items():
            np.testing.assert_array_equal(h[1], base[name][1])
            # downstream of FP8 matmuls another sum order flips some roundings (3 and 2 mantissa bits):
            # the activations' and cotangents' amaxes agree to a few percent
            np.testing.assert_allclose(h, base[name], rtol=3e-2, err_msg=name)
    accumulating = compiled(DELAYED, dict(data=4, rest=2), accumulate=2, batch=("data",))
    accumulating(*batches[0])
    for name, h in _histories(accumulating).items():  # the max over two micro-batches: the whole batch's
        np.testing.assert_array_equal(h[1], base[name][1])
        np.testing.assert_allclose(h[0], base[name][0], rtol=3e-2, err_msg=name)
    kept = _histories(compiled(dataclasses.replace(DELAYED, bf16_modules=("lm_head",))))
    assert "lm_head.weight.amax_history" not in kept and len(kept) == 15
    losses = [first] + [step(*b)["loss"] for b in batches[1:]]
    bf16 = compiled(Precision(compute="bf16"))
    np.testing.assert_allclose(losses, [bf16(*b)["loss"] for b in batches], rtol=5e-3)
    assert _histories(step)["model.layers.1.mlp.up_proj.weight.amax_history"].all()  # 5 steps fill 4 columns
    assert "FP8 delayed scaling: 16 amax histories" in str(step.report())
    assert not any(k.endswith(".amax_history") for k in step.state_dict())  # the torch module's keys only


def test_delayed_scaling_state_saves_reshards_and_resumes_bit_identically(tmp_path):
    """The amax histories are training state: saved with the checkpoint, restored bit for bit on
    another layout (ZeRO-3 on data=4 of 8 devices), and a run resumed from them continues exactly as
    the run that did not stop; a checkpoint without them (current scaling) starts them at zero."""
    from test_cudnn_attention import _llama
    from test_hf_models import lm_batches, lm_loss

    model = _llama(2, torch.float32)
    batches = lm_batches(n=5)

    def compiled(precision=DELAYED, sizes=dict(data=8), **kw):
        m = copy.deepcopy(model)
        return xtrain.compile(m, xtrain.Mesh(**sizes), optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2),
                              plan=xtrain.Plan(precision=precision, **kw), loss_fn=lm_loss)

    step = compiled()
    for b in batches[:3]:
        step(*b)
    step.save(tmp_path / "mid")
    saved = _histories(step)
    rest = [step(*b)["loss"] for b in batches[3:]]
    resumed = compiled()
    resumed.load(tmp_path / "mid")
    assert [resumed(*b)["loss"] for b in batches[3:]] == rest
    for name, h in _histories(resumed).items():
        np.testing.assert_array_equal(h, _histories(step)[name])
    other = compiled(sizes=dict(data=4, rest=2), batch=("data",), zero=3)
    other.load(tmp_path / "mid")
    for name, h in _histories(other).items():
        np.testing.assert_array_equal(h, saved[name])
    plain = compiled(Precision(compute="fp8"))
    plain.load(tmp_path / "mid")  # current scaling ignores the histories
    plain.save(tmp_path / "plain")
    resumed.load(tmp_path / "plain")
    assert not any(np.any(h) for h in _histories(resumed).values())


def test_delayed_scaling_is_checked():
    with pytest.raises(PlanError, match="needs compute='fp8'"):
        Precision(compute="bf16", scaling="delayed")
    with pytest.raises(PlanError, match="must be one of"):
        Precision(compute="fp8", scaling="sometimes")
    with pytest.raises(PlanError, match="amax_history=0"):
        Precision(compute="fp8", scaling="delayed", amax_history=0)
    from models import GPT

    model = GPT(layers=2)
    with pytest.raises(PlanError, match="scaling='delayed'.*pipeline"):
        xtrain.compile(model, xtrain.Mesh(data=4, pipe=2), optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                       plan=xtrain.Plan(precision=DELAYED).with_pipeline(stages=2, microbatches=2))


def _rowwise_reference(a: np.ndarray, b: np.ndarray, dims, fa, fb) -> np.ndarray:
    """numpy's rowwise quantization of both operands (a scale per index of the dims the dot keeps),
    the dot of the quantized values by XLA, times the outer product of the scales."""
    (ac, bc), (ab, bb) = dims
    quantized = []
    for t, c, fmt in ((a, ac, fa), (b, bc, fb)):
        amax = np.max(np.abs(t), axis=tuple(c), keepdims=True).astype(np.float32)
        largest = np.float32(ml_dtypes.finfo(fmt).max)
        scale = np.where(amax > 0, amax * np.float32(1 / largest), np.float32(1)).astype(np.float32)
        quantized.append((np.clip(t / scale, -largest, largest).astype(fmt), scale))
    (qa, sa), (qb, sb) = quantized
    one = lambda t: jnp.asarray(t.astype(np.float32))
    return np.asarray(jax.lax.dot_general(jnp.asarray(qa), jnp.asarray(qb), dims, preferred_element_type=jnp.float32)
                      * jax.lax.dot_general(one(sa), one(sb), dims))


@pytest.mark.parametrize("x_shape,w_shape,dims", DIMENSION_NUMBERS)
def test_rowwise_scaling_equals_a_numpy_reference_bit_for_bit(x_shape, w_shape, dims):
    """Precision(scaling="rowwise"): x quantized with one scale per row, w per output column (each
    the amax over the dims the dot contracts), the product times their outer product; the backward
    quantizes the cotangent (e5m2) and the operands (saved in float32 here, bf16 under a plan) along
    the dims each gradient's dot contracts. Forward and both gradients equal numpy's quantization
    fed to the same dots, bit for bit, on rows of very different magnitudes."""
    rng = np.random.default_rng(4)
    scaled = lambda shape: (rng.normal(size=shape) * 10.0 ** rng.uniform(-4, 4, size=shape[:1] + (1,) * (len(shape) - 1))
                            ).astype(np.float32)
    x, w = scaled(x_shape), scaled(w_shape)
    f32, e4, e5 = jnp.dtype(jnp.float32), ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
    y, vjp = jax.vjp(lambda a, b: fp8.rowwise_matmul(a, b, dims, f32), jnp.asarray(x), jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(y), _rowwise_reference(x, w, dims, e4, e4))
    g = scaled(y.shape)
    dx, dw = vjp(jnp.asarray(g))
    # the gradients: the transposes autodiff takes of dot_general, each with its operands rowwise-quantized
    want_dx, want_dw = (np.asarray(t) for t in jax.grad(
        lambda a, b: jnp.sum(jax.lax.dot_general(a, b, dims) * g), (0, 1))(jnp.asarray(x), jnp.asarray(w)))
    for got, want in ((dx, want_dx), (dw, want_dw)):  # near float32's: e5m2 keeps 2 mantissa bits
        assert np.linalg.norm(np.asarray(got) - want) <= 0.1 * np.linalg.norm(want)
    (xc, wc), (xb, wb) = dims
    got = fp8._cotangent(jnp.asarray(g), jnp.asarray(w), x.ndim, dims, swap=False,
                         dot=lambda a, b, d: jnp.asarray(_rowwise_reference(np.asarray(a), np.asarray(b), d, e5, e4)))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(got))
    got = fp8._cotangent(jnp.asarray(g), jnp.asarray(x), w.ndim, ((wc, xc), (wb, xb)), swap=True,
                         dot=lambda a, b, d: jnp.asarray(_rowwise_reference(np.asarray(a), np.asarray(b), d, e5, e4)))
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(got))


def test_rowwise_scaling_trains_as_bf16_on_data_tensor_and_zero3():
    """A float32 HF Llama under Precision(scaling="rowwise"): the linear layers' matmuls and their
    backward matmuls take FP8 operands (8 x 3 distinct equations, as per-tensor scaling), and 5 AdamW
    steps track bf16 on data=8, Megatron data=2 x tensor=4 (a row's amax over a split contracting
    dim max-reduced over `tensor`) and ZeRO-3 (each weight quantized on its shard, per output column)."""
    from test_cudnn_attention import _llama
    from test_hf_models import lm_batches, lm_loss
    from xtrain import plans

    model = _llama(2, torch.float32)
    batches = lm_batches(n=5)
    rowwise = Precision(compute="fp8", scaling="rowwise")

    def train(precision, sizes=dict(data=8), megatron=False, **kw):
        m = copy.deepcopy(model)
        plan = dataclasses.replace(plans.megatron(m, sizes) if megatron else xtrain.Plan(**kw), precision=precision)
        step = xtrain.compile(m, xtrain.Mesh(**sizes), optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2),
                              plan=plan, loss_fn=lm_loss)
        return step, np.array([step(*b)["loss"] for b in batches])

    _, bf16 = train(Precision(compute="bf16"))
    step, data = train(rowwise)
    assert _fp8_dots(step.program(*batches[0]).jaxpr) == 8 * 3
    np.testing.assert_allclose(data, bf16, rtol=5e-3)
    np.testing.assert_allclose(train(rowwise, dict(data=2, tensor=4), megatron=True)[1], data, rtol=5e-3)
    np.testing.assert_allclose(train(rowwise, zero=3)[1], data, rtol=5e-3)
