"""Shared Ray clusters held by a SLURM allocation (``hpc-verl cluster up|down``).

``up`` submits the normal batch script with the "hold" stage in place of train
(partials/hold.sh.j2): Ray comes up with our bootstrap (job-derived ports, the
job's own token, readiness barrier), then the job just keeps it until ``down``
(scancel; the script's EXIT trap stops exactly this job's Ray) or its time
limit. Training jobs go into it through the Ray Jobs API
(``hpc-verl submit --cluster JOB``), each recorded as its own ``rayjob``.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hpc_verl.errors import SubmitError

CLUSTER_ROLE = "cluster"


class ClusterError(SubmitError):
    """A held cluster could not be started, found or stopped."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name} yet)"


def cluster_file(rec: Any) -> Path:
    from hpc_verl.launch.hold import CLUSTER_FILE

    return Path(rec.run_dir or rec.job_dir) / "ray" / CLUSTER_FILE


def up(profile_name: str, nodes: int, sets: Sequence[str] = (), name: str | None = None,
       time_min: int | None = None, wait_timeout_s: float = 600,
       progress: Callable[[str], None] | None = None) -> tuple[Any, dict[str, Any]]:
    """Submit a cluster job and wait (bounded) until its Ray Jobs API answers with its token.

    Returns (registry record, cluster info). A job that ends before that is reported
    with the tail of its batch log; one that is not ready in time is cancelled.
    """
    from hpc_verl.launch import slurm
    from hpc_verl.launch.submit import submit_job

    if nodes < 1:
        raise ClusterError(f"--nodes {nodes}: a cluster needs at least 1 node")
    # a held cluster is not requeued (its jobs would die with it), and needs its dashboard (Jobs API)
    forced = [f"slurm.nodes={nodes}", "slurm.requeue=false", "ray.dashboard=true"]
    if time_min is not None:
        forced.append(f"slurm.time_min={time_min}")
    rec = submit_job(profile_name, None, (), [*sets, *forced], name or "ray-cluster", hold=True)
    say = progress or (lambda _msg: None)
    say(f"cluster job {rec.job_id} submitted ({nodes} node(s), profile {rec.profile})")
    info_file = cluster_file(rec)
    batch_log = Path(rec.batch_log)
    deadline = time.monotonic() + wait_timeout_s
    last_state = None
    while not info_file.exists():
        info = slurm.job_info(rec.job_id, env=rec.env())
        state = info.state if info else "GONE"
        if state != last_state:
            say(f"cluster job {rec.job_id}: {state}" + (" (waiting for Ray)" if state == "RUNNING" else ""))
            last_state = state
        if info is None or info.terminal:
            if info_file.exists():
                break
            raise ClusterError(f"cluster job {rec.job_id} ended ({state}) before Ray came up; see "
                               f"{batch_log}; last lines:\n{_tail(batch_log)}")
        if time.monotonic() > deadline:
            slurm.scancel(rec.job_id, env=rec.env())
            raise ClusterError(f"cluster job {rec.job_id} was not ready within {wait_timeout_s:g}s "
                               f"(state {state}); cancelled it; raise --wait-timeout-s or check "
                               f"{batch_log}")
        time.sleep(1)
    cinfo = json.loads(info_file.read_text())
    rec.ray_address = cinfo["address"]
    rec.token_file = cinfo["token_file"]
    rec.save()
    # The head saw its own Jobs API; check that it is reachable from here too (firewalls, NAT).
    from hpc_verl.launch import rayjobs

    try:
        rayjobs.connect(cinfo["address"], cinfo["token_file"])
    except rayjobs.RayJobsError as exc:
        raise ClusterError(f"cluster job {rec.job_id} is up but not usable from this host: {exc} "
                           f"(it keeps running: 'hpc-verl cluster down {rec.job_id}' stops it)") from None
    return rec, cinfo


def find(ref: str | None = None) -> Any:
    """A cluster record by id/name, or (no ref) the newest one that is still alive."""
    from hpc_verl.launch import registry, slurm

    if ref is not None:
        rec = registry.find(ref)
        if rec.role != CLUSTER_ROLE:
            raise ClusterError(f"job {ref} is not a cluster job (it was submitted with 'hpc-verl submit'); "
                               "'hpc-verl list' shows all jobs")
        return rec
    for rec in reversed(list(registry.all_jobs())):  # newest first: one SLURM query in the usual case
        if rec.role == CLUSTER_ROLE and rec.job_id is not None:
            info = slurm.job_info(rec.job_id, env=rec.env())
            if info is not None and not info.terminal:
                return rec
    raise ClusterError("no running cluster job in the registry; start one with "
                       "'hpc-verl cluster up --profile NAME --nodes N'")


def ready_info(rec: Any) -> dict[str, Any]:
    """The held cluster's address and token file (``ray/cluster.json``), or why it is not ready."""
    path = cluster_file(rec)
    if not path.exists():
        from hpc_verl.launch import slurm

        info = slurm.job_info(rec.job_id, env=rec.env()) if rec.job_id else None
        state = info.state if info else "GONE"
        raise ClusterError(f"cluster job {rec.job_id} has no Ray Jobs API yet (SLURM state {state}); "
                           "wait for 'hpc-verl cluster up' to print the address, or start a new one")
    return json.loads(path.read_text())


def down(ref: str | None = None, wait_timeout_s: float = 120) -> tuple[Any, str]:
    """scancel the cluster job and wait (bounded) until SLURM reports it ended."""
    from hpc_verl.launch import slurm

    rec = find(ref)
    info = slurm.job_info(rec.job_id, env=rec.env())
    if info is None or info.terminal:
        return rec, (info.state if info else "GONE")
    slurm.scancel(rec.job_id, env=rec.env())
    deadline = time.monotonic() + wait_timeout_s
    while True:
        info = slurm.job_info(rec.job_id, env=rec.env())
        if info is None or info.terminal:
            return rec, (info.state if info else "GONE")
        if time.monotonic() > deadline:
            raise ClusterError(f"cluster job {rec.job_id} still {info.state} {wait_timeout_s:g}s after "
                               f"scancel; check 'squeue -j {rec.job_id}' and the nodes' slurmd logs")
        time.sleep(0.5)
