"""What the launcher asks about a job of the built-in trainer before it submits it: the config
with the job's overrides (one line when it is invalid) and the batch arithmetic on the job's
allocation. The launcher decides nothing about this config itself. Driver and login node;
no torch.
"""
from __future__ import annotations

from typing import Sequence

from hpc_verl.trainer.config.schema import load_config
from hpc_verl.util.batch_rules import check_ppo_arithmetic


def job_problems(overrides: Sequence[str], nnodes: int, gpus_per_node: int) -> list[str]:
    """Problems of the trainer config the overrides give on ``nnodes`` x ``gpus_per_node`` (0: CPU
    workers, no per-GPU split); raises ConfigError (one line) when the config does not load."""
    cfg = load_config(None, overrides=list(overrides))
    return check_ppo_arithmetic(cfg, nnodes, gpus_per_node)
