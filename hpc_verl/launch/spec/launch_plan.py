"""A launch plan: what will run where, with the rendered script, before anything is submitted.

``build_plan`` is the one entry point that turns (profile, job config, trainer
overrides) into a printable ``LaunchPlan``; ``render`` does the templating and
``validate_script`` the static checks (``bash -n``, shellcheck). Submission is
elsewhere (``hpc_verl.launch.backends``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from hpc_verl.errors import RenderError
from hpc_verl.launch.spec.jobconfig import JobConfig, load_job_config
from hpc_verl.launch.spec.trainer_check import starts_with_ray
from hpc_verl.launch.spec.render import STAGES, derived_overrides, job_stages, render_sbatch, sbatch_options
from hpc_verl.profiles import Profile, load_profile
from hpc_verl.util.fs import atomic_write_text


@dataclass
class LaunchPlan:
    """Everything about one job before submission: inputs, the rendered script, a summary."""

    profile: Profile
    job: JobConfig
    script: str
    sbatch_options: list[str]
    stages: tuple[str, ...] = STAGES

    @property
    def nodes(self) -> int:
        return self.profile.slurm.nodes

    @property
    def gpus_per_node(self) -> int:
        return self.profile.slurm.gpus_per_node

    @property
    def trainer_starts_with_ray(self) -> bool:
        """Ours starts before Ray is ready (its set-up overlaps the bring-up); see the script."""
        return "train" in self.stages and starts_with_ray(self.job)

    def trainer_command(self) -> list[str]:
        """The trainer command as it will run (run-time values shown as shell variables)."""
        derived = [f"{k}={v}" for k, v in derived_overrides(self.profile, self.job)]
        return [self.profile.ray.python, "-m", self.job.trainer.module, *self.job.trainer.args,
                *self.job.trainer_override_args(), *derived]

    def summary(self) -> str:
        p, c = self.profile, self.profile.container
        lines = [
            f"profile   {p.name} ({p.source or 'in memory'})",
            f"job       {self.job.name} ({self.job.source})",
            f"resources {self.nodes} node(s) x {self.gpus_per_node} GPU ({p.accelerator}), scheduler {p.scheduler}",
            f"container {c.runtime}" + (f" {c.image}" if c.image else ""),
            f"network   {p.network.transport}" + (f" via {p.network.interface}" if p.network.interface else ""),
            f"trainer   {' '.join(self.trainer_command())}",
            f"stages    {' -> '.join(self.stages)}" + (" (the trainer starts with ray-up and connects once Ray "
                                                       "is ready)" if self.trainer_starts_with_ray else ""),
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict[str, Any]:
        return {"profile": self.profile.name, "job": self.job.to_dict(), "sbatch_options": self.sbatch_options,
                "stages": list(self.stages), "trainer_starts_with_ray": self.trainer_starts_with_ray,
                "trainer_command": self.trainer_command(), "script": self.script}

    def write(self, path: Union[str, "os.PathLike[str]"]) -> Path:
        """Write the script atomically (executable)."""
        try:
            return atomic_write_text(path, self.script, mode=0o755)
        except OSError as exc:
            raise RenderError(f"cannot write {path}: {exc.strerror or exc}; choose another -o path") from None


def build_plan(profile: Union[Profile, str], job_config: Union[JobConfig, str, None] = None,
               overrides: Optional[list[str]] = None, *, profile_overrides: Optional[list[str]] = None,
               hold: bool = False, job_id: Optional[int] = None, command: Optional[list[str]] = None) -> LaunchPlan:
    """Resolve inputs and render. ``overrides`` are trainer ``key=value``; ``profile_overrides`` are ``--set``;
    ``command``: the trainer command given after ``--`` (``trainer_command``).

    ``hold``: a cluster job (``hpc-verl cluster up``) that keeps Ray up in place of training,
    so its trainer is not checked. ``job_id``: fixed into the script (a local job, whose run
    directory must stay the same when the script runs again); default ``$SLURM_JOB_ID``.
    The job's own size (``trainer.nnodes``/``trainer.n_gpus_per_node``) asks for the allocation
    of a profile given by name (``job_size``)."""
    if isinstance(job_config, JobConfig):
        job = job_config
        if overrides or command:
            extra = load_job_config(None, overrides, command)
            job.trainer.overrides.update(extra.trainer.overrides)
            if command:
                job.trainer.module, job.trainer.args = extra.trainer.module, extra.trainer.args or job.trainer.args
    else:
        job = load_job_config(job_config, overrides, command)
    if not isinstance(profile, Profile) or profile_overrides:
        name = profile if not isinstance(profile, Profile) else (profile.source or profile.name)
        sets = list(profile_overrides or [])
        profile = load_profile(name, sets)
        if not hold:
            from hpc_verl.launch.spec.job_size import size_sets
            extra_sets = size_sets(profile, job, sets)
            if extra_sets:
                profile = load_profile(name, [*sets, *extra_sets])
    if not hold:  # trainer keys and batch arithmetic, before anything is rendered or submitted
        from hpc_verl.launch.spec.trainer_check import validate_job_trainer
        validate_job_trainer(profile, job)
    script = render_sbatch(profile, job, hold=hold, job_id=job_id)
    opts = sbatch_options(profile, job) if profile.scheduler == "slurm" else []
    return LaunchPlan(profile=profile, job=job, script=script, sbatch_options=opts, stages=job_stages(hold))


def validate_script(script: str, *, shellcheck: bool = True) -> list[str]:
    """Problems found by ``bash -n`` and shellcheck (empty list = clean)."""
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hpcv-validate-") as tmp:
        path = Path(tmp) / "job.sbatch"
        path.write_text(script)
        res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        if res.returncode != 0:
            problems.append("bash -n: " + " | ".join(res.stderr.replace(str(path), "job.sbatch").splitlines()))
        if shellcheck:
            exe = shutil.which("shellcheck")
            if exe is None:
                raise RenderError("shellcheck is not installed; install it (apt-get install shellcheck) "
                                  "or pass --no-shellcheck")
            res = subprocess.run([exe, "--format=gcc", "--shell=bash", str(path)], capture_output=True, text=True)
            if res.returncode != 0:
                out = (res.stdout + res.stderr).replace(str(path), "job.sbatch").strip()
                problems.extend("shellcheck: " + line for line in out.splitlines())
    return problems
