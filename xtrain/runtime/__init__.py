"""Process and device setup: launcher environments -> jax.distributed, backend detection,
compilation cache; SageMaker's model, checkpoint and input-channel paths (sagemaker.py)."""
from xtrain.runtime import sagemaker
from xtrain.runtime.launch import Cluster, Launcher, ProcessEnv, process_env
from xtrain.runtime.devices import init, backend, emulated_cluster
from xtrain.sharding.mesh import job_devices  # the mesh's device order

__all__ = ["Cluster", "Launcher", "ProcessEnv", "process_env", "init", "backend", "emulated_cluster",
           "job_devices", "sagemaker"]
