"""Started by `xtrain run` in test_cli: reports what the process sees as one JSON line per rank."""
import json
import os
import sys


def report(record: dict) -> None:
    # one write per record: with unbuffered output print() writes the text and the newline
    # apart, and the other rank's record can land between them
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


import xtrain

if "--jax" in sys.argv:
    # a script's own device count: `xtrain run --emulate` (XTRAIN_EMULATE) must win over it
    xtrain.init(cpu_devices=int(sys.argv[sys.argv.index("--cpu-devices") + 1]) if "--cpu-devices" in sys.argv else None)
    import jax
    import numpy as np

    from xtrain.runtime import emulated_cluster

    cluster = emulated_cluster()
    # one cross-process sum: the collectives connect (and Gloo announces it on stdout)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    ones = jax.make_array_from_callback((jax.device_count(),), jax.sharding.NamedSharding(mesh, jax.P("d")),
                                        lambda index: np.ones((1,), np.float32))
    total = float(jax.jit(lambda x: x.sum(), out_shardings=jax.sharding.NamedSharding(mesh, jax.P()))(ones))
    report({"rank": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "axes": cluster.axes if cluster else None, "sum": total})
else:
    report({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]), "args": sys.argv[1:]})
