"""``hpc-verl plot RUN_DIR``: a PNG of the run's curves (reward, KL, losses, throughput)."""
from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plot", help="plot a training run's metrics to a PNG")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--output", "-o", metavar="PNG", help="default: RUN_DIR/curves.png")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from hpc_verl.trainer.metrics import plot_run
    out = plot_run(args.run_dir, args.output)
    print(f"plot: wrote {out}")
    return 0
