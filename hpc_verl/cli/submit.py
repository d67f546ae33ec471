"""``hpc-verl submit --profile NAME [--config JOB.yaml] [--set k=v] [key=value ...] [--dry-run] [--detach]
[-- python3 -m MODULE ARGS...]``, ``hpc-verl submit --resume JOB``."""
from __future__ import annotations

import argparse

from hpc_verl.cli.common import PROFILE_HELP, add_plan_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("submit", help="render a job for a SLURM profile and sbatch it, or send it to a "
                       "running Ray cluster (--ray-address / --cluster)")
    add_plan_arguments(p, profile_required=False,
                       profile_help=PROFILE_HELP + " (required for SLURM; with --ray-address it supplies the "
                       "environment block and node/GPU counts)")
    p.add_argument("--ray-address", default=None, metavar="URL",
                   help="submit through the Ray Jobs API of this cluster, e.g. http://HEAD:8265")
    p.add_argument("--ray-token-file", default=None, metavar="FILE",
                   help="the cluster's Ray auth token (default: $RAY_AUTH_TOKEN(_PATH), ~/.ray/auth_token)")
    p.add_argument("--cluster", default=None, metavar="JOB",
                   help="submit into a cluster held by 'hpc-verl cluster up' (its id; address, token "
                   "and profile come from the registry)")
    p.add_argument("--name", default=None, help="job name (default: from the job config)")
    p.add_argument("--dry-run", action="store_true", help="write the job directory, do not submit")
    p.add_argument("--detach", action="store_true", help="local profile: run in the background (follow with "
                   "'hpc-verl logs JOB --follow', stop with 'hpc-verl cancel JOB'); default: foreground")
    p.add_argument("--resume", default=None, metavar="JOB",
                   help="run a stopped local job again in its own run directory: finished stages are skipped "
                   "and training continues from its last checkpoint")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpc_verl.launch import backends

    request = backends.SubmitRequest(profile=args.profile, config=args.config, overrides=tuple(args.overrides),
                                     command=tuple(args.command), sets=tuple(args.sets), name=args.name,
                                     ray_address=args.ray_address,
                                     ray_token_file=args.ray_token_file, cluster=args.cluster, detach=args.detach,
                                     resume=args.resume)
    backend = backends.for_request(request)
    dry = backend.dryrun(request)
    if args.dry_run:
        print(dry)
        return 0
    record = backend.submit(dry)
    print("\n".join(backend.report(record)))
    return int(record.exit_code or 0)
