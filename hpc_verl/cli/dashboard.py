"""``hpc-verl dashboard``: live view (or one JSON snapshot) of running dataflow graphs."""
from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> int:
    from hpc_verl.ops.dashboard import run_dashboard

    return run_dashboard(args.address, args.graph, args.once, args.json, args.status_file, args.interval)


def register(subparsers: "argparse._SubParsersAction") -> None:
    from hpc_verl.ops.dashboard import add_arguments

    p = subparsers.add_parser("dashboard", help="live view of running dataflow graphs (nodes, GPUs, edges, decisions)",
                              description="Show the scheduler's state: nodes, workers and GPUs (memory heat map), "
                                          "edges with latency and queue length, and the decision log.")
    add_arguments(p)
    p.set_defaults(func=_run)
