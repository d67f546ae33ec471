"""The "hold" stage's readiness step, run inside a cluster job after Ray is up.

``python -m hpc_verl.launch.hold --job-dir DIR``: waits (bounded) until the head's
Ray Jobs API answers *with the job's token*, then writes ``ray/cluster.json``
(address, token file, head, node count, Ray version) atomically. ``hpc-verl
cluster up`` waits for that file, so "ready" means "a submission will work",
not merely "a process started" (``bootstrap.raydir.read_cluster_info`` reads it).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from hpc_verl.errors import HpcVerlError
from hpc_verl.util.fs import atomic_write_json


def jobs_address(head: dict[str, Any]) -> str:
    """The Jobs API URL clients should use: the head's advertised IP when the dashboard
    listens on all interfaces, else the host it was bound to."""
    host = head.get("dashboard_host") or "127.0.0.1"
    if host in ("0.0.0.0", "::", ""):
        host = head["ip"]
    return f"http://{host}:{head['dashboard_port']}"


def wait_ready(job_dir: Path, timeout_s: float) -> dict[str, Any]:
    from hpc_verl.bootstrap.raydir import cluster_info_path, ray_dir as job_ray_dir, token_path
    from hpc_verl.launch.backends import rayjobs_api as rayjobs

    ray_dir = job_ray_dir(job_dir)
    head = json.loads((ray_dir / "head.json").read_text())
    address = jobs_address(head)
    token = token_path(job_dir)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            cluster = rayjobs.connect(address, token, timeout_s=5, env={})
            break
        except rayjobs.RayUnreachableError as exc:  # the dashboard starts after the GCS
            last = exc
            time.sleep(1)
    else:
        raise HpcVerlError(f"Ray Jobs API at {address} did not answer within {timeout_s:g}s ({last})")
    plan = json.loads((ray_dir / "plan.json").read_text())
    info = {"address": address, "token_file": str(token), "head": head.get("node"),
            "gcs_address": head.get("address"), "nodes": plan.get("nodes", []),
            "ray_version": cluster.cluster_version}
    atomic_write_json(cluster_info_path(job_dir), info)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpc_verl.launch.hold")
    p.add_argument("--job-dir", required=True)
    p.add_argument("--timeout-s", type=float, default=120)
    args = p.parse_args(argv)
    try:
        info = wait_ready(Path(args.job_dir), args.timeout_s)
    except (HpcVerlError, OSError, ValueError, KeyError) as exc:
        print(f"hpc_verl.launch.hold: error: {exc}", file=sys.stderr)
        return 1
    print(f"hpc-verl: Ray Jobs API ready at {info['address']} (token file {info['token_file']})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
