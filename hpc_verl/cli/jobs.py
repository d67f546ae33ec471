"""``hpc-verl list | status JOB | logs JOB [--node N] [--follow] | cancel JOB`` (job ops)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="jobs in the registry with their SLURM state")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("status", help="state, nodes, Ray address and ports of a job")
    p.add_argument("job", help="SLURM job id or job directory name")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("logs", help="print a job's logs")
    p.add_argument("job")
    p.add_argument("--node", default=None, help="this node's Ray/step log instead of the batch log")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("cancel", help="cancel a job (its trap stops Ray and containers)")
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)


def _state(rec) -> tuple[str, object]:
    from hpc_verl.launch import slurm

    if rec.scheduler == "rayjob":  # Ray Jobs API (hpc_verl.launch.rayjobs_ops)
        from hpc_verl.launch import rayjobs_ops

        return ("DRY-RUN" if rec.dry_run else rayjobs_ops.list_state(rec)), None
    if rec.job_id is None:
        return "DRY-RUN", None
    if rec.scheduler == "local":  # a script on this machine (hpc_verl.launch.local)
        from hpc_verl.launch import local

        info = local.info(rec)
        return info.state, info
    info = slurm.job_info(rec.job_id, env=rec.env())
    return (info.state if info else "UNKNOWN (left SLURM)"), info


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hpc_verl.launch import registry

    table = Table(title=f"hpc-verl jobs ({registry.jobs_root()})")
    for col in ("job id", "name", "profile", "state", "submitted", "directory"):
        table.add_column(col)
    for rec in registry.all_jobs():
        state, _ = _state(rec)
        table.add_row(str(rec.job_id or rec.submission_id or "-"), rec.name, rec.profile, state,
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.submitted)), Path(rec.job_dir).name)
    Console(width=200).print(table)
    return 0


def status_dict(rec) -> dict:
    import json

    if rec.scheduler == "rayjob" and not rec.dry_run:
        from hpc_verl.launch import rayjobs_ops

        return rayjobs_ops.describe(rec)
    state, info = _state(rec)
    rec.refresh_from_ray()
    head = {}
    try:
        head = json.loads((Path(rec.run_dir) / "ray" / "head.json").read_text())
    except (OSError, ValueError):
        pass
    stages = sorted(p.stem for p in (Path(rec.run_dir) / "stages").glob("*.done")) if rec.run_dir else []
    return {"job_id": rec.job_id, "name": rec.name, "profile": rec.profile, "state": state,
            "source": getattr(info, "source", None), "reason": getattr(info, "reason", ""),
            "exit_code": getattr(info, "exit_code", ""), "restarts": getattr(info, "restarts", 0),
            "slurm_nodes": getattr(info, "nodes", ""), "nodes": rec.nodes, "ray_address": head.get("address"),
            "ports": rec.ports, "stages_done": stages, "job_dir": rec.job_dir, "run_dir": rec.run_dir,
            "batch_log": rec.batch_log, "log_dir": rec.log_dir,
            **({"jobs_address": rec.ray_address, "token_file": rec.token_file} if rec.role == "cluster" else {})}


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from hpc_verl.launch import registry

    d = status_dict(registry.find(args.job))
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    for k, v in d.items():
        if isinstance(v, str) and "\n" in v:  # e.g. a failed Ray job's last log lines
            print(k)
            print("\n".join("  " + line for line in v.splitlines()))
            continue
        if k == "ports":
            v = ", ".join(f"{n}: {p.get('block_start')}+" for n, p in v.items()) if v else "-"
        print(f"{k:12} {v if v not in (None, '', []) else '-'}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from hpc_verl.errors import JobNotFoundError
    from hpc_verl.launch import registry

    rec = registry.find(args.job)
    if rec.scheduler == "rayjob" and not rec.dry_run:
        from hpc_verl.launch import rayjobs_ops

        if args.node:
            raise JobNotFoundError(f"job {args.job} is a Ray job: it has one driver log, no per-node logs; "
                                   "drop --node (node logs are in the cluster job's logs)")
        return rayjobs_ops.logs(rec, follow=args.follow)
    if rec.job_id is None:
        raise JobNotFoundError(f"job {args.job} was a dry run; it has no logs")
    log = Path(rec.log_dir) / f"node-{args.node}.log" if args.node else Path(rec.batch_log)
    if args.node and not log.exists():
        known = sorted(p.stem[len("node-"):] for p in Path(rec.log_dir).glob("node-*.log"))
        raise JobNotFoundError(f"job {args.job}: no log for node '{args.node}' in {rec.log_dir}; "
                               f"nodes with logs: {', '.join(known) or 'none yet'}")
    pos = 0
    while True:
        if log.exists():
            with open(log, "rb") as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
        if not args.follow:
            return 0
        state, info = _state(rec)
        if info is None or info.terminal or state.startswith("UNKNOWN"):
            if log.exists() and log.stat().st_size > pos:
                continue
            return 0
        time.sleep(0.5)


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpc_verl.errors import SubmitError
    from hpc_verl.launch import registry, slurm

    rec = registry.find(args.job)
    if rec.scheduler == "rayjob" and not rec.dry_run:
        from hpc_verl.launch import rayjobs_ops

        print(rayjobs_ops.cancel(rec))
        return 0
    if rec.job_id is None:
        raise SubmitError(f"job {args.job} was a dry run; nothing to cancel")
    if rec.scheduler == "local":
        from hpc_verl.launch import local

        print(local.cancel(rec))
        return 0
    slurm.scancel(rec.job_id, env=rec.env())
    print(f"cancelled job {rec.job_id}")
    return 0
