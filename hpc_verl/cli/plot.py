"""``hpc-verl plot RUN_DIR``: a PNG of the run's curves, and one of them drawn in the terminal."""
from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plot", help="plot a training run's metrics to a PNG and one curve in the terminal",
                              description="Write RUN_DIR/curves.png (reward, KL, losses, throughput) and draw one "
                                          "metric in the terminal with the means of its first and last steps. "
                                          "--require-final makes it a check: exit 1 when the last steps' mean "
                                          "is below the value.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--output", "-o", metavar="PNG", help="default: RUN_DIR/curves.png")
    p.add_argument("--metric", default="critic/score/mean", help="the curve drawn in the terminal (default critic/score/mean)")
    p.add_argument("--window", type=int, default=10, help="steps averaged for the first/last means (default 10)")
    p.add_argument("--require-final", type=float, default=None, metavar="X",
                   help="exit 1 unless the mean of the last --window steps is at least X")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from hpc_verl.errors import ConfigError
    from hpc_verl.ops.curve import curve_of, render
    from hpc_verl.trainer.observe.metrics import plot_run, read_metrics

    if args.window < 1:
        raise ConfigError(f"--window {args.window}: must be at least 1")
    curve = curve_of(read_metrics(args.run_dir), args.metric, args.window)
    out = plot_run(args.run_dir, args.output)
    print(f"plot: wrote {out}")
    Console(width=None if sys.stdout.isatty() else 100).print(render(curve))
    if args.require_final is not None and curve.last_mean < args.require_final:
        print(f"plot: the mean {args.metric} of the last {curve.window} steps is {curve.last_mean:.3f}, below "
              f"--require-final {args.require_final:g}", file=sys.stderr)
        return 1
    return 0
