"""Started by `xtrain run` in test_cli: reports what the process sees as one JSON line per rank."""
import json
import os
import sys

import xtrain

if "--jax" in sys.argv:
    xtrain.init()
    import jax

    from xtrain.runtime import emulated_cluster

    cluster = emulated_cluster()
    print(json.dumps({"rank": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
                      "local_devices": jax.local_device_count(), "axes": cluster.axes if cluster else None}),
          flush=True)
else:
    print(json.dumps({"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
                      "args": sys.argv[1:]}), flush=True)
