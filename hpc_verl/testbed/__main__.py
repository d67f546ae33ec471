"""``python -m hpc_verl.testbed up|down|status|env [--dir DIR] [--nodes N]`` (used by scripts/testbed.sh).

``up`` also builds the node image, starts the bed's Docker daemon and writes the bed's profiles
(:mod:`hpc_verl.testbed.provision`; ``--no-images``: the SLURM daemons only); ``env`` prints the
exports that reach them."""
from __future__ import annotations

import argparse
import json
import os
import shlex
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
    parser.add_argument("--no-images", action="store_true",
                        help="(up) only the SLURM daemons: no image, Docker daemon or container profiles")
    args = parser.parse_args(argv)
    try:
        bed = TestBed(args.dir or default_dir(), args.nodes)
        if args.action == "up":
            bed.up()
            from hpc_verl.testbed import provision as prov

            if args.no_images:
                from hpc_verl.testbed.profiles import write_profiles

                write_profiles(prov.profile_dir(bed), temp_root=prov.TEMP_ROOT, readiness_timeout_s=90)
            else:
                prov.provision(bed, say=lambda line: print(line, file=sys.stderr, flush=True))
            print(f"test bed up in {bed.dir} ({len(bed.nodes)} nodes); use: "
                  f"eval \"$(bash scripts/testbed.sh env)\"")
        elif args.action == "down":
            from hpc_verl.testbed.provision import unprovision

            unprovision(bed)
            bed.down()
            print(f"test bed in {bed.dir} is down")
        elif args.action == "env":
            from hpc_verl.testbed.provision import profile_dir

            print(f"export SLURM_CONF={shlex.quote(str(bed.conf))}")
            print(f"export HPC_VERL_PROFILE_PATH={shlex.quote(str(profile_dir(bed)))}")
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
