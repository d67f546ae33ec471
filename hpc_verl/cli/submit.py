"""``hpc-verl submit --profile NAME [--config JOB.yaml] [--set k=v] [key=value ...] [--dry-run] [--detach]``."""
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.ray_address or args.cluster:
        from hpc_verl.cli.cluster import submit_ray

        return submit_ray(args)
    if not args.profile:
        from hpc_verl.errors import ConfigError

        raise ConfigError("submit needs --profile NAME (a SLURM profile, or 'local' for this machine; see "
                          "'hpc-verl profiles list'), or --ray-address URL / --cluster JOB for a running Ray cluster")
    from hpc_verl.launch.submit import submit_job

    rec = submit_job(args.profile, args.config, args.overrides, args.sets, args.name, args.dry_run,
                     detach=args.detach)
    if rec.scheduler == "local" and not rec.dry_run:
        return _report_local(rec)
    if rec.job_id is None:
        how = f"bash {rec.script}" if rec.scheduler == "local" else f"sbatch {rec.script}"
        print(f"dry run: job directory {rec.job_dir}\nscript: {rec.script}\nsubmit with: {how}")
    else:
        print(f"submitted job {rec.job_id} ({rec.name}, profile {rec.profile})")
        print(f"job directory: {rec.job_dir}")
        print(f"run directory: {rec.run_dir}")
        print(f"logs: {rec.batch_log} and {rec.log_dir}/node-<node>.log")
        print(f"follow: hpc-verl logs {rec.job_id} --follow")
    return 0


def _report_local(rec) -> int:
    """After a local job: where its results are (foreground), or how to follow it (detached)."""
    from hpc_verl.launch import local

    if rec.exit_code is None:
        print(f"started local job {rec.job_id} ({rec.name}) in the background")
        print(f"run directory: {rec.run_dir}")
        print(f"follow: hpc-verl logs {rec.job_id} --follow    stop: hpc-verl cancel {rec.job_id}")
        return 0
    state = local.info(rec).state
    print(f"local job {rec.job_id} ({rec.name}): {state}, exit status {rec.exit_code}")
    for line in local.results(rec):
        print(line)
    return rec.exit_code
