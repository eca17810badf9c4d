"""Process and device setup: launcher environments -> jax.distributed, backend detection."""
from xtrain.runtime.launch import ProcessEnv, process_env
from xtrain.runtime.devices import init, backend, job_devices

__all__ = ["ProcessEnv", "process_env", "init", "backend", "job_devices"]
