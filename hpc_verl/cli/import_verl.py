"""``hpc-verl import-verl RUN.sh [-o JOB.yaml]``: a verl launch script to a job config (read, never run)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any


HELP = "turn a verl launch script (run_*.sh) into a job config, without running it"
DESCRIPTION = ("Read a verl launch script and write the job config its 'python3 -m verl.trainer.main_ppo' "
               "command asks for: the variables the script sets (and the environment) are followed with a "
               "shell parser; the script is never executed. A value that cannot be known without running "
               "something (a command substitution, an unset variable) is named in one line each and left "
               "out. Set a variable in the environment to choose it, e.g. DEVICE=gpu hpc-verl import-verl "
               "run.sh.")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("import-verl", help=HELP, description=DESCRIPTION)
    parser.add_argument("script", metavar="RUN.sh", help="the verl launch script")
    parser.add_argument("-o", "--output", metavar="JOB.yaml", help="write the job config here (atomically); "
                        "default: stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from hpc_verl.launch.spec.import_verl import import_script
    from hpc_verl.launch.spec.jobconfig import job_from_dict

    result = import_script(args.script, os.environ)
    job_from_dict(result.job, f"imported from {args.script}")  # the same checks as a job file
    header = [f"# imported by 'hpc-verl import-verl {args.script}'"]
    header += [f"# left out: {line}" for line in result.problems]
    text = "\n".join(header) + "\n" + yaml.safe_dump(result.job, sort_keys=False, width=10**6)
    for line in result.notes:
        print(f"hpc-verl: note: {line}", file=sys.stderr)
    for line in result.problems:
        print(f"hpc-verl: warning: {line}", file=sys.stderr)
    if args.output:
        from hpc_verl.errors import ConfigError
        from hpc_verl.util.fs import atomic_write_text

        try:
            path = atomic_write_text(args.output, text)
        except OSError as exc:
            raise ConfigError(f"cannot write {args.output}: {exc.strerror or exc}; choose another -o path") from None
        print(f"wrote {path}; submit it with: hpc-verl submit --profile NAME --config {path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
