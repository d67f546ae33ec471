"""A job's Ray directory: the plan written once by the batch script, and what the nodes report.

``<job_dir>/ray/`` (on the shared file system, mode 0700) holds:
``plan.json`` (nodes, head, node slots, port layout, options), ``token`` (the
job's Ray auth token, mode 0600), ``head.json`` (the head's address, written when
its GCS answers), ``nodes/<node>.json`` (each node's state, ports, pid, errors),
``env.sh`` (``RAY_ADDRESS`` and auth variables for the driver) and, in a cluster
job (``hpc-verl cluster up``), ``cluster.json`` (its Ray Jobs address and token
file, written by ``launch.hold`` once a submission would work).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from hpc_verl.bootstrap.hostlist import job_hostnames
from hpc_verl.errors import BootstrapError
from hpc_verl.util.fs import atomic_write_json, atomic_write_text
from hpc_verl.util.rayready import TOKEN_FILE_NAME, auth_env


def ray_dir(job_dir: str | os.PathLike[str]) -> Path:
    return Path(job_dir) / "ray"


def cluster_info_path(job_dir: str | os.PathLike[str]) -> Path:
    return ray_dir(job_dir) / "cluster.json"


def read_cluster_info(job_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A cluster job's Ray Jobs address, token file, nodes and Ray version; None until it is ready."""
    try:
        return json.loads(cluster_info_path(job_dir).read_text())
    except FileNotFoundError:
        return None


def token_path(job_dir: str | os.PathLike[str]) -> Path:
    return ray_dir(job_dir) / TOKEN_FILE_NAME


def make_token(job_dir: str | os.PathLike[str]) -> Path:
    """Create the job's Ray token (mode 0600) once; a requeued run gets a fresh one."""
    path = token_path(job_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    atomic_write_text(path, secrets.token_hex(32), mode=0o600)
    return path


def ray_env(job_dir: str | os.PathLike[str]) -> dict[str, str]:
    """Variables every Ray process of this job needs (token auth, no usage stats)."""
    return {**auth_env(ray_dir(job_dir)), "RAY_USAGE_STATS_ENABLED": "0"}


def parse_node_hosts(text: str) -> dict[str, str]:
    """``"node1=vm,node2=vm"`` -> {node: host}; empty entries ignored."""
    out = {}
    for item in text.split(","):
        node, sep, host = item.strip().partition("=")
        if sep and node and host:
            out[node] = host
    return out


def node_slots(nodes: list[str], known_hosts: dict[str, str] | None = None) -> tuple[dict[str, int], int]:
    """Node -> sub-slot among this job's nodes on the same host, and the max per host.

    On a real cluster every node is its own host (all slots 0, one per host); on
    the test bed two SLURM nodes share one machine and need distinct ports.
    """
    hosts: dict[str, str] = {n: n for n in nodes}
    if known_hosts:
        hosts.update({n: h for n, h in known_hosts.items() if n in hosts})
    elif shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "node", "-o", ",".join(nodes)],
                                 capture_output=True, text=True, timeout=20).stdout
            for line in out.splitlines():
                fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
                if fields.get("NodeName") in hosts and fields.get("NodeHostName"):
                    hosts[fields["NodeName"]] = fields["NodeHostName"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    slots: dict[str, int] = {}
    per_host: dict[str, int] = {}
    for n in nodes:
        slots[n] = per_host.get(hosts[n], 0)
        per_host[hosts[n]] = slots[n] + 1
    return slots, max(per_host.values(), default=1)


def write_plan(job_dir: str, job_id: int, nodelist: str, *, gpus_per_node: int, num_cpus: int | None,
               port_base: int, port_stride: int, port_slots: int, interface: str | None,
               allow_loopback: bool, temp_dir_root: str, dashboard: bool, dashboard_host: str,
               timeout_s: float, python: str, node_hosts: str = "", client_server: bool = False) -> dict[str, Any]:
    """Expand the node list, create the token and write ``plan.json``; returns the plan."""
    nodes = job_hostnames(nodelist)
    if not nodes:
        raise BootstrapError(f"empty node list {nodelist!r}; is SLURM_JOB_NODELIST set?")
    slots, per_host = node_slots(nodes, parse_node_hosts(node_hosts))
    rdir = ray_dir(job_dir)
    for stale in ("head.json", "env.sh", "nodes", "stop"):  # a requeued run starts clean
        p = rdir / stale
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    (rdir / "nodes").mkdir(parents=True, exist_ok=True)
    make_token(job_dir)
    plan = {"job_id": job_id, "job_dir": str(Path(job_dir).resolve()), "nodes": nodes, "head": nodes[0],
            "node_slots": slots, "nodes_per_host": per_host, "gpus_per_node": gpus_per_node,
            "num_cpus": num_cpus, "layout": {"port_base": port_base, "port_stride": port_stride,
                                             "port_slots": port_slots},
            "interface": interface, "allow_loopback": allow_loopback, "temp_dir_root": temp_dir_root,
            "dashboard": dashboard, "dashboard_host": dashboard_host, "client_server": client_server,
            "timeout_s": timeout_s,
            "python": python, "created": time.time()}
    atomic_write_json(rdir / "plan.json", plan)
    return plan


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_plan(job_dir: str | os.PathLike[str]) -> dict[str, Any]:
    plan = read_json(ray_dir(job_dir) / "plan.json")
    if plan is None:
        raise BootstrapError(f"{ray_dir(job_dir)}/plan.json missing or unreadable; run "
                             "'python3 -m hpc_verl.bootstrap plan' in the batch script first")
    return plan


def write_node_state(job_dir: str | os.PathLike[str], node_name: str, **state: Any) -> None:
    path = ray_dir(job_dir) / "nodes" / f"{node_name}.json"
    old = read_json(path) or {}
    old.update(state, updated=time.time())
    atomic_write_json(path, old)


def node_states(job_dir: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for p in sorted((ray_dir(job_dir) / "nodes").glob("*.json")):
        data = read_json(p)
        if data is not None:
            out[p.stem] = data
    return out
