"""``hpc-verl attach JOB [--node N] [-- CMD ...]``: a shell or a command inside a running job."""
from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("attach", help="a shell (or CMD) inside a running job's container, with its environment "
                       "(RAY_ADDRESS, token)",
                       description="Open an interactive shell, or run CMD, inside a running job: in the "
                       "container of its head node (or of node N) with the job's environment, RAY_ADDRESS and "
                       "Ray token included. SLURM jobs: through 'srun --overlap --jobid' and the container "
                       "runtime's exec; local jobs: on this machine. Ray jobs have nothing to attach to.")
    p.add_argument("job", help="job id or job directory name (as for 'hpc-verl status')")
    p.add_argument("--node", default=None, metavar="N",
                   help="node index (0 = head, the default) or node name")
    p.add_argument("command", nargs="*", metavar="-- CMD",
                   help="the command to run instead of a shell, after '--' (e.g. -- ray status)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hpc_verl.launch import backends, registry

    rec = registry.find(args.job)
    return backends.for_record(rec).attach(rec, node=args.node, command=args.command)
