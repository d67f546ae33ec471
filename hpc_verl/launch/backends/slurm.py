"""The SLURM backend, and the one place that runs SLURM commands (sbatch, squeue, scontrol, scancel).

``SlurmBackend`` submits the rendered script with ``sbatch --parsable``;
``SubmititBackend`` (``hpc_verl.submit``) submits it through submitit, which
returns a ``submitit.Job``. State comes from ``squeue`` while the job is in the
queue and from ``scontrol show job`` after it left (sites without accounting,
such as the test bed, have no ``sacct``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping

from hpc_verl.errors import SubmitError
from hpc_verl.launch import registry
from hpc_verl.launch.backends.base import DryRun, JobInfo, JobState, SubmitRequest
from hpc_verl.launch.backends.script import ScriptBackend, set_run_paths
from hpc_verl.launch.registry import JobRecord

_KV_RE = re.compile(r"(\b[A-Za-z][A-Za-z0-9_:/]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_:/]*=|$)")


def _run(cmd: list[str], env: Mapping[str, str] | None = None, timeout_s: float = 60,
         check: bool = True) -> subprocess.CompletedProcess:
    if shutil.which(cmd[0]) is None:
        raise SubmitError(f"'{cmd[0]}' not found on PATH; run hpc-verl on a SLURM login node "
                          "(or install slurm-wlm; see scripts/setup.sh)")
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
        info = JobInfo(JobState.of(state), reason, nodes, source="squeue", job_id=job_id, native=state)
    elif sc:
        state = sc.get("JobState", "UNKNOWN")
        info = JobInfo(JobState.of(state), sc.get("Reason", ""), sc.get("NodeList", ""), source="scontrol",
                       job_id=job_id, native=state)
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


def srun_in_job(job_id: int, node: str, argv: list[str], *, pty: bool = False,
                extra: list[str] | None = None) -> list[str]:
    """The ``srun`` line that runs ``argv`` as one more task on ``node`` of a running job, beside its
    own steps (``--overlap``: it shares their CPUs, memory and GPUs instead of waiting for them)."""
    if shutil.which("srun") is None:
        raise SubmitError("'srun' not found on PATH; run hpc-verl on a SLURM login node "
                          "(or install slurm-wlm; see scripts/setup.sh)")
    return ["srun", "--overlap", f"--jobid={job_id}", "--nodes=1", "--ntasks=1", f"--nodelist={node}",
            *(["--pty"] if pty else []), *(extra or []), *argv]


def release_requeued(job_id: int, env: Mapping[str, str] | None = None) -> None:
    """Let a requeued job start now instead of after SLURM's requeue delay (BeginTime)."""
    _run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], env=env)


# ---------------------------------------------------------------------------- the backend
class SlurmBackend(ScriptBackend):
    """Jobs of ``scheduler: slurm`` profiles, submitted with ``sbatch``."""

    scheduler = "slurm"
    runs_profiles = "slurm"
    holds_clusters = True

    def by_hand(self, record: JobRecord) -> str:
        return f"sbatch {record.script}"

    def submit(self, dry: DryRun) -> JobRecord:
        set_run_paths(dry.record, sbatch(dry.record.script, env=dry.record.env()))
        return dry.record

    def _describe(self, record: JobRecord) -> JobInfo:
        info = job_info(record.job_id, env=record.env())
        if info is None:
            return JobInfo(JobState.GONE, reason="SLURM no longer knows the job (its record expired)",
                           source="scontrol", job_id=record.job_id)
        return info

    def _cancel(self, record: JobRecord) -> str:
        scancel(record.job_id, env=record.env())
        return f"cancelled job {record.job_id}"

    def attach_command(self, record: JobRecord, node: str, script: Path, command: list[str],
                       tty: bool) -> list[str]:
        """The attach script as a task of the job on ``node`` (with a pseudo-terminal when we have
        one), plus the srun options the job asks for (pyxis: its container's name)."""
        extra = subprocess.run(["bash", str(script), "--srun-args"], capture_output=True, text=True,
                               timeout=30).stdout.split("\0")
        return srun_in_job(record.job_id, node, ["bash", str(script), *command], pty=tty,
                           extra=[a for a in extra if a])


class SubmititBackend(SlurmBackend):
    """SLURM through submitit (the Python API ``hpc_verl.submit``): the same script, run once by a
    submitit job on the first node of the allocation (``use_srun=False``), so the Ray bootstrap is the
    same code path. Registered jobs are then operated like any SLURM job."""

    scheduler = "submitit"

    def accepts(self, request: SubmitRequest) -> bool:
        return False  # chosen by the Python API, never for `hpc-verl submit`

    def submit(self, dry: DryRun) -> JobRecord:
        return self.submit_job(dry)[0]

    def submit_job(self, dry: DryRun) -> tuple[JobRecord, Any]:
        """Submit; returns (record, ``submitit.Job``: state, result(), stdout(), cancel())."""
        import submitit

        rec = dry.record
        s = json.loads((Path(rec.job_dir) / "profile.json").read_text())["slurm"]
        ex = submitit.SlurmExecutor(folder=str(Path(rec.job_dir) / "submitit"), max_num_timeout=0)
        # submitit's own task count stays 1 (our script runs once, on the first node, and srun's the
        # Ray nodes itself); the allocation still gets every node through --nodes.
        params: dict[str, Any] = dict(nodes=1, ntasks_per_node=1, cpus_per_task=s["cpus_per_task"],
                                      time=s["time_min"], job_name=rec.name, use_srun=False,
                                      additional_parameters={"chdir": rec.job_dir, "nodes": s["nodes"]})
        if s.get("gpus_per_node"):
            params["gpus_per_node"] = s["gpus_per_node"]
        if s.get("partition"):
            params["partition"] = s["partition"]
        ex.update_parameters(**params)
        job = ex.submit(run_batch_script, rec.script)
        set_run_paths(rec, int(job.job_id), batch_log=str(job.paths.stdout).replace("%j", str(job.job_id)))
        return rec, job


def run_batch_script(script: str) -> dict[str, Any]:
    """Runs inside the submitit job on the first node: our batch script, once."""
    proc = subprocess.run(["bash", script], stdout=sys.stdout, stderr=sys.stderr)
    job_dir = Path(script).parent
    rec = registry.load(job_dir)
    run_dir = job_dir / f"{rec.name}-{os.environ.get('SLURM_JOB_ID', '')}"
    head = {}
    try:
        head = json.loads((run_dir / "ray" / "head.json").read_text())
    except (OSError, ValueError):
        pass
    if proc.returncode != 0:
        raise SubmitError(f"batch script {script} exited {proc.returncode}; see {run_dir}/logs")
    result_file = run_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    return {"exit_code": proc.returncode, "ray_address": head.get("address"), "result": result}
