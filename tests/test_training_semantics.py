"""What a training step means beyond parity: frozen parameters, eval, dropout, param groups,
plain JAX functions, and module paths in the traced graph."""
import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import xtrain
from xtrain.frontend.torch_module import TorchModel
from xtrain.ir.graph import trace
from xtrain.testing import assert_parity, run_parity

import models
from models import CNN, GPT, MLP, cnn_batches, mlp_batches, token_batches

MODELS_FILE = models.__file__


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def compile_and_train(model, make_opt, batches, mesh=None, **kwargs):
    step = xtrain.compile(model, mesh or xtrain.Mesh(data=8), optimizer=make_opt(model.parameters()), **kwargs)
    losses = [step(*batch)["loss"] for batch in batches]
    return step, losses


# -- frozen parameters -------------------------------------------------------------------------
@pytest.mark.e2e
def test_frozen_parameters_stay_bit_identical():
    model = MLP()
    model.fc1.requires_grad_(False)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    # AdamW with weight decay: a frozen parameter that reached the optimizer would still move.
    result = run_parity(model, adamw, mlp_batches(), xtrain.Mesh(data=8))
    assert_parity(result)
    for name in ("fc1.weight", "fc1.bias"):
        assert torch.equal(result.state[name], initial[name]), f"frozen {name} changed"
    for name in ("fc2.weight", "fc2.bias", "head.weight", "head.bias"):
        assert not torch.equal(result.state[name], initial[name]), f"trainable {name} did not change"


# -- eval --------------------------------------------------------------------------------------
def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.mark.e2e
def test_eval_changes_nothing_and_matches_torch_eval():
    model = CNN()
    batches = cnn_batches(n=4)
    step, _ = compile_and_train(model, sgd, batches[:3])
    before = step.state_dict()
    assert not torch.equal(before["bn1.running_mean"], torch.zeros_like(before["bn1.running_mean"]))
    x, y = batches[3]
    loss = step.eval(x, y)["loss"]
    after = step.state_dict()
    assert step.step_count == 3
    assert set(after) == set(before)
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"step.eval changed {changed}"

    reference = CNN()
    reference.load_state_dict(before, strict=True)
    with torch.no_grad():
        eval_loss = reference.eval()(x, y).item()
        train_loss = reference.train()(x, y).item()
    assert abs(loss - eval_loss) <= 1e-5 * abs(eval_loss), f"xtrain eval {loss} vs torch eval {eval_loss}"
    # The comparison has teeth only if eval mode (running statistics) differs from train mode.
    assert abs(train_loss - eval_loss) > 1e-3 * abs(eval_loss)


# -- dropout -----------------------------------------------------------------------------------
def gpt_losses(dropout, mesh):
    torch.manual_seed(0)
    model = GPT(dropout=dropout)
    return compile_and_train(model, adamw, token_batches(n=4), xtrain.Mesh(**mesh))[1]


@pytest.mark.e2e
def test_dropout_mask_is_independent_of_layout():
    data8 = gpt_losses(0.1, dict(data=8))
    data2 = gpt_losses(0.1, dict(data=2, rest=4))
    np.testing.assert_allclose(data2, data8, rtol=1e-5)
    no_dropout = gpt_losses(0.0, dict(data=8))
    assert np.min(np.abs(np.array(data8) - no_dropout) / np.abs(no_dropout)) > 1e-3, (
        f"dropout=0.1 losses {data8} look like dropout=0 losses {no_dropout}")


# -- param groups ------------------------------------------------------------------------------
def two_groups(optimizer_cls, **options):
    """fc1 in one param group, everything else in another with a different lr."""

    def make(params):
        params = list(params)  # MLP order: fc1.weight, fc1.bias, fc2.*, head.*
        return optimizer_cls([{"params": params[:2], "lr": 0.1}, {"params": params[2:]}], lr=0.01, **options)

    return make


@pytest.mark.e2e
@pytest.mark.parametrize("make_opt", [
    two_groups(torch.optim.SGD, momentum=0.9),
    two_groups(torch.optim.AdamW, weight_decay=0.01),
], ids=["sgd", "adamw"])
def test_param_groups_match_torch(make_opt):
    assert_parity(run_parity(MLP(), make_opt, mlp_batches(), xtrain.Mesh(data=8)))


# -- plain JAX functions -----------------------------------------------------------------------
def jax_loss(params, x, y):
    h = jnp.tanh(x @ params["layer"]["w"] + params["layer"]["b"])  # (B, H)
    return jnp.mean((h @ params["head"] - y) ** 2)


