"""xtrain.observe: model FLOPs from the traced graph, MFU arithmetic, the peak table, the JSONL
log, the PNG plot, the profiler trace and the TensorBoard switch."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import xtrain
from xtrain.cost.hardware import peak_flops
from xtrain.errors import OptionsError
from xtrain.observe import Monitor, format_postfix, matmul_flops, model_flops, plot, read_metrics, utilisation

B, D, H, O = 16, 12, 20, 6


def mlp_loss(params, x):
    return jnp.sum(jnp.tanh(x @ params["w1"]) @ params["w2"])


@pytest.fixture(scope="module")
def step():
    g = np.random.default_rng(0)
    params = {"w1": g.normal(size=(D, H)).astype(np.float32), "w2": g.normal(size=(H, O)).astype(np.float32)}
    step = xtrain.compile(mlp_loss, xtrain.Mesh(data=8), params=params, optimizer=optax.sgd(1e-3))
    step(g.normal(size=(B, D)).astype(np.float32))
    return step


@pytest.mark.e2e
def test_model_flops_counts_forward_and_backward_matmuls(step):
    # forward x@w1, h@w2; backward dw2 = h^T g, dh = g w2^T, dw1 = x^T dh (no gradient for x)
    assert model_flops(step) == 2 * B * D * H + 2 * B * H * O + 2 * B * H * O + 2 * B * H * O + 2 * B * D * H


@pytest.mark.unit
def test_matmul_flops_multiplies_a_scan_body_by_its_length():
    def layers(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    jaxpr = jax.make_jaxpr(layers)(jnp.zeros((5, 8, 8)), jnp.zeros((4, 8)))
    assert matmul_flops(jaxpr) == 5 * 2 * 4 * 8 * 8


@pytest.mark.unit
def test_mfu_arithmetic_and_peaks():
    # 2e12 FLOP in 0.5 s on 8 devices of 1e12 FLOP/s peak: 4 TFLOP/s achieved, half of 8 TFLOP/s
    assert utilisation(2e12, 0.5, 8, 1e12) == {"tflops_s": 4.0, "mfu": 0.5}
    assert utilisation(2e12, 0.5, 8, None) == {"tflops_s": 4.0, "mfu": None}
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops("NVIDIA H100 PCIe", "bfloat16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert peak_flops("NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops("NC_v2", "bfloat16") == 95e12  # one trn1 NeuronCore: half a chip's 190
    assert peak_flops("NC_v3d", "bfloat16") == 2 * peak_flops("NC_v3", "bfloat16") == 667e12 / 4
    assert peak_flops("cpu", "float32") is None and peak_flops("TFRT_CPU_0", "bfloat16") is None
    assert "MFU=50.0%" in format_postfix({"loss": 1.0, "step_time_s": 0.5, "tflops_s": 4.0, "mfu": 0.5})
    assert "4.000 TFLOP/s" in format_postfix({"loss": 1.0, "step_time_s": 0.5, "tflops_s": 4.0, "mfu": None})


@pytest.mark.e2e
def test_monitor_writes_one_jsonl_record_per_step(step, tmp_path):
    log = tmp_path / "metrics.jsonl"
    monitor = Monitor(step, total_steps=3, metrics=log, progress=False, start=10)
    x = np.ones((B, D), np.float32)
    losses = []
    for lr in (0.1, 0.05, 0.025):
        with monitor.step(tokens=B, lr=lr) as rec:
            rec["loss"] = step(x)["loss"]
        losses.append(rec["loss"])
    monitor.close()
    records = read_metrics(log)
    assert [r["step"] for r in records] == [10, 11, 12]
    assert [r["loss"] for r in records] == losses and [r["lr"] for r in records] == [0.1, 0.05, 0.025]
    flops = model_flops(step)
    for r in records:
        assert r["step_time_s"] > 0 and r["tokens_per_s"] == pytest.approx(B / r["step_time_s"])
        assert r["tflops_s"] == pytest.approx(flops / r["step_time_s"] / 1e12)
        assert r["mfu"] is None  # CPU: no peak, TFLOP/s only
    assert json.loads(log.read_text().splitlines()[0]) == records[0]


@pytest.mark.unit
def test_plot_writes_a_valid_png(tmp_path):
    import matplotlib.image

    history = [{"step": i, "loss": 3.0 / (i + 1), "tokens_per_s": 1000.0 + i} for i in range(20)]
    path = plot(history, tmp_path / "out" / "train.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.shape[0] > 100 and image.shape[1] > 100
    assert image[..., :3].std() > 0.05  # not a blank canvas


@pytest.mark.e2e
def test_profiler_traces_the_requested_steps(step, tmp_path, capsys):
    monitor = Monitor(step, progress=False, profile_steps=(1, 2), profile_dir=tmp_path / "trace")
    x = np.ones((B, D), np.float32)
    for i in range(4):
        with monitor.step() as rec:
            rec["loss"] = step(x)["loss"]
        assert monitor._tracing == (i == 1)  # open after step 1 starts, closed after step 2
    monitor.close()
    traces = list((tmp_path / "trace").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0
    assert f"profile of steps 1-2 written under {(tmp_path / 'trace').resolve()}" in capsys.readouterr().err
    with pytest.raises(OptionsError, match=r"profile_steps=\(3, 1\): give \(first, last\)"):
        Monitor(step, progress=False, profile_steps=(3, 1))


@pytest.mark.e2e
def test_tensorboard_is_optional_and_asked_for_by_name(step, tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="needs the tensorboard package"):
            Monitor(step, progress=False, tensorboard=tmp_path / "tb")
        return
    monitor = Monitor(step, progress=False, tensorboard=tmp_path / "tb")
    with monitor.step(tokens=B) as rec:
        rec["loss"] = step(np.ones((B, D), np.float32))["loss"]
    monitor.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.e2e
def test_model_flops_of_a_gpt_are_three_forward_passes():
    """Every matmul of a GPT has two differentiable inputs (weights, or activations that depend
    on them), so forward + backward = 3 x the forward matmuls, which are counted by hand here."""
    import torch

    from models import GPT

    b, t, d, vocab, layers = 16, 8, 32, 64, 2
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=d, layers=layers, seq=t)
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tokens = torch.randint(0, vocab, (b, t + 1))
    step(tokens[:, :-1], tokens[:, 1:])
    per_layer = 4 * (2 * b * t * d * d) + 2 * (2 * b * t * d * 4 * d) + 2 * (2 * b * t * t * d)  # qkvo, mlp, attention
    forward = layers * per_layer + 2 * b * t * d * vocab  # + the tied head
    assert model_flops(step) == 3 * forward
