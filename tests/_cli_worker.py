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
    xtrain.init()
    import jax

    from xtrain.runtime import emulated_cluster

    cluster = emulated_cluster()
    report({"rank": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "axes": cluster.axes if cluster else None})
else:
    report({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]), "args": sys.argv[1:]})
