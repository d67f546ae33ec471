"""hpc_verl: verl-style RL post-training of LLMs, from a laptop to SLURM clusters.

The public API is imported lazily so that ``import hpc_verl`` (and the CLI) stay
light: nothing here pulls in ray or torch until it is used.
"""
from __future__ import annotations

import importlib
from typing import Any

from hpc_verl._version import __version__

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "submit": "hpc_verl.launch.submit",
    "RayJobHandle": "hpc_verl.launch.backends.rayjobs_api",
    "load_profile": "hpc_verl.profiles",
    "list_profiles": "hpc_verl.profiles",
    "Profile": "hpc_verl.profiles",
    "build_plan": "hpc_verl.launch.spec.launch_plan",
    "LaunchPlan": "hpc_verl.launch.spec.launch_plan",
    "render_sbatch": "hpc_verl.launch.spec.render",
    "load_job_config": "hpc_verl.launch.spec.jobconfig",
    "JobConfig": "hpc_verl.launch.spec.jobconfig",
    "build_verl_command": "hpc_verl.verl_upstream.command",
    "validate_job_trainer": "hpc_verl.launch.spec.trainer_check",
    "check_ppo_arithmetic": "hpc_verl.util.batch_rules",
    "batch_problems": "hpc_verl.util.batch_rules",
    "run_doctor": "hpc_verl.ops.doctor",
    "make_plan": "hpc_verl.ops.scaling",
    "DataflowGraph": "hpc_verl.dataflow",
    "Node": "hpc_verl.dataflow",
    "Edge": "hpc_verl.dataflow",
    "HybridScheduler": "hpc_verl.dataflow",
    "PPOTrainer": "hpc_verl.trainer.driver.ppo_trainer",
    "load_config": "hpc_verl.trainer.config.schema",
    "check_batch_arithmetic": "hpc_verl.trainer.config.schema",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpc_verl' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["__version__", *_LAZY]
