"""Bad input fails early with a typed error (xtrain.errors) whose message names the culprit and
the fix; the tests match the fragments that carry those facts."""
import re

import jax
import jax.numpy as jnp
import pytest
import torch
from torch import nn

import xtrain
from neuron_support import conformance
from xtrain import errors
from xtrain.checkpoint import read_manifest
from xtrain.aot import toolchain as aot_toolchain
from xtrain.cost import hardware
from xtrain.errors import InputError, MeshError, PlanError, TraceError, UnsupportedError
from xtrain.frontend import moe, torch_ops
from xtrain.loader import Loader
from xtrain.runtime.launch import process_env

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
    with pytest.raises(InputError, match=re.escape("global batch 12 is not divisible by mesh axis data=8; use a "
                                                   "global batch that is a multiple of 8")):
        compile_mlp()(x, y)


def test_mesh_axes_do_not_multiply_to_device_count():
    with pytest.raises(MeshError, match=re.escape("Mesh(data=3, tensor=2) needs 6 devices but 8 are available")):
        compile_mlp(xtrain.Mesh(data=3, tensor=2))


def test_a_mesh_larger_than_the_devices_names_xtrain_init():
    # the likeliest slip: a CPU script without xtrain.init(cpu_devices=...) sees one device
    with pytest.raises(MeshError) as err:
        compile_mlp(xtrain.Mesh(data=4, tensor=4))
    text = str(err.value)
    assert "needs 16 devices but 8 are available" in text and "xtrain.init(cpu_devices=16)" in text
    assert "Mesh(data=-1, tensor=4)" in text  # a -1 fix only where it can work (4 divides 8)
    assert "Mesh(data=-1" not in str(pytest.raises(MeshError, xtrain.Mesh(data=3, tensor=3).resolve, 8).value)


@pytest.mark.parametrize("axes", [{"dp": 8}, {"tensor": 8}], ids=["dp", "tensor"])
def test_the_default_plan_on_a_mesh_without_data_is_refused_with_the_fix(axes):
    name = next(iter(axes))
    with pytest.raises(PlanError, match=re.escape(f"Mesh({name}=8) has no 'data' axis")) as err:
        compile_mlp(xtrain.Mesh(**axes))
    assert f"xtrain.Plan(batch=('{name}',))" in str(err.value)  # the fix


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
    with pytest.raises(errors.OptionsError, match=re.escape("6 parameters of MLP are on the meta device")) as err:
        xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model))
    assert "init_from='model.safetensors'" in str(err.value)  # the fix


# -- front end ---------------------------------------------------------------------------------
def test_forward_returning_logits_without_loss_fn():
    with pytest.raises(TraceError, match=re.escape("ReturnsLogits.forward returned a tensor of shape (16, 5)")) as err:
        train_once(ReturnsLogits(), torch.randn(16, 12))
    assert "loss_fn=" in str(err.value)


def test_untranslatable_custom_op_names_op_and_module_path():
    with pytest.raises(TraceError, match=re.escape("torch op xtrain_test::mystery used in module 'body.1'")):
        train_once(UsesMystery(), torch.randn(16, 12))


def test_untranslatable_op_at_top_level_says_so():
    with pytest.raises(TraceError, match=re.escape("in module 'MysteryAtTopLevel.forward (top level)'")):
        train_once(MysteryAtTopLevel(), torch.randn(16, 12))


def test_aten_op_without_lowering_names_op_and_module_path():
    with pytest.raises(TraceError, match=re.escape("torch op aten::adaptive_max_pool3d used in module 'features.1'")):
        train_once(UsesMaxPool3d(), torch.randn(8, 1, 2, 2, 2))


# -- optimizers --------------------------------------------------------------------------------
def test_unsupported_optimizer_lists_supported_ones():
    model = MLP()
    with pytest.raises(UnsupportedError, match=re.escape("torch.optim.RMSprop is not supported by xtrain; supported: "
                                                         "torch.optim.SGD, torch.optim.Adam")):
        compile_mlp(optimizer=torch.optim.RMSprop(model.parameters()))


@pytest.mark.parametrize("make_opt,message", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.5),
     "SGD option dampening=0.5 (param group 0) is not supported by xtrain; supported SGD options: lr, momentum"),
    (lambda p: torch.optim.Adam(p, amsgrad=True),
     "Adam option amsgrad=True (param group 0) is not supported by xtrain; supported Adam options: betas"),
], ids=["sgd_dampening", "adam_amsgrad"])
def test_unsupported_optimizer_option(make_opt, message):
    model = MLP()
    with pytest.raises(UnsupportedError, match=re.escape(message)):
        compile_mlp(optimizer=make_opt(model.parameters()))


