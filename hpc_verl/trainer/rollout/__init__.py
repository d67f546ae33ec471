"""Generation engines behind one interface: the transformers rollout (hf), vLLM
(vllm_worker, vllm_engine) and shared-prompt attention.

Runs in the rollout ranks. torch may be imported at a module's top here; ``ROLLOUTS``
names each engine's worker class (``actor_rollout_ref.rollout.name`` -> "module:Class"),
and importing this package imports no engine.
"""
from __future__ import annotations

import importlib
from typing import Any

#: ``actor_rollout_ref.rollout.name`` -> "module:Class" of its worker (same interface as hf's
#: RolloutWorker). A new engine is one module here and one line in this table (and its name in
#: the config's choices, config/schema.py; tests/test_trainer_config.py checks they agree).
ROLLOUTS: dict[str, str] = {
    "hf": "hpc_verl.trainer.rollout.hf:RolloutWorker",
    "vllm": "hpc_verl.trainer.rollout.vllm_worker:VLLMRolloutWorker",
}


def rollout_worker_class(name: str) -> Any:
    """The worker class of rollout engine ``name`` (imported now: engines load torch, vLLM)."""
    module, _, cls = ROLLOUTS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def make_rollout_worker(cfg: dict) -> Any:
    """The configured rollout (``rollout.name``); vllm without vLLM or GPUs is one clear error."""
    return rollout_worker_class(cfg["actor_rollout_ref"]["rollout"]["name"])(cfg)
