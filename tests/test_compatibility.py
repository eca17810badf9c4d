"""Compatibility is proven, not assumed: checkpoints written by an earlier xtrain load and resume
(tests/fixtures/legacy_checkpoints, written at commit 58f4d67: the layer scan's stacked storage,
ZeRO-2 unrolled, tensor parallel x FSDP; they predate checksums and load with a warning saying
so), and every public name users import stays importable."""
import importlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import xtrain
from xtrain import plans
from xtrain.checkpoint import CheckpointWarning

from models import GPT, token_batches

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "legacy_checkpoints"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())
LAYOUTS = {
    "dp8_scan": ({"data": 8}, lambda model, mesh: None, {"scan_layers": True}),
    "zero2_unrolled": ({"data": 8}, lambda model, mesh: xtrain.Plan(zero=2), {"scan_layers": False}),
    "tp2_fsdp4_scan": ({"data": 4, "tensor": 2},
                       lambda model, mesh: plans.fsdp(model, mesh, base=plans.megatron(
                           model, mesh, example=token_batches(n=1)[0])),
                       {"scan_layers": True}),
}


def _step(layout: str):
    axes, make_plan, options = LAYOUTS[layout]
    torch.manual_seed(1)  # other weights than the saved run's: the load must replace them all
    model = GPT()
    mesh = xtrain.Mesh(**axes)
    return xtrain.compile(model, mesh, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01),
                          plan=make_plan(model, mesh), **options)


@pytest.mark.e2e
@pytest.mark.parametrize("saved,layout", [("dp8_scan", "dp8_scan"), ("zero2_unrolled", "tp2_fsdp4_scan"),
                                          ("tp2_fsdp4_scan", "zero2_unrolled")])
def test_a_checkpoint_of_the_earlier_format_loads_and_resumes(saved, layout):
    step = _step(layout)
    with pytest.warns(CheckpointWarning, match=rf"{saved} has no checksums \(written by an xtrain before checkpoints "
                                               r"had them\): its data is loaded unverified"):
        extra = step.load(FIXTURES / saved)
    assert extra == {"run": saved, "next_batch": 2} and step.step_count == 2
    want = load_file(str(FIXTURES / f"{saved}.state.safetensors"))
    got = step.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name  # parameters and buffers exactly as saved
    loss = step(*token_batches(n=3)[2])["loss"]  # the optimizer state resumes too
    assert loss == pytest.approx(EXPECTED[saved]["losses"][2], rel=1e-5)


PUBLIC = {
    "xtrain": ["compile", "init", "Mesh", "Plan", "GradSync", "Precision", "LossScale", "ContextParallel", "shard",
               "plans", "checkpoint", "observe", "Loader", "ShardedLoader", "Buckets", "Monitor", "optim", "Remat",
               "TrainStep", "sagemaker", "errors", "emulated_cluster"],
    "xtrain.errors": ["XtrainError", "PlanError", "MeshError", "OptionsError", "InputError", "BatchTypeError",
                      "BatchIndexError", "UnsupportedError", "UnsupportedOpError", "TraceError", "TopKTooLarge",
                      "LaunchError", "ConformanceError", "CheckpointError", "NotBuiltError"],
    "xtrain.hooks": ["intercept_first_step"],
    "xtrain.plans": ["ddp", "fsdp", "zero", "hybrid", "megatron", "assert_sharded", "largest_replicated"],
    "xtrain.checkpoint": ["CheckpointError", "CheckpointManager", "CheckpointOptions", "CheckpointWarning",
                          "SaveHandle", "check_complete", "export", "load_sharded", "meta_params", "read_manifest",
                          "restore", "save", "verify_all"],
    "xtrain.optim": ["LearningRates", "from_torch", "LAMB", "LARS", "exclude_from_adaptation"],
    "xtrain.observe": ["Monitor", "model_flops", "plot", "read_metrics"],
    "xtrain.testing": ["ParityResult", "assert_parity", "run_parity", "torch_reference"],
    "xtrain.runtime": ["init", "process_env", "ProcessEnv", "job_devices", "emulated_cluster", "backend",
                       "sagemaker"],
    "xtrain.runtime.sagemaker": ["paths", "SageMakerPaths"],
    "xtrain.loader": ["Loader", "ShardedLoader"],
    "xtrain.cli": ["main"],
    "neuron_support.emulate": ["check_step", "virtual_cluster"],
    "neuron_support.conformance": ["check", "Target"],
}


@pytest.mark.unit
@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_imports(module):
    loaded = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} lost public names {missing}"