def jax_problem(steps=4, batch=16):
    rng = np.random.default_rng(0)
    params = {"layer": {"w": rng.normal(size=(12, 32)).astype(np.float32) / 4,
                        "b": np.zeros(32, np.float32)},
              "head": rng.normal(size=(32, 3)).astype(np.float32) / 6}
    batches = [(rng.normal(size=(batch, 12)).astype(np.float32), rng.normal(size=(batch, 3)).astype(np.float32))
               for _ in range(steps)]
    return params, batches


def jax_reference(params, batches, tx):
    """The same training with plain jax/optax on one device."""

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(jax_loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    with jax.default_device(jax.devices()[0]):
        for x, y in batches:
            params, opt_state, loss = step(params, opt_state, x, y)
            losses.append(float(loss))
    return losses, params


@pytest.mark.e2e
def test_jax_function_matches_jax_on_one_device():
    params, batches = jax_problem()
    tx = optax.sgd(0.1, momentum=0.9)
    step = xtrain.compile(jax_loss, xtrain.Mesh(data=8), params=params, optimizer=tx)
    losses = [step(*batch)["loss"] for batch in batches]
    want_losses, want_params = jax_reference(params, batches, tx)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    assert not np.allclose(want_params["head"], params["head"]), "the reference did not train"
    state = step.state_dict()
    assert set(state) == {"layer.w", "layer.b", "head"}
    for name, want in [("layer.w", want_params["layer"]["w"]), ("layer.b", want_params["layer"]["b"]),
                       ("head", want_params["head"])]:
        np.testing.assert_allclose(state[name].numpy(), np.asarray(want), atol=1e-5, err_msg=name)


# -- module paths in the traced graph ----------------------------------------------------------
def traced_gpt():
    torch.manual_seed(0)
    module = GPT()
    model = TorchModel(module)
    batch = tuple(t.numpy() for t in token_batches(n=1, batch=4)[0])
    key = jax.random.key_data(jax.random.key(0))
    return module, trace(model, model.initial_params(), model.initial_buffers(), key, batch)


@pytest.mark.unit
def test_dot_generals_carry_their_module_paths():
    _, graph = traced_gpt()
    found = collections.Counter(path for eqn, path in graph.equations() if eqn.primitive.name == "dot_general")
    expected = collections.Counter({"lm_head": 1})
    for layer in ("blocks.0", "blocks.1"):
        for linear in ("attn.q", "attn.k", "attn.v", "attn.out", "mlp.0", "mlp.2"):
            expected[f"{layer}.{linear}"] = 1
        expected[f"{layer}.attn"] = 2  # q @ k^T and probabilities @ v, written in Attention.forward
    assert found == expected


def _model_code_owner(module, path: str) -> str:
    """`Class.forward` whose code runs the module at `path`: the innermost module along the
    path that models.py defines (torch's own modules, e.g. nn.Linear, are called from it)."""
    owner = type(module).__qualname__
    for part in path.split(".") if path else []:
        module = module._modules[part]
        if type(module).__module__ == GPT.__module__:
            owner = type(module).__qualname__
    return f"{owner}.forward"


def _model_frame(eqn) -> str | None:
    """The innermost models.py method on the equation's trace-time stack (closures inside a
    method count as the method)."""
    tb = eqn.source_info.traceback
    frames = [f for f in (tb.frames if tb else []) if f.file_name == MODELS_FILE]
    return frames[0].function_name.split(".<locals>")[0] if frames else None


@pytest.mark.unit
def test_every_equation_has_a_module_path_or_is_top_level_code():
    module, graph = traced_gpt()
    top_level = graph.jaxpr.jaxpr.eqns
    assert all(_model_frame(eqn) for eqn in top_level), (
        "equations outside the model's code: " + str([e.primitive.name for e in top_level if not _model_frame(e)]))
    wrong = []
    for eqn, path in graph.equations():
        frame = _model_frame(eqn)
        if frame is not None and frame != _model_code_owner(module, path):
            wrong.append((eqn.primitive.name, path or "<top level>", frame))
    assert not wrong, f"equations attributed to the wrong module path (primitive, path, code): {wrong[:10]}"
    paths = {path for _, path in graph.equations()}
    assert {"tok", "pos", "blocks.0.ln1", "blocks.1.mlp.1", "ln_f", "lm_head", ""} <= paths
