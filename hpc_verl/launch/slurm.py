"""The one place that runs SLURM commands (sbatch, squeue, scontrol, scancel).

Everything else asks this module. State comes from ``squeue`` while the job is in
the queue and from ``scontrol show job`` after it left (sites without
accounting, such as the test bed, have no ``sacct``).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Mapping

from hpc_verl.errors import SubmitError
from hpc_verl.launch.jobinfo import JobInfo

_KV_RE = re.compile(r"(\b[A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_:/]*=|$)")


def _run(cmd: list[str], env: Mapping[str, str] | None = None, timeout_s: float = 60,
         check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise SubmitError(f"'{cmd[0]}' not found on PATH; run hpc-verl on a SLURM login node "
                          "(or install slurm-wlm; see scripts/setup.sh)")
    import os

    full_env = {**os.environ, **(env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=full_env)
    except subprocess.TimeoutExpired:
        raise SubmitError(f"'{' '.join(cmd[:3])}' did not answer within {timeout_s:.0f}s; is slurmctld up?") \
            from None
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise SubmitError(f"'{' '.join(cmd[:2])}' failed: {msg[-1] if msg else 'exit ' + str(proc.returncode)}")
    return proc


def sbatch(script: str, extra_args: list[str] | None = None, env: Mapping[str, str] | None = None,
           cwd_arg: str | None = None) -> int:
    """Submit ``script`` with ``sbatch --parsable``; returns the job id."""
    cmd = ["sbatch", "--parsable", *(extra_args or [])]
    if cwd_arg:
        cmd.append(f"--chdir={cwd_arg}")
    proc = _run([*cmd, script], env=env)
    first = proc.stdout.strip().split(";")[0]
    if not first.isdigit():
        raise SubmitError(f"sbatch returned {proc.stdout.strip()!r}, not a job id")
    return int(first)


def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output -> key/value dict (values may contain spaces)."""
    return {m.group(1): m.group(2).strip() for m in _KV_RE.finditer(text.strip())}


def scontrol_job(job_id: int, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    proc = _run(["scontrol", "show", "job", "-o", str(job_id)], env=env, check=False, timeout_s=30)
    if proc.returncode != 0 or "JobId=" not in proc.stdout:
        return None
    return parse_scontrol(proc.stdout.splitlines()[0])


def job_info(job_id: int, env: Mapping[str, str] | None = None) -> JobInfo | None:
    """State from squeue, falling back to scontrol; None when SLURM has forgotten the job."""
    proc = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N"], env=env, check=False, timeout_s=30)
    line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
    sc = scontrol_job(job_id, env=env)
    if line:
        state, reason, nodes = (line.split("|") + ["", ""])[:3]
        info = JobInfo(state, reason, nodes, source="squeue", job_id=job_id)
    elif sc:
        info = JobInfo(sc.get("JobState", "UNKNOWN"), sc.get("Reason", ""), sc.get("NodeList", ""),
                       source="scontrol", job_id=job_id)
    else:
        return None
    if sc:
        info.raw = sc
        info.exit_code = sc.get("ExitCode", "")
        info.restarts = int(sc.get("Restarts", "0") or 0)
        if not info.nodes or info.nodes == "(null)":
            info.nodes = sc.get("NodeList", "")
    return info


def list_queue(user: str | None = None, env: Mapping[str, str] | None = None) -> dict[int, str]:
    cmd = ["squeue", "-h", "-o", "%i|%T"] + (["-u", user] if user else [])
    proc = _run(cmd, env=env, check=False)
    out = {}
    for line in proc.stdout.splitlines():
        jid, _, state = line.partition("|")
        if jid.isdigit():
            out[int(jid)] = state
    return out


def scancel(job_id: int, signal: str | None = None, batch_only: bool = False,
            env: Mapping[str, str] | None = None) -> None:
    """Cancel a job, or send it ``signal`` (``batch_only``: to the batch shell, like ``--signal=B:``)."""
    cmd = ["scancel"]
    if signal:
        cmd.append(f"--signal={signal}")
    if batch_only:
        cmd.append("--batch")
    _run([*cmd, str(job_id)], env=env)


def release_requeued(job_id: int, env: Mapping[str, str] | None = None) -> None:
    """Let a requeued job start now instead of after SLURM's requeue delay (BeginTime)."""
    _run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], env=env)
