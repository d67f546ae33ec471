"""``hpc-verl doctor``: check this node (or the job's container) against a cluster profile."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from hpc_verl.cli.common import PROFILE_HELP, add_profile_argument, add_set_argument

STYLE = {"OK": "green", "WARN": "yellow", "FAIL": "bold red", "SKIP": "dim"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check a node against its cluster profile (IB, NIC, shm, limits, ports, Ray, CPUs, GPUs)",
        description="Check this node against a cluster profile: InfiniBand HCAs active, the profile's "
                    "interface and its IPv4, /dev/shm size, memlock/nofile limits, the job's Ray port block, "
                    "the length of Ray's Unix socket paths and the filesystem under its temp dir, the CPUs Ray "
                    "will be told against what the job may use, CPU ranks against CPUs (CPU profiles), "
                    "with --job-id whether the job's head answers on its published ports from here, "
                    "Ray and torch versions, GPUs, the container runtime and IB devices in the container. "
                    "Each check prints OK/WARN/FAIL/SKIP with a one-line fix. Exit 1 if any check FAILs.")
    add_profile_argument(parser, required=False, default=os.environ.get("HPC_VERL_PROFILE", "local"),
                         help=PROFILE_HELP + " (default: $HPC_VERL_PROFILE or 'local')")
    add_set_argument(parser)
    parser.add_argument("--job-id", type=int, default=None,
                        help="check this job's Ray port block, and that its head's ports answer from here "
                             "(default: $SLURM_JOB_ID)")
    parser.add_argument("--deep", action="store_true",
                        help="also start the profile's container once and look inside (Ray, torch, GPUs, IB)")
    parser.add_argument("--in-container", action="store_true",
                        default=os.environ.get("HPC_VERL_IN_CONTAINER", "") not in ("", "0", "false"),
                        help="doctor runs inside the job's container (default: $HPC_VERL_IN_CONTAINER)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    roots = parser.add_argument_group("kernel views (for containers and tests)")
    roots.add_argument("--sysfs-root", default="/sys", metavar="DIR")
    roots.add_argument("--proc-root", default="/proc", metavar="DIR")
    roots.add_argument("--dev-root", default="/dev", metavar="DIR")
    roots.add_argument("--shm-path", default="/dev/shm", metavar="DIR")
    parser.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from hpc_verl.ops.doctor import Context, Expectations, run_doctor
    from hpc_verl.ops.sysinfo import Roots
    from hpc_verl.profiles import load_profile

    profile = load_profile(args.profile, args.sets)
    exp = Expectations.from_profile(profile)
    ctx = Context(roots=Roots(Path(args.sysfs_root), Path(args.proc_root), Path(args.dev_root),
                              Path(args.shm_path)),
                  in_container=args.in_container, job_id=args.job_id, deep=args.deep)
    report = run_doctor(exp, ctx)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        _print_table(report)
    return 1 if report.failed else 0


def _print_table(report: Any) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)
    table = Table(title=f"hpc-verl doctor: profile '{report.profile}'", title_justify="left")
    table.add_column("check", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("detail", overflow="fold")
    table.add_column("fix", overflow="fold")
    for c in report.checks:
        table.add_row(c.name, Text(c.status, style=STYLE.get(c.status, "")), c.detail, c.fix)
    console.print(table)
    counts = report.to_dict()["counts"]
    verdict = "FAIL" if report.failed else "OK"
    console.print(Text(f"{verdict}: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n),
                       style=STYLE[verdict]))
