"""Shared Ray clusters held by a SLURM allocation (``hpc-verl cluster up|down``).

``up`` submits the normal batch script with the "hold" stage in place of train
(partials/hold.sh.j2): Ray comes up with our bootstrap (job-derived ports, the
job's own token, readiness barrier), then the job just keeps it until ``down``
(scancel; the script's EXIT trap stops exactly this job's Ray) or its time
limit. Training jobs go into it through the Ray Jobs API
(``hpc-verl submit --cluster JOB``), each recorded as its own ``rayjob``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from hpc_verl.errors import SubmitError
from hpc_verl.launch import backends, registry
from hpc_verl.launch.backends.base import SubmitRequest
from hpc_verl.bootstrap.raydir import cluster_info_path, read_cluster_info


class ClusterError(SubmitError):
    """A held cluster could not be started, found or stopped."""


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path.name} yet)"


def up(profile_name: str, nodes: int, sets: Sequence[str] = (), name: str | None = None,
       time_min: int | None = None, wait_timeout_s: float = 600,
       progress: Callable[[str], None] | None = None) -> tuple[Any, dict[str, Any]]:
    """Submit a cluster job and wait (bounded) until its Ray Jobs API answers with its token.

    Returns (registry record, cluster info). A job that ends before that is reported
    with the tail of its batch log; one that is not ready in time is cancelled.
    """
    if nodes < 1:
        raise ClusterError(f"--nodes {nodes}: a cluster needs at least 1 node")
    # a held cluster is not requeued (its jobs would die with it), and needs its dashboard (Jobs API)
    forced = [f"slurm.nodes={nodes}", "slurm.requeue=false", "ray.dashboard=true"]
    if time_min is not None:
        forced.append(f"slurm.time_min={time_min}")
    slurm = backends.get("slurm")
    request = SubmitRequest(profile=profile_name, sets=(*sets, *forced), name=name or "ray-cluster", hold=True)
    rec = slurm.submit(slurm.dryrun(request))
    say = progress or (lambda _msg: None)
    say(f"cluster job {rec.job_id} submitted ({nodes} node(s), profile {rec.profile})")
    batch_log = Path(rec.batch_log)
    deadline = time.monotonic() + wait_timeout_s
    last_state = None
    while (cinfo := read_cluster_info(rec.run_dir)) is None:
        info = slurm.describe(rec)
        if info.state != last_state:
            say(f"cluster job {rec.job_id}: {info.label}" + (" (waiting for Ray)" if info.state == "RUNNING" else ""))
            last_state = info.state
        if info.terminal:
            if cluster_info_path(rec.run_dir).exists():
                continue
            raise ClusterError(f"cluster job {rec.job_id} ended ({info.label}) before Ray came up; see "
                               f"{batch_log}; last lines:\n{_tail(batch_log)}")
        if time.monotonic() > deadline:
            slurm.cancel(rec)
            raise ClusterError(f"cluster job {rec.job_id} was not ready within {wait_timeout_s:g}s "
                               f"(state {info.label}); cancelled it; raise --wait-timeout-s or check "
                               f"{batch_log}")
        time.sleep(1)
    rec.ray_address = cinfo["address"]
    rec.token_file = cinfo["token_file"]
    rec.save()
    # The head saw its own Jobs API; check that it is reachable from here too (firewalls, NAT).
    from hpc_verl.launch.backends import rayjobs_api as rayjobs

    try:
        rayjobs.connect(cinfo["address"], cinfo["token_file"])
    except rayjobs.RayJobsError as exc:
        raise ClusterError(f"cluster job {rec.job_id} is up but not usable from this host: {exc} "
                           f"(it keeps running: 'hpc-verl cluster down {rec.job_id}' stops it)") from None
    return rec, cinfo


def find(ref: str | None = None) -> Any:
    """A cluster record by id/name, or (no ref) the newest one that is still alive."""
    if ref is not None:
        return registry.find_cluster(ref)
    for rec in reversed(list(registry.all_jobs())):  # newest first: one SLURM query in the usual case
        if rec.role == registry.ROLE_CLUSTER and rec.job_id is not None:
            if not backends.for_record(rec).describe(rec).terminal:
                return rec
    raise ClusterError("no running cluster job in the registry; start one with "
                       "'hpc-verl cluster up --profile NAME --nodes N'")


def down(ref: str | None = None, wait_timeout_s: float = 120) -> tuple[Any, str]:
    """Cancel the cluster job and wait (bounded) until its backend reports it ended."""
    rec = find(ref)
    backend = backends.for_record(rec)
    info = backend.describe(rec)
    if info.terminal:
        return rec, info.label
    backend.cancel(rec)
    deadline = time.monotonic() + wait_timeout_s
    while True:
        info = backend.describe(rec)
        if info.terminal:
            return rec, info.label
        if time.monotonic() > deadline:
            raise ClusterError(f"cluster job {rec.job_id} still {info.label} {wait_timeout_s:g}s after "
                               f"scancel; check 'squeue -j {rec.job_id}' and the nodes' slurmd logs")
        time.sleep(0.5)
