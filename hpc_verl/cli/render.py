"""``hpc-verl render``: profile + job config -> sbatch script (stdout or -o FILE)."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from hpc_verl.cli.common import add_plan_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("render", help="render the sbatch script for a profile and job",
                                   description="Render the sbatch script for a profile and job config. Nothing "
                                               "is submitted; without -o the script goes to stdout.")
    add_plan_arguments(parser)
    parser.add_argument("-o", "--output", metavar="FILE", help="write the script here (atomically, executable)")
    parser.add_argument("--check", action="store_true", help="also run bash -n and shellcheck on the result")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpc_verl.errors import RenderError
    from hpc_verl.launch.spec.launch_plan import build_plan, validate_script

    plan = build_plan(args.profile, args.config, args.overrides, profile_overrides=args.sets,
                      command=args.command)
    if args.check:
        problems = validate_script(plan.script)
        if problems:
            raise RenderError(f"the rendered script has {len(problems)} problem(s), first: {problems[0]}")
    if args.output:
        path = plan.write(args.output)
        print(f"wrote {path}\n{plan.summary()}", file=sys.stderr)
    else:
        try:
            sys.stdout.write(plan.script)
            sys.stdout.flush()
        except BrokenPipeError:  # `hpc-verl render ... | head` is fine
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
