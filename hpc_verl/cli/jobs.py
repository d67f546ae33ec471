"""``hpc-verl list | status JOB | logs JOB [--node N] [--follow] | cancel JOB`` (job ops)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="jobs in the registry with their state (SLURM, local or Ray Jobs)")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("status", help="state, nodes, Ray address and ports of a job")
    p.add_argument("job", help="job id (SLURM id, local pid or Ray submission id) or job directory name")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("logs", help="print a job's logs")
    p.add_argument("job")
    p.add_argument("--node", default=None, help="this node's Ray/step log instead of the batch log")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.add_argument("--metrics", nargs="?", type=int, const=10, default=None, metavar="N",
                   help="the trainer's last N steps (default 10) as a table, from the run's metrics.jsonl "
                        "(upstream verl: its step lines in the job's log)")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("cancel", help="cancel a job (its trap stops Ray and containers)")
    p.add_argument("job")
    p.set_defaults(func=cmd_cancel)


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from hpc_verl.launch import backends, registry

    table = Table(title=f"hpc-verl jobs ({registry.jobs_root()})")
    for col in ("job id", "name", "profile", "state", "submitted", "directory"):
        table.add_column(col)
    for rec in registry.all_jobs():
        table.add_row(str(rec.job_id or rec.submission_id or "-"), rec.name, rec.profile,
                      backends.for_record(rec).list_state(rec),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(rec.submitted)), Path(rec.job_dir).name)
    Console(width=200).print(table)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import json

    from hpc_verl.launch import backends, registry

    rec = registry.find(args.job)
    d = backends.for_record(rec).status(rec)
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
    from hpc_verl.launch import backends, registry

    rec = registry.find(args.job)
    if args.metrics is not None:
        from hpc_verl.ops.metrics_table import print_last_steps
        return print_last_steps(rec.run_dir or rec.job_dir, args.metrics, logs=[rec.batch_log])
    return backends.for_record(rec).logs(rec, node=args.node, follow=args.follow)


def cmd_cancel(args: argparse.Namespace) -> int:
    from hpc_verl.launch import backends, registry

    rec = registry.find(args.job)
    print(backends.for_record(rec).cancel(rec))
    return 0
