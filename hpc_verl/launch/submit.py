"""Submission: job directory + rendered script + registry record + ``sbatch --parsable``.

``submit_job`` is what ``hpc-verl submit`` runs; ``submit`` (exported as
``hpc_verl.submit``) does the same through submitit and returns a submitit ``Job``
whose function runs our rendered batch script once on the first node of the
allocation (``use_srun=False``), so the Ray bootstrap is the same code path.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from hpc_verl.errors import ConfigError, SubmitError
from hpc_verl.launch import registry, slurm
from hpc_verl.util.fs import atomic_write_json, atomic_write_text


def _load_profile(name: str, sets: Sequence[str]) -> Any:
    from hpc_verl.profiles import load_profile

    return load_profile(name, list(sets))


@dataclasses.dataclass
class _Trainer:
    module: str = "hpc_verl.trainer.main"
    args: list = dataclasses.field(default_factory=list)
    overrides: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Data:
    preprocess_module: str | None = None
    preprocess_args: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _MiniJob:
    """Stand-in for the launcher's JobConfig until it lands: name + trainer module/args."""

    name: str = "hpcv"
    trainer: _Trainer = dataclasses.field(default_factory=_Trainer)
    data: _Data = dataclasses.field(default_factory=_Data)

    def trainer_override_args(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.trainer.overrides.items()]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _job_config(config: str | None, overrides: Sequence[str]) -> Any:
    try:
        from hpc_verl.launch.jobconfig import load_job_config
    except ImportError:
        load_job_config = None
    if load_job_config is not None:
        return load_job_config(config, list(overrides))
    import yaml

    data = yaml.safe_load(Path(config).read_text()) if config else {}
    tr = data.get("trainer", {}) or {}
    job = _MiniJob(name=data.get("name", "hpcv"), trainer=_Trainer(tr.get("module", _Trainer.module),
                                                                     list(tr.get("args", [])),
                                                                     dict(tr.get("overrides", {}))),
                   data=_Data(**(data.get("data") or {})))
    for o in overrides:
        if "=" not in o:
            raise ConfigError(f"override {o!r}: expected key=value, e.g. trainer.total_epochs=2")
        k, v = o.split("=", 1)
        job.trainer.overrides[k] = v
    return job


def _train_command(job: Any) -> list[str]:
    return ["-m", job.trainer.module, *job.trainer.args, *job.trainer_override_args()]


def _pre_stages(job: Any) -> list[dict[str, Any]]:
    """Stages before Ray, each skipped by a requeued run once its marker exists."""
    data = getattr(job, "data", None)
    module = getattr(data, "preprocess_module", None) if data is not None else None
    if not module or (hasattr(data, "raw") and not data.raw and module == "hpc_verl.data.preprocess"):
        return []  # nothing to preprocess (the launcher's default job has no raw data)
    return [{"name": "preprocess", "command": ["hpcv_tool", "-m", module, *data.preprocess_args]}]


def prepare(profile_name: str, config: str | None = None, overrides: Sequence[str] = (),
            sets: Sequence[str] = (), name: str | None = None, hold: bool = False) -> registry.JobRecord:
    """Everything but the submission: job dir, rendered script, resolved profile and config.

    ``hold``: a cluster job (``hpc-verl cluster up``) that keeps Ray up instead of training."""
    from hpc_verl.launch.script import render_minimal

    profile = _load_profile(profile_name, sets)
    if profile.scheduler != "slurm":
        raise ConfigError(f"profile {profile.name} uses scheduler '{profile.scheduler}'; "
                          "'hpc-verl submit' needs a SLURM profile (use 'hpc-verl run' for local)")
    job = _job_config(config, overrides)
    job_name = name or job.name
    job_dir = registry.new_job_dir(job_name)
    script = render_minimal(profile, job_dir=str(job_dir), submit_dir=os.getcwd(), job_name=job_name,
                            train_command=_train_command(job), pre_stages=[] if hold else _pre_stages(job),
                            env=dict(profile.env.vars), hold=hold)
    script_path = job_dir / "script.sbatch"
    atomic_write_text(script_path, script, mode=0o700)
    atomic_write_json(job_dir / "profile.json", profile.to_dict())
    atomic_write_json(job_dir / "job_config.json", job.to_dict())
    rec = registry.JobRecord(name=job_name, job_dir=str(job_dir), profile=profile.name, script=str(script_path),
                             log_dir=str(job_dir / "logs"), slurm_conf=os.environ.get("SLURM_CONF"),
                             nodes=[], dry_run=True)
    rec.save()
    return rec


