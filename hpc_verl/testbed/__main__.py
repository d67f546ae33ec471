"""``python -m hpc_verl.testbed up|down|status|env [--dir DIR] [--nodes N]`` (used by scripts/testbed.sh)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from hpc_verl.errors import HpcVerlError
from hpc_verl.testbed.cluster import MAX_NODES, TestBed


def default_dir() -> str:
    """Where the person-run test bed lives unless ``--dir``/``$HPC_VERL_TESTBED_DIR`` says."""
    return os.environ.get("HPC_VERL_TESTBED_DIR") or os.path.join(
        tempfile.gettempdir(), f"hpc_verl-testbed-{os.getuid()}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_verl.testbed")
    parser.add_argument("action", choices=("up", "down", "status", "env", "image"))
    parser.add_argument("--dir", default=None, help="test bed directory (default: %(default)s)")
    parser.add_argument("--nodes", type=int, default=None,
                        help=f"(up) SLURM nodes, 1..{MAX_NODES} (default: the bed's current size, else 2)")
    args = parser.parse_args(argv)
    try:
        bed = TestBed(args.dir or default_dir(), args.nodes)
        if args.action == "up":
            bed.up()
            print(f"test bed up in {bed.dir} ({len(bed.nodes)} nodes); use: export SLURM_CONF={bed.conf}")
        elif args.action == "down":
            bed.down()
            print(f"test bed in {bed.dir} is down")
        elif args.action == "env":
            print(f"export SLURM_CONF={bed.conf}")
        elif args.action == "image":
            from hpc_verl.testbed.image import build_image

            print(build_image())
        else:
            print(json.dumps(bed.status(), indent=2))
    except HpcVerlError as exc:
        print(f"testbed: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
