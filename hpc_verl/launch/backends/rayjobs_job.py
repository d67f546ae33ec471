"""What a job sent to a Ray cluster is, beyond its driver command: the same job as a batch job.

The stages a batch script runs before training (``stage_plan``, run by
``hpc_verl.bootstrap.stages`` in the driver), its paths taken from the submit
directory (``anchor_paths``), the profile a held cluster was started with
(``held_profile``) and what the cluster must offer (``ray_need``, checked with
``spec.placement`` before sending).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hpc_verl.launch.spec.jobconfig import TrainerSpec
from hpc_verl.verl_upstream.command import MODULE as VERL_TRAINER_MODULE


STAGES_MODULE = "hpc_verl.bootstrap.stages"


def stage_plan(job: Any) -> dict[str, Any]:
    """What ``hpc_verl.bootstrap.stages`` runs before the trainer (empty: no stage applies)."""
    plan: dict[str, Any] = {}
    if job.data.raw:
        plan["preprocess"] = {"module": job.data.preprocess_module, "input": job.data.raw, "output": job.data.dir,
                              "train_file": job.data.train_file, "args": list(job.data.preprocess_args)}
    if job.model.check and job.model.path:
        plan["model_check"] = job.model.path
    return plan


def anchor_paths(job: Any, base: Path) -> Any:
    """Relative data and model paths taken from the submit directory, as a batch job takes them (the
    cluster shares the filesystem); with ``ray_job.working_dir`` they stay relative to the upload."""
    if job.ray_job.working_dir:
        return job
    for section, key in (("data", "raw"), ("data", "dir"), ("model", "path")):
        value = getattr(getattr(job, section), key)
        if value and "://" not in value and not os.path.isabs(value):
            setattr(getattr(job, section), key, str(base / value))
    return job


def held_profile(crec: Any) -> Any:
    """The resolved profile a held cluster was started with (its ``--set`` values included)."""
    from hpc_verl.errors import ProfileError
    from hpc_verl.profiles.schema import build_profile

    path = Path(crec.job_dir) / "profile.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"cluster job {crec.job_id}: its profile {path} cannot be read ({exc}); give "
                           "--profile NAME") from None
    data.pop("name", None)
    profile = build_profile(crec.profile, data, lambda _key: f"cluster job {crec.job_id}'s profile.json")
    profile.source = str(path)
    return profile


KNOWN_TRAINERS = (VERL_TRAINER_MODULE, TrainerSpec().module)


def ray_need(profile: Any, job: Any) -> Any:
    """What an upstream verl job asks of the Ray cluster (placement.Need); None for other trainers."""
    from hpc_verl.launch.spec.placement import Need
    from hpc_verl.verl_upstream.command import runs_verl
    from hpc_verl.verl_upstream.cpu import rules

    if job.ray_job.command or not runs_verl(job):
        return None
    nodes = int(str(job.trainer.overrides.get("trainer.nnodes", profile.slurm.nodes)))
    if rules.applies(profile, job):
        user = job.trainer_override_args()
        gpus = rules.LOGICAL_GPUS_PER_NODE
        return Need(nodes, gpus, rules.ray_cpus(user, gpus), why="verl on CPU (logical GPU slots)",
                    python=profile.ray.python, modules=_modules_of(job))
    gpus = int(str(job.trainer.overrides.get("trainer.n_gpus_per_node", profile.slurm.gpus_per_node)))
    return Need(nodes, gpus, 0.0, why="verl", python=profile.ray.python, modules=_modules_of(job))


def _modules_of(job: Any) -> tuple[str, ...]:
    """The packages a verl job imports in the cluster: verl, and its rollout engine when it is vLLM or SGLang."""
    rollout = str(job.trainer.overrides.get("actor_rollout_ref.rollout.name", "")).strip()
    return ("verl", *({"vllm": ("vllm",), "sglang": ("sglang",)}.get(rollout, ())))