def submit_job(profile_name: str, config: str | None = None, overrides: Sequence[str] = (),
               sets: Sequence[str] = (), name: str | None = None, dry_run: bool = False,
               hold: bool = False) -> registry.JobRecord:
    """Prepare, then ``sbatch --parsable`` (unless ``dry_run``) and record the job id."""
    rec = prepare(profile_name, config, overrides, sets, name, hold=hold)
    if hold:
        rec.role = "cluster"
        rec.save()
    if dry_run:
        return rec
    rec.job_id = slurm.sbatch(rec.script, extra_args=[f"--chdir={rec.job_dir}"])
    rec.dry_run = False
    rec.save()
    return rec


# ---------------------------------------------------------------------------- submitit
def run_batch_script(script: str) -> dict[str, Any]:
    """Runs inside the submitit job on the first node: our batch script, once."""
    proc = subprocess.run(["bash", script], stdout=sys.stdout, stderr=sys.stderr)
    job_dir = Path(script).parent
    head = {}
    try:
        head = json.loads((job_dir / "ray" / "head.json").read_text())
    except (OSError, ValueError):
        pass
    if proc.returncode != 0:
        raise SubmitError(f"batch script {script} exited {proc.returncode}; see {job_dir}/logs")
    result_file = job_dir / "result.json"
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    return {"exit_code": proc.returncode, "ray_address": head.get("address"), "result": result}


def submit(profile: str | None = None, config: str | None = None, overrides: Sequence[str] = (),
           sets: Sequence[str] = (), name: str | None = None, *, ray_address: str | None = None,
           ray_token_file: str | None = None) -> Any:
    """Submit through submitit; returns a ``submitit.Job`` (state, result(), stdout(), cancel()).

    With ``ray_address`` the job goes to that running Ray cluster through the Jobs
    API instead, and the return value is a ``RayJobHandle`` (state, logs(), wait(), stop()).
    """
    if ray_address:
        from hpc_verl.launch import rayjobs_ops

        handle, _rec = rayjobs_ops.submit_to_registry(profile, config, overrides, sets, name,
                                                      ray_address=ray_address, token_file=ray_token_file)
        return handle
    if not profile:
        raise ConfigError("submit() needs a profile name (or ray_address=... for a running Ray cluster)")
    import submitit

    rec = prepare(profile, config, overrides, sets, name)
    prof = json.loads((Path(rec.job_dir) / "profile.json").read_text())
    s = prof["slurm"]
    ex = submitit.SlurmExecutor(folder=str(Path(rec.job_dir) / "submitit"), max_num_timeout=0)
    params: dict[str, Any] = dict(nodes=s["nodes"], ntasks_per_node=1, cpus_per_task=s["cpus_per_task"],
                                  time=s["time_min"], job_name=rec.name, use_srun=False,
                                  additional_parameters={"chdir": rec.job_dir})
    if s.get("gpus_per_node"):
        params["gpus_per_node"] = s["gpus_per_node"]
    if s.get("partition"):
        params["partition"] = s["partition"]
    ex.update_parameters(**params)
    job = ex.submit(run_batch_script, rec.script)
    rec.job_id = int(job.job_id)
    rec.dry_run = False
    rec.scheduler = "submitit"
    rec.save()
    return job
