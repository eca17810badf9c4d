"""SageMaker's paths, under a faked SageMaker environment (nothing is written to /opt/ml): the
input channels, the configured checkpoint directory (checkpointconfig.json), `step.export()`
into SM_MODEL_DIR; and the example training from the "training" channel, checkpointing there
and exporting weights that load back into the model."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import xtrain
from models import MLP, mlp_batches
from xtrain.checkpoint import CheckpointManager
from xtrain.errors import LaunchError
from xtrain.runtime import sagemaker

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
from gpt_model import GPT, GPTConfig  # noqa: E402


def fake_job(tmp_path, *, checkpoints: bool = True) -> dict[str, str]:
    """The variables SageMaker's training toolkit sets for one host, with its folders under tmp_path."""
    config = tmp_path / "input" / "config"
    config.mkdir(parents=True)
    if checkpoints:
        (config / "checkpointconfig.json").write_text(json.dumps(
            {"LocalPath": str(tmp_path / "checkpoints"), "S3Uri": "s3://bucket/job/checkpoints"}))
    (tmp_path / "data").mkdir()
    return {"SM_HOSTS": '["algo-1"]', "SM_CURRENT_HOST": "algo-1", "SM_MODEL_DIR": str(tmp_path / "model"),
            "SM_INPUT_CONFIG_DIR": str(config), "SM_CHANNEL_TRAINING": str(tmp_path / "data"),
            "SM_CHANNEL_EVAL": str(tmp_path / "eval")}


@pytest.mark.unit
def test_paths_of_a_job(tmp_path):
    env = fake_job(tmp_path)
    job = sagemaker.paths(env)
    assert job.model_dir == tmp_path / "model" and job.checkpoint_dir == tmp_path / "checkpoints"
    assert job.channels == {"training": tmp_path / "data", "eval": tmp_path / "eval"}
    assert sagemaker.paths({}) is None  # not a SageMaker job
    (tmp_path / "input" / "config" / "checkpointconfig.json").write_text('{"S3Uri": "s3://b/c"}')
    assert sagemaker.paths(env, root=str(tmp_path / "ml")).checkpoint_dir == tmp_path / "ml" / "checkpoints"


@pytest.mark.unit
def test_no_checkpoint_config_means_no_checkpoint_directory(tmp_path, monkeypatch):
    env = fake_job(tmp_path, checkpoints=False)
    assert sagemaker.paths(env).checkpoint_dir is None
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(LaunchError, match=re.escape("CheckpointManager() without a directory uses SageMaker's "
                                                    "checkpoint directory, but this process runs in a SageMaker job "
                                                    "that configured no checkpoints")):
        CheckpointManager()


@pytest.mark.e2e
def test_export_without_a_path_goes_to_sm_model_dir(tmp_path, monkeypatch):
    model = MLP()
    step = xtrain.compile(model, xtrain.Mesh(data=8), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    step(*mlp_batches(n=1)[0])
    with pytest.raises(LaunchError, match=re.escape("step.export() without a path writes to SageMaker's model "
                                                    "directory (SM_MODEL_DIR), but this process runs outside")):
        step.export()
    for name, value in fake_job(tmp_path).items():
        monkeypatch.setenv(name, value)
    path = step.export()
    assert path == tmp_path / "model" / "model.safetensors"
    fresh = MLP()
    fresh.load_state_dict(load_file(str(path)), strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in step.state_dict().items())
    assert CheckpointManager().directory == tmp_path / "checkpoints"


@pytest.mark.multiprocess
def test_example_trains_from_the_channel_checkpoints_and_exports(tmp_path):
    env = fake_job(tmp_path)
    text = "SageMaker channel data: the quick brown fox jumps over the lazy dog. " * 400
    (tmp_path / "data" / "part-0.txt").write_text(text)
    args = ["--steps", "4", "--save-every", "2", "--layers", "1", "--d-model", "32", "--batch", "16", "--seq", "16",
            "--metrics", "", "--plot", ""]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *args],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, **env, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    train_bytes = int(len(text.encode()) * 0.9)
    assert f"{train_bytes:,} training bytes from SageMaker channel 'training'" in out.stdout
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step_00000002", "step_00000004"]
    exported = tmp_path / "model" / "model.safetensors"
    assert f"exported: {exported}" in out.stdout
    model = GPT(GPTConfig(seq=16, layers=1, d_model=32, heads=4))
    model.load_state_dict(load_file(str(exported)), strict=True)  # what SageMaker uploads loads back
    assert not torch.equal(model.state_dict()["lm_head.weight"], GPT(GPTConfig(seq=16, layers=1, d_model=32,
                                                                                heads=4)).state_dict()["lm_head.weight"])
