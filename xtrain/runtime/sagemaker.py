"""SageMaker's paths: where a training job reads its data and leaves its model and checkpoints.

    model_dir       SM_MODEL_DIR (/opt/ml/model): uploaded to S3 as model.tar.gz when the job
                    ends; `step.export()` without a path writes there (process 0)
    checkpoint_dir  the job's checkpoint directory, synced to S3 while it runs, when the
                    estimator configured one (`checkpoint_s3_uri=...`): SageMaker then writes
                    `checkpointconfig.json` (LocalPath, S3Uri) into the input config directory
                    (SM_INPUT_CONFIG_DIR, /opt/ml/input/config), and LocalPath (by default
                    /opt/ml/checkpoints) is the directory; without that file, None
    channels        the input channels, SM_CHANNEL_<NAME> -> local directory (`fit({"training":
                    "s3://..."})` gives SM_CHANNEL_TRAINING)

Sources: the SageMaker developer guide ("Use checkpoints in Amazon SageMaker", "Amazon SageMaker
training storage folders") and the SageMaker training toolkit's environment variables.

Everything is read from the environment SageMaker gives the process (and that one file); the
`root` argument stands in for /opt/ml (tests and local runs point it elsewhere).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping

from xtrain.errors import LaunchError
from xtrain.runtime.launch import Cluster, process_env

ROOT = "/opt/ml"  # SageMaker's fixed prefix
CHECKPOINT_CONFIG = "checkpointconfig.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SageMakerPaths:
    """Attributes:
        model_dir: where the final model goes (SM_MODEL_DIR).
        checkpoint_dir: the configured checkpoint directory, or None (not configured).
        channels: input channel name (lower case) -> its local directory.
    """

    model_dir: Path | None
    checkpoint_dir: Path | None
    channels: Mapping[str, Path]


def _checkpoint_dir(env: Mapping[str, str], root: str) -> Path | None:
    config_dir = Path(env.get("SM_INPUT_CONFIG_DIR", os.path.join(root, "input", "config")))
    config = config_dir / CHECKPOINT_CONFIG
    if not config.is_file():
        return None
    try:
        local = json.loads(config.read_text()).get("LocalPath")
    except (json.JSONDecodeError, AttributeError):
        raise LaunchError(f"{config} is not SageMaker's checkpoint configuration (a JSON object with "
                          "LocalPath and S3Uri)") from None
    return Path(local or os.path.join(root, "checkpoints"))


def paths(env: Mapping[str, str] | None = None, *, root: str = ROOT) -> SageMakerPaths | None:
    """SageMaker's paths for this process, or None when it does not run in a SageMaker job.

    Args:
        env: the environment (os.environ by default).
        root: SageMaker's /opt/ml, for the defaults of what the environment does not name.
    """
    env = os.environ if env is None else env
    job = process_env(env)
    if job.cluster is not Cluster.SAGEMAKER:
        return None
    return SageMakerPaths(model_dir=Path(job.model_dir) if job.model_dir else None,
                          checkpoint_dir=_checkpoint_dir(env, root),
                          channels={name: Path(path) for name, path in job.data_channels})


def export_path() -> Path:
    """Where `step.export()` without a path writes: SM_MODEL_DIR/model.safetensors."""
    job = paths()
    if job is None or job.model_dir is None:
        raise LaunchError(
            "step.export() without a path writes to SageMaker's model directory (SM_MODEL_DIR), but "
            "this process runs outside a SageMaker job; pass a path, e.g. step.export('model.safetensors')")
    return job.model_dir / "model.safetensors"


def checkpoint_directory() -> Path:
    """Where `CheckpointManager()` without a directory keeps checkpoints: the job's configured one."""
    job = paths()
    if job is None or job.checkpoint_dir is None:
        where = "outside a SageMaker job" if job is None else "in a SageMaker job that configured no checkpoints"
        raise LaunchError(f"CheckpointManager() without a directory uses SageMaker's checkpoint directory, but this "
                          f"process runs {where} (the estimator's checkpoint_s3_uri sets one up); pass a directory, "
                          "e.g. CheckpointManager('ckpt')")
    return job.checkpoint_dir
