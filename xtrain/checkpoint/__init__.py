"""Checkpoints: save/restore a training step on any mesh and plan, export plain state dicts,
load HF safetensors straight into shards, and resume after restarts.

    step.save("ckpt/step_100", extra={"data": loader.state_dict()})   # every process calls it
    extra = step.load("ckpt/step_100")       # onto this step's mesh and plan, whatever they are
    step.export("model.safetensors")         # a plain state dict under the module's own names
    xtrain.compile(meta_model, mesh, ..., init_from="model.safetensors")  # sharded loading

Format: safetensors files (one per process, its own shards) plus a JSON manifest with a
checksum per stored piece; no pickles.
"""
from xtrain.checkpoint.integrity import CheckpointWarning
from xtrain.checkpoint.layout import CheckpointError
from xtrain.checkpoint.manager import CheckpointManager, CheckpointOptions
from xtrain.checkpoint.pretrained import export, load_sharded, meta_params, read_stored
from xtrain.checkpoint.store import check_complete, read_manifest, restore, verify_all
from xtrain.checkpoint.writer import SaveHandle, save

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointOptions", "CheckpointWarning", "SaveHandle",
           "check_complete", "export", "load_sharded", "meta_params", "read_manifest", "read_stored", "restore",
           "save", "verify_all"]
