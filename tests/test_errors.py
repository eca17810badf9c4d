"""Bad input fails early with a message that names the culprit and the fix (wording tested)."""
import re

import pytest
import torch
from torch import nn

import xtrain
from xtrain.ir import TraceError

from models import MLP, mlp_batches

pytestmark = pytest.mark.e2e


@torch.library.custom_op("xtrain_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    """An op with a CPU kernel only: torchax has no JAX lowering for it."""
    return x * 2


@mystery.register_fake
def _(x):
    return torch.empty_like(x)


class Mystery(nn.Module):
    def forward(self, x):
        return mystery(x)


class UsesMystery(nn.Module):
    """The untranslatable op sits two modules deep, at path 'body.1'."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)
        self.body = nn.Sequential(nn.Linear(12, 12), Mystery())

    def forward(self, x):
        return self.body(self.fc(x)).sum()


class MysteryAtTopLevel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 12)

    def forward(self, x):
        return mystery(self.fc(x)).sum()


class UsesMaxPool3d(nn.Module):
    """aten::adaptive_max_pool3d has no lowering in the pinned torchax."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv3d(1, 2, 1), nn.AdaptiveMaxPool3d(1))

    def forward(self, x):
        return self.features(x).sum()


class ReturnsLogits(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 5)

    def forward(self, x):
        return self.fc(x)


def sgd(model, **options):
    return torch.optim.SGD(model.parameters(), lr=0.1, **options)


def compile_mlp(mesh=None, **kwargs):
    model = MLP()
    kwargs.setdefault("optimizer", sgd(model))
    return xtrain.compile(model, mesh or xtrain.Mesh(data=8), **kwargs)


def train_once(model, *batch):
    xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model))(*batch)


# -- batch and mesh ----------------------------------------------------------------------------
def test_batch_not_divisible_by_data_axis():
    x, y = mlp_batches(n=1, batch=12)[0]
    with pytest.raises(ValueError, match=re.escape(
            "batch argument 0 has shape (12, 12): global batch 12 is not divisible by mesh axis "
            "data=8; use a global batch that is a multiple of 8")):
        compile_mlp()(x, y)


def test_mesh_axes_do_not_multiply_to_device_count():
    with pytest.raises(ValueError, match=re.escape(
            "Mesh(data=3, tensor=2) needs 6 devices but 8 are available; make the axis sizes "
            "multiply to 8 or use -1 for one axis")):
        compile_mlp(xtrain.Mesh(data=3, tensor=2))


@pytest.mark.parametrize("axes", [{"dp": 8}, {"tensor": 8}], ids=["dp", "tensor"])
def test_the_default_plan_on_a_mesh_without_data_is_refused_with_the_fix(axes):
    name = next(iter(axes))
    with pytest.raises(ValueError, match=re.escape(
            f"Mesh({name}=8) has no 'data' axis, and the default plan splits only the batch, over 'data': every "
            f"device would compute the whole batch with the whole model. Name the data-parallel axis 'data' "
            f"(xtrain.Mesh(data=8)), say which axes split the batch (xtrain.Plan(batch=('{name}',)))")):
        compile_mlp(xtrain.Mesh(**axes))


def test_the_fix_runs_and_an_axis_that_splits_nothing_is_a_report_note():
    batch = mlp_batches(n=1)[0]
    step = compile_mlp(xtrain.Mesh(dp=8), plan=xtrain.Plan(batch=("dp",)))
    assert step(*batch)["skipped"] is False and step.batch_spec == ("dp",)
    step = compile_mlp(xtrain.Mesh(data=4, rest=2))  # (an unused `context` axis is an error: test_long_sequence)
    step(*batch)
    assert ("mesh axis 'rest' (size 2) splits nothing: the 2 devices along it hold and compute the same (give "
            "it to the batch or to parameters to use them)") in step.report().notes


def test_a_meta_device_model_without_init_from_names_the_fix():
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(ValueError, match=re.escape(
            "6 parameters of MLP are on the meta device (e.g. ['fc1.weight', 'fc1.bias', 'fc2.weight']): they have "
            "shapes but no values. Load them while compiling with xtrain.compile(..., init_from='model.safetensors' "
            "or an HF checkpoint directory)")):
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model))


# -- front end ---------------------------------------------------------------------------------
def test_forward_returning_logits_without_loss_fn():
    with pytest.raises(TraceError, match=re.escape(
            "ReturnsLogits.forward returned a tensor of shape (16, 5), not a scalar loss")) as err:
        train_once(ReturnsLogits(), torch.randn(16, 12))
    assert "loss_fn=" in str(err.value)


def test_untranslatable_custom_op_names_op_and_module_path():
    with pytest.raises(TraceError, match=re.escape(
            "cannot translate torch op xtrain_test::mystery used in module 'body.1' (UsesMystery)")):
        train_once(UsesMystery(), torch.randn(16, 12))


def test_untranslatable_op_at_top_level_says_so():
    with pytest.raises(TraceError, match=re.escape(
            "cannot translate torch op xtrain_test::mystery used in module "
            "'MysteryAtTopLevel.forward (top level)'")):
        train_once(MysteryAtTopLevel(), torch.randn(16, 12))


def test_aten_op_without_lowering_names_op_and_module_path():
    with pytest.raises(TraceError, match=re.escape(
            "cannot translate torch op aten::adaptive_max_pool3d used in module 'features.1'")):
        train_once(UsesMaxPool3d(), torch.randn(8, 1, 2, 2, 2))


# -- optimizers --------------------------------------------------------------------------------
def test_unsupported_optimizer_lists_supported_ones():
    model = MLP()
    with pytest.raises(ValueError, match=re.escape(
            "optimizer torch.optim.RMSprop is not supported by xtrain; supported: "
            "torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, xtrain.optim.LARS, xtrain.optim.LAMB")):
        compile_mlp(optimizer=torch.optim.RMSprop(model.parameters()))


@pytest.mark.parametrize("make_opt,message", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
     "torch.optim.SGD option dampening=0.5 (param group 0) is not supported by xtrain; "
     "supported SGD options: lr, momentum, nesterov, weight_decay"),
    (lambda p: torch.optim.Adam(p, amsgrad=True),
     "torch.optim.Adam option amsgrad=True (param group 0) is not supported by xtrain; "
     "supported Adam options: betas, decoupled_weight_decay, eps, lr, weight_decay"),
], ids=["sgd_dampening", "adam_amsgrad"])
def test_unsupported_optimizer_option(make_opt, message):
    model = MLP()
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_mlp(optimizer=make_opt(model.parameters()))


# -- plans -------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan,message", [
    (xtrain.Plan(params={"encoder.*": ("tensor",)}),
     "Plan rule(s) ['encoder.*'] match no parameter; parameter names look like: fc1.weight, fc1.bias"),
    (xtrain.Plan(params={"fc1.bias": ("tensor", None)}),
     "Plan rule 'fc1.bias': ('tensor', None) has 2 entries but parameter fc1.bias has shape (32,) "
     "(1 dims); give at most one entry per dimension"),
    (xtrain.Plan(params={"fc1.weight": ("model", None)}),
     "Plan rule 'fc1.weight': ('model', None) splits parameter fc1.weight over mesh axis 'model', "
     "which the mesh (data=4, tensor=2) does not have"),
    (xtrain.Plan(params={"head.weight": ("tensor", None)}),
     "Plan rule 'head.weight': ('tensor', None): dimension 0 of parameter head.weight (shape (5, 32)) "
     "has size 5, not divisible by tensor=2"),
    (xtrain.Plan(batch=("model",)),
     "Plan(batch=...) splits batch over mesh axis 'model', which the mesh (data=4, tensor=2) does not have"),
], ids=["matches_nothing", "wrong_rank", "unknown_axis", "not_divisible", "unknown_batch_axis"])
def test_bad_plan_rule(plan, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_mlp(xtrain.Mesh(data=4, tensor=2), plan=plan)
