"""The job registry: one directory per submitted job, JSON records, atomic writes.

``$HPC_VERL_HOME/jobs/<name>-<stamp>/`` (default ``~/.local/share/hpc_verl``)
holds ``job.json`` (job id, profile, paths, submit time), ``script.sbatch``,
``profile.json`` (resolved), ``job_config.json``, the batch log
``<name>-<id>.out`` and the run directory ``<name>-<id>/`` (the profile's
``paths.job_root`` points here): ``logs/`` (one ``node-<name>.log`` per node),
``ray/`` (plan, head address, node states; the token file is mode 0600),
``stages/`` (markers). It must be on the shared file system.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from hpc_verl.errors import JobNotFoundError
from hpc_verl.util.fs import atomic_write_json


ROLE_JOB = "job"
ROLE_CLUSTER = "cluster"
"""A held Ray cluster (``hpc-verl cluster up``): a SLURM job whose Ray takes Ray Jobs submissions."""


def home() -> Path:
    env = os.environ.get("HPC_VERL_HOME")
    return Path(env).expanduser() if env else Path.home() / ".local" / "share" / "hpc_verl"


def jobs_root() -> Path:
    return home() / "jobs"


@dataclass
class JobRecord:
    """What the registry knows about one job."""

    name: str
    job_dir: str
    profile: str
    job_id: int | None = None
    submitted: float = field(default_factory=time.time)
    script: str = ""
    log_dir: str = ""
    scheduler: str = "slurm"  # the backend that runs it (a key of hpc_verl.launch.backends.BACKENDS)
    slurm_conf: str | None = None
    nodes: list[str] = field(default_factory=list)
    ports: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False
    run_dir: str = ""      # the job's run directory (HPCV_RUN_DIR): ray/, logs/, stages/, checkpoints
    batch_log: str = ""    # the batch script's output (sbatch --output)
    # Ray Jobs (scheduler "rayjob"): where the driver was sent; the token stays in its file.
    submission_id: str | None = None
    ray_address: str | None = None
    token_file: str | None = None
    role: str = ROLE_JOB  # or ROLE_CLUSTER
    # scheduler "local" (hpc_verl.launch.backends.local): the script's pid, its supervisor's (the owner of
    # the job's processes), where it ran, how it ended, and who stopped it
    pid: int | None = None
    supervisor_pid: int | None = None
    submit_dir: str = ""
    exit_code: int | None = None
    cancelled: bool = False
    stop_reason: str = ""

    def save(self) -> None:
        atomic_write_json(Path(self.job_dir) / "job.json", asdict(self))

    def env(self) -> dict[str, str]:
        """Environment for SLURM clients talking about this job (its cluster's config)."""
        return {"SLURM_CONF": self.slurm_conf} if self.slurm_conf else {}

    def refresh_from_ray(self) -> None:
        """Node list and ports from the job's Ray plan, once the job wrote them."""
        ray = Path(self.run_dir or self.job_dir) / "ray"
        try:
            plan = json.loads((ray / "plan.json").read_text())
            self.nodes = plan.get("nodes", self.nodes)
        except (OSError, ValueError):
            pass
        nodes_dir = ray / "nodes"
        for p in sorted(nodes_dir.glob("*.json")) if nodes_dir.exists() else []:
            try:
                self.ports[p.stem] = json.loads(p.read_text()).get("ports", {})
            except (OSError, ValueError):
                pass


def new_job_dir(name: str) -> Path:
    """A fresh, unique job directory (created, mode 0700: it will hold the Ray token)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = jobs_root() / f"{name}-{stamp}-{secrets.token_hex(3)}"
    path.mkdir(parents=True, exist_ok=False)
    os.chmod(path, 0o700)
    (path / "logs").mkdir()
    return path


def load(job_dir: str | os.PathLike[str]) -> JobRecord:
    data = json.loads((Path(job_dir) / "job.json").read_text())
    known = {k: v for k, v in data.items() if k in JobRecord.__dataclass_fields__}
    return JobRecord(**known)


def all_jobs() -> Iterator[JobRecord]:
    root = jobs_root()
    if not root.exists():
        return
    for d in sorted(root.iterdir(), key=lambda p: p.stat().st_mtime):
        if (d / "job.json").exists():
            try:
                yield load(d)
            except (OSError, ValueError, TypeError):
                continue


def find(ref: str) -> JobRecord:
    """A job by SLURM id, Ray submission id, directory name, or path."""
    ref = str(ref)
    if os.path.isdir(ref) and os.path.exists(os.path.join(ref, "job.json")):
        return load(ref)
    matches = [j for j in all_jobs()
               if str(j.job_id) == ref or Path(j.job_dir).name == ref or j.submission_id == ref]
    if not matches:
        raise JobNotFoundError(f"job '{ref}' is not in the registry ({jobs_root()}); "
                               "see 'hpc-verl list' for known jobs")
    return matches[-1]


def find_cluster(ref: str) -> JobRecord:
    """A held cluster's record by id or name (a job that is not one is refused in one line)."""
    rec = find(ref)
    if rec.role != ROLE_CLUSTER:
        raise JobNotFoundError(f"job {ref} is not a cluster job (it was submitted with 'hpc-verl submit'); "
                               "'hpc-verl list' shows all jobs, 'hpc-verl cluster up' starts a cluster")
    return rec