# -- plans -------------------------------------------------------------------------------------
@pytest.mark.parametrize("plan,message", [
    (xtrain.Plan(params={"encoder.*": ("tensor",)}),
     "Plan rule(s) ['encoder.*'] match no parameter; parameter names look like: fc1.weight"),
    (xtrain.Plan(params={"fc1.bias": ("tensor", None)}),
     "('tensor', None) has 2 entries but parameter fc1.bias has shape (32,) (1 dims)"),
    (xtrain.Plan(params={"fc1.weight": ("model", None)}),
     "splits parameter fc1.weight over mesh axis 'model', which the mesh (data=4, tensor=2) does not have"),
    (xtrain.Plan(params={"head.weight": ("tensor", None)}),
     "dimension 0 of parameter head.weight (shape (5, 32)) has size 5, not divisible by tensor=2"),
    (xtrain.Plan(batch=("model",)),
     "Plan(batch=...) splits batch over mesh axis 'model', which the mesh (data=4, tensor=2) does not have"),
], ids=["matches_nothing", "wrong_rank", "unknown_axis", "not_divisible", "unknown_batch_axis"])
def test_bad_plan_rule(plan, message):
    with pytest.raises(PlanError, match=re.escape(message)):
        compile_mlp(xtrain.Mesh(data=4, tensor=2), plan=plan)


# -- the error types ---------------------------------------------------------------------------
class Embeds(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)

    def forward(self, ids):
        return self.tok(ids).sum()


def _index_out_of_range():
    model = Embeds()
    xtrain.compile(model, xtrain.Mesh(data=8), optimizer=sgd(model))(torch.full((8, 3), 12))


def _auto_step():
    model = MLP()
    return xtrain.compile(model, plan="auto", optimizer=sgd(model))


def _does_not_conform():
    branchy = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x))  # a conditional: Neuron has none
    conformance.assert_conforms(branchy.lower(jnp.ones(8)).compile().as_text())


# one real bad input per public error type (cheap ones: no step is compiled but for the batch index)
BAD_INPUTS = {
    errors.PlanError: (lambda: xtrain.Plan(zero=5), "the ZeRO stage must be 0, 1, 2 or 3"),
    errors.MeshError: (lambda: xtrain.Mesh(data=-1, tensor=-1), "has more than one -1 axis"),
    errors.OptionsError: (lambda: xtrain.GradSync(bucket_bytes=0), "GradSync.bucket_bytes=0"),
    errors.InputError: (lambda: xtrain.Buckets(lengths=(8, 16), pad_values=(0,)).length_for(17),
                        "longer than the largest bucket 16"),
    errors.BatchTypeError: (lambda: Loader([], mesh=xtrain.Mesh(data=8)).place({"ids": 1}), "got a dict with keys"),
    errors.BatchIndexError: (_index_out_of_range, "holds 12 where module 'tok' uses it as an index"),
    errors.UnsupportedError: (lambda: hardware.profile("p3.16xlarge").check_precision("bf16"),
                              "no bfloat16 arithmetic"),
    errors.UnsupportedOpError: (lambda: torch_ops._gelu(jnp.ones(3), approximate="erf"), "approximate='erf'"),
    errors.TraceError: (lambda: train_once(ReturnsLogits(), torch.randn(16, 12)), "not a scalar loss"),
    errors.TopKTooLarge: (lambda: moe._topk(jnp.ones(4), 5), "topk of k=5 along a dimension of 4"),
    errors.LaunchError: (lambda: process_env({"RANK": "1"}), "RANK"),
    errors.ConformanceError: (_does_not_conform, r"does not fit trn1.32xlarge \(1 findings\)"),
    errors.CheckpointError: (lambda: read_manifest("no-such-checkpoint"), "no-such-checkpoint"),
    errors.NotBuiltError: (lambda: _auto_step().param_specs, "plan='auto' chooses the plan at the first step"),
    # a compile child given no time to start (xtrain.aot.toolchain)
    errors.TargetCompileError: (lambda: aot_toolchain.run_child([], timeout_s=0.001),
                                "the deviceless GPU compile took more than 0 s"),
}


@pytest.mark.parametrize("error", list(BAD_INPUTS), ids=lambda e: e.__name__)
def test_each_error_type_is_raised_by_a_real_bad_input(error):
    make, fragment = BAD_INPUTS[error]
    with pytest.raises(error, match=fragment) as err:
        make()
    assert type(err.value) is error  # the most specific type, not merely a base
    assert isinstance(err.value, errors.XtrainError)


def test_every_error_type_is_tested_and_keeps_its_builtin_base():
    public = {getattr(errors, name) for name in errors.__all__} - {errors.XtrainError}
    assert public == set(BAD_INPUTS)
    for error in public:  # `except ValueError` / `except RuntimeError` callers keep working
        assert issubclass(error, (ValueError, RuntimeError)) and issubclass(error, errors.XtrainError), error
    assert issubclass(errors.CheckpointError, RuntimeError) and not issubclass(errors.CheckpointError, ValueError)
    assert issubclass(errors.BatchTypeError, TypeError) and issubclass(errors.BatchIndexError, IndexError)


def test_the_errors_are_reexported_where_they_were_defined():
    from xtrain.checkpoint import CheckpointError
    from xtrain.ir import TraceError as IrTraceError
    assert (IrTraceError, CheckpointError, moe.TopKTooLarge, conformance.ConformanceError) == (
        errors.TraceError, errors.CheckpointError, errors.TopKTooLarge, errors.ConformanceError)
    assert xtrain.errors is errors
