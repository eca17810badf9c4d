"""The `xtrain` command.

    xtrain env [--emulate trn1.32xlarge:2] [--instance-type T] [--precision bf16]   what xtrain detects and sets
    xtrain run [--nproc-per-node N] [--nnodes N] ... train.py [args]   torchrun with backend defaults
    xtrain report train.py [args]                                  the step's report, no training
    xtrain plan --target trn1.32xlarge:4 train.py [args]           candidate plans for a cluster, no training

One module per command, this package's `main` (the console entry point, xtrain.cli:main) parses
the arguments and dispatches:

    launch.py   xtrain run: the torchrun command line (`launch_command`, a pure function) and
                the launch that execs it, with the node and process defaults of each backend
    env.py      xtrain env: what xtrain detects and sets
    report.py   xtrain report
    plan.py     xtrain plan
    script.py   a user's script run with its first training step taken over (report, plan)
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from xtrain.cli import plan, report
from xtrain.cli.env import env_report
from xtrain.cli.launch import LAYOUTS, RunOptions, free_port_pair, launch_command, launch_env, run
from xtrain.runtime.launch import DEFAULT_MASTER_PORT

__all__ = ["main", "RunOptions", "env_report", "free_port_pair", "launch_command", "launch_env", "run"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xtrain", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="print the backend, devices, processes, mesh and environment xtrain uses")
    env.add_argument("--emulate", help="fly a cluster on CPU devices, e.g. trn1.32xlarge:2")
    env.add_argument("--instance-type", help="instance type when it cannot be detected, e.g. trn1.32xlarge")
    env.add_argument("--no-start", action="store_true", help="do not start JAX (no device list)")
    env.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16", "fp8"),
                     help="the plan's compute precision, as the script passes it to xtrain.init(precision=...)")
    r = sub.add_parser("run", help="launch a script with torchrun and this backend's defaults")
    r.add_argument("--nproc-per-node", type=int, help="processes per node (default: per backend)")
    r.add_argument("--nnodes", type=int, help="nodes (default: from SageMaker/srun, else 1)")
    r.add_argument("--node-rank", type=int, help="this node's rank (default: from SageMaker/srun, else 0)")
    r.add_argument("--master-addr", help="host of node 0 (default: from SageMaker/srun, else 127.0.0.1)")
    r.add_argument("--master-port", type=int, help=f"torchrun's store port (default {DEFAULT_MASTER_PORT}, "
                   "or a free one on a single node); jax.distributed uses it + 17")
    r.add_argument("--layout", default="process-per-node", choices=LAYOUTS, help="Trainium: processes per node")
    r.add_argument("--emulate", help="fly a cluster on CPU: one process per emulated node, e.g. trn1.32xlarge:2")
    r.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    r.add_argument("--verbose", action="store_true",
                   help="on CPU, also show the collectives' per-rank connection lines (hidden by default)")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report", help="print the compiled step's report (collectives, memory) for a script "
                         "without training: its first step(...) call prints step.report() and exits")
    rep.add_argument("script")
    rep.add_argument("args", nargs=argparse.REMAINDER)
    pl = sub.add_parser("plan", help="predict memory, step time, tokens/s and MFU of candidate plans for a "
                        "target cluster and pick one; lowers for an abstract mesh (no devices of that kind needed)")
    pl.add_argument("--target", required=True, help="INSTANCE[:NODES] (e.g. trn1.32xlarge:4) or emulated[:N]")
    pl.add_argument("--global-batch", type=int, help="global batch for the target (default: the script's)")
    pl.add_argument("--all", action="store_true", dest="show_all",
                    help="also list the memory-only variants (remat, 1F1B, offload) not lowered because their plain plan fits")
    pl.add_argument("--compile", type=int, nargs="?", const=3, default=0, metavar="N", dest="compile_top",
                    help="GPU targets: also compile the best N candidates (3 without N) with XLA's GPU compiler, "
                         "print their compiled memory and never pick one that does not fit")
    pl.add_argument("--precision", choices=("fp32", "bf16", "fp16", "fp8"),
                    help="every candidate's compute precision (default: fp32, or fp16 with loss scaling on a "
                         "GPU without bf16); a precision the target has no arithmetic for is refused")
    pl.add_argument("--capacity-factor", type=float, dest="capacity_factor",
                    help="MoE models: every candidate's expert capacity, Plan(capacity_factor=...) (default: the "
                         "script's plan's; drop-free without one); expert parallel's all-to-alls are costed at it")
    pl.add_argument("script")
    pl.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        if ns.command == "env":
            print(env_report(emulate=ns.emulate, instance=ns.instance_type, start=not ns.no_start,
                             precision=ns.precision))
            return 0
        if ns.command == "report":
            return report.report(ns.script, ns.args)
        if ns.command == "plan":
            return plan.plan(ns.script, ns.args, ns.target, ns.global_batch, show_all=ns.show_all,
                             compile_top=ns.compile_top, precision=ns.precision,
                             capacity_factor=ns.capacity_factor)
        opts = RunOptions(script=ns.script, args=tuple(ns.args), nproc_per_node=ns.nproc_per_node,
                          nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=ns.master_addr,
                          master_port=ns.master_port, layout=ns.layout, emulate=ns.emulate,
                          verbose=ns.verbose)
        return run(opts, dry_run=ns.dry_run)
    except ValueError as err:
        print(f"xtrain {ns.command}: {err}", file=sys.stderr)
        return 2

