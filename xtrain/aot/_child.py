"""The child process of a deviceless GPU compile (started by xtrain.aot.toolchain.run_child).

    python _child.py JOBS.pkl RESULTS.pkl

Runs as a script, not as part of the xtrain package: it needs only JAX and the CUDA plugin, with
the environment its parent prepared (JAX_PLATFORMS=cpu, xtrain's GPU XLA_FLAGS, the pinned ptxas
first on PATH). Each job is a dict:

    exported      jax.export serialization of the flat training step (its args: state leaves,
                  batch, learning rates)
    specs         per argument: (PartitionSpec, memory kind or None)
    donated       how many leading arguments are donated (the training state)
    axes, shape   the mesh's axis names and sizes
    topology      XLA's 'SLICES x HOSTS x GPUS' string
    config        the GpuTargetConfigProto text of one GPU
    compiler_options  XLA options of this compile (over XLA_FLAGS): xtrain.lowering.gpu_options

and its result a dict: memory (XLA's memory analysis), text (the scheduled HLO), executable
(jax.experimental.serialize_executable bytes), seconds, or error (the exception's text).
"""
import hashlib
import pickle
import sys
import time
import traceback


def _compile(job: dict, topologies_made: dict) -> dict:
    import jax
    from jax.experimental import serialize_executable, topologies
    from jax.sharding import NamedSharding

    key = (job["topology"], job["config"])
    if key not in topologies_made:
        topologies_made[key] = topologies.get_topology_desc(platform="cuda", topology=job["topology"],
                                                            target_config=job["config"])
    mesh = topologies.make_mesh(topologies_made[key], tuple(job["shape"]), tuple(job["axes"]))
    exported = jax.export.deserialize(job["exported"])
    args = [jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=NamedSharding(mesh, spec, memory_kind=kind))
            for aval, (spec, kind) in zip(exported.in_avals, job["specs"])]
    start = time.perf_counter()
    compiled = jax.jit(exported.call, donate_argnums=tuple(range(job["donated"]))).lower(*args).compile(
        compiler_options=job.get("compiler_options"))
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    memory = {name: int(getattr(stats, f"{name}_size_in_bytes")) for name in (
        "argument", "output", "alias", "temp", "generated_code", "host_argument", "host_output", "host_temp")}
    executable = serialize_executable.serialize(compiled)[0]
    return {"memory": memory, "text": compiled.as_text(), "executable": executable, "seconds": seconds,
            "sha256": hashlib.sha256(executable).hexdigest(), "devices": [d.id for d in mesh.devices.flat]}


def main(jobs_path: str, results_path: str) -> None:
    with open(jobs_path, "rb") as f:
        jobs = pickle.load(f)
    made: dict = {}
    results = []
    for job in jobs:
        try:
            results.append(_compile(job, made))
        except Exception:  # one job's failure is reported with it; the others still compile
            results.append({"error": traceback.format_exc(limit=4)})
    with open(results_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:3])
