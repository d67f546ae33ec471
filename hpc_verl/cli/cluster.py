"""``hpc-verl cluster up --profile NAME --nodes N`` / ``cluster down [JOB]``: Ray clusters held in SLURM jobs."""
from __future__ import annotations

import argparse
import sys

from hpc_verl.cli.common import PROFILE_HELP, add_profile_argument, add_set_argument


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cluster", help="hold a Ray cluster in a SLURM allocation for Ray Jobs submissions")
    verbs = p.add_subparsers(dest="cluster_verb", metavar="up|down", parser_class=type(p))
    up = verbs.add_parser("up", help="start a cluster job; print its Ray Jobs address and token file")
    add_profile_argument(up, help="SLURM " + PROFILE_HELP)
    up.add_argument("--nodes", type=int, required=True, help="number of nodes")
    add_set_argument(up)
    up.add_argument("--name", default=None, help="job name (default ray-cluster)")
    up.add_argument("--time-min", type=int, default=None, help="time limit in minutes (default: the profile's)")
    up.add_argument("--wait-timeout-s", type=float, default=600,
                    help="how long to wait for the allocation and Ray (default 600)")
    up.set_defaults(func=cmd_up)
    down = verbs.add_parser("down", help="cancel a cluster job (its Ray and running Ray jobs stop)")
    down.add_argument("job", nargs="?", default=None, help="cluster job id (default: the newest running one)")
    down.set_defaults(func=cmd_down)
    p.set_defaults(func=lambda _args: (p.print_help(sys.stderr), 2)[1])


def cmd_up(args: argparse.Namespace) -> int:
    from hpc_verl.launch import cluster

    from rich.console import Console

    console = Console(stderr=True)
    with console.status("submitting the cluster job") as spinner:
        def progress(msg: str) -> None:
            console.print(f"hpc-verl: {msg}", highlight=False)
            spinner.update(msg)

        rec, info = cluster.up(args.profile, args.nodes, args.sets, args.name, args.time_min,
                               args.wait_timeout_s, progress=progress)
    print(f"cluster job {rec.job_id} is up: {len(info.get('nodes', []))} node(s), Ray {info.get('ray_version')}")
    print(f"  Ray Jobs address: {info['address']}")
    print(f"  token file:       {info['token_file']}")
    print(f"submit into it:     hpc-verl submit --cluster {rec.job_id} [--config JOB.yaml] [key=value ...]")
    print(f"  (or)              hpc-verl submit --ray-address {info['address']} "
          f"--ray-token-file {info['token_file']} ...")
    print(f"stop it:            hpc-verl cluster down {rec.job_id}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from hpc_verl.launch import cluster

    rec, state = cluster.down(args.job)
    print(f"cluster job {rec.job_id}: {state}")
    return 0
