"""Submission: job directory + rendered script + registry record + ``sbatch --parsable``.

``submit_job`` is what ``hpc-verl submit`` runs; ``submit`` (exported as
``hpc_verl.submit``) does the same through submitit and returns a submitit ``Job``
whose function runs our rendered batch script once on the first node of the
allocation (``use_srun=False``), so the Ray bootstrap is the same code path.
"""
from __future__ import annotations

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


def _job_config(config: str | None, overrides: Sequence[str], profile_name: str = "") -> Any:
    from hpc_verl.launch.jobconfig import job_from_dict, load_job_config

    if config is None and Path(profile_name).stem == "local":
        # the embedded default for newcomers: the tiny model on the shipped sample (see hpc_verl.launch.local)
        from hpc_verl.launch.local import demo_job_dict

        job = job_from_dict(demo_job_dict(), "(built-in local demo job)")
        if overrides:
            job.trainer.overrides.update(load_job_config(None, list(overrides)).trainer.overrides)
        return job
    return load_job_config(config, list(overrides))


def _local_python_set(profile: Any, sets: Sequence[str]) -> list[str]:
    """A local job runs with the interpreter running hpc-verl, unless the profile or --set names one."""
    if profile.scheduler != "local" or any(s.startswith("ray.python=") for s in sets) \
            or profile.ray.python != "python3":
        return []
    return [f"ray.python={sys.executable}"]


def prepare(profile_name: str, config: str | None = None, overrides: Sequence[str] = (),
            sets: Sequence[str] = (), name: str | None = None, hold: bool = False) -> registry.JobRecord:
    """Everything but the submission: job dir, rendered script, resolved profile and config.

    The profile's ``paths.job_root`` is pointed at the job's registry directory, so the
    run directory (``<name>-<job id>``) and the batch log land next to the record.
    ``hold``: a cluster job (``hpc-verl cluster up``) that keeps Ray up instead of training.
    Jobs that train pass the same checks as ``hpc-verl plan``/``render`` (``build_plan``:
    trainer keys, batch arithmetic) before anything is written; a local job's model and
    raw data must exist here.
    """
    from hpc_verl.launch.plan import build_plan
    from hpc_verl.launch.render import render_sbatch

    job = _job_config(config, overrides, profile_name)
    job_name = name or job.name
    if name:
        job.name = name
    first = _load_profile(profile_name, sets)
    if first.scheduler not in ("slurm", "local") or (hold and first.scheduler != "slurm"):
        raise ConfigError(f"profile {first.name} uses scheduler '{first.scheduler}'; "
                          f"'hpc-verl {'cluster up' if hold else 'submit'}' needs a SLURM profile"
                          + ("" if hold else " or a local one (--profile local)"))
    if first.scheduler == "local":
        from hpc_verl.launch.local import check_inputs

        check_inputs(job, os.getcwd())
    sets = [*sets, *_local_python_set(first, sets)]
    job_dir = registry.new_job_dir(job_name)
    try:
        profile = _load_profile(profile_name, [*sets, f"paths.job_root={job_dir}"])
        script = render_sbatch(profile, job, hold=True) if hold else build_plan(profile, job).script
    except BaseException:
        import shutil

        shutil.rmtree(job_dir, ignore_errors=True)  # nothing half-written in the registry
        raise
    script_path = job_dir / "script.sbatch"
    atomic_write_text(script_path, script, mode=0o700)
    atomic_write_json(job_dir / "profile.json", profile.to_dict())
    atomic_write_json(job_dir / "job_config.json", job.to_dict())
    rec = registry.JobRecord(name=job_name, job_dir=str(job_dir), profile=profile.name, script=str(script_path),
                             log_dir="", slurm_conf=os.environ.get("SLURM_CONF"), nodes=[], dry_run=True,
                             scheduler=profile.scheduler, submit_dir=os.getcwd())
    rec.save()
    return rec


def _set_paths(rec: registry.JobRecord, job_id: int) -> None:
    rec.job_id = job_id
    rec.run_dir = str(Path(rec.job_dir) / f"{rec.name}-{job_id}")
    rec.log_dir = str(Path(rec.run_dir) / "logs")
    rec.batch_log = str(Path(rec.job_dir) / f"{rec.name}-{job_id}.out")
    rec.dry_run = False
    rec.save()


def submit_job(profile_name: str, config: str | None = None, overrides: Sequence[str] = (),
               sets: Sequence[str] = (), name: str | None = None, dry_run: bool = False,
               hold: bool = False, detach: bool = False) -> registry.JobRecord:
    """Prepare, then ``sbatch --parsable`` (unless ``dry_run``) and record the job id.

    A local profile runs the script on this machine instead (``hpc_verl.launch.local``):
    in the foreground (the record's ``exit_code`` is set on return) or, with ``detach``,
    in the background."""
    rec = prepare(profile_name, config, overrides, sets, name, hold=hold)
    if hold:
        rec.role = "cluster"
        rec.save()
    if dry_run:
        return rec
    if rec.scheduler == "local":
        from hpc_verl.launch import local

        if detach:
            return local.run_detached(rec)
        local.run_foreground(rec)
        return rec
    _set_paths(rec, slurm.sbatch(rec.script))
    return rec


# ---------------------------------------------------------------------------- submitit
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
    if _load_profile(profile, sets).scheduler != "slurm":
        raise ConfigError(f"submit(): profile {profile} does not use SLURM; run it with "
                          "hpc_verl.launch.submit.submit_job(...) or 'hpc-verl submit --profile ...'")
    import submitit

    rec = prepare(profile, config, overrides, sets, name)
    prof = json.loads((Path(rec.job_dir) / "profile.json").read_text())
    s = prof["slurm"]
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
    rec.scheduler = "submitit"
    _set_paths(rec, int(job.job_id))
    rec.batch_log = str(job.paths.stdout).replace("%j", str(job.job_id))
    rec.save()
    return job
