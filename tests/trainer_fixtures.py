"""Shared fixtures of the trainer tests: a tiny model and the digit data, made once per session."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from hpc_verl.trainer.models.tiny import make_tiny_model
    from hpc_verl.trainer.models.check import quiet_transformers
    quiet_transformers()
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", hidden_size=64, num_layers=2, num_heads=2)


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> Path:
    from hpc_verl.data.preprocess import preprocess_digits
    out = tmp_path_factory.mktemp("digits")
    preprocess_digits(out, n_train=256, n_test=32, seed=0)
    return out


def digit_overrides(model: Path, data: Path, run_dir: Path, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    """A small GRPO config on the digit task that learns fast on CPU."""
    return [f"actor_rollout_ref.model.path={model}", f"data.train_files={data / 'train.parquet'}",
            "data.max_prompt_length=16", "data.max_response_length=4", "data.train_batch_size=16",
            "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.optim.weight_decay=0",
            "actor_rollout_ref.actor.entropy_coeff=0.01", "algorithm.adv_estimator=grpo",
            # Dr. GRPO-style (no division by the group std): robust on every seed tried (1-6)
            "algorithm.norm_adv_by_std_in_grpo=false", "trainer.device=cpu", "trainer.n_gpus_per_node=1",
            f"trainer.total_training_steps={steps}", f"hpc_verl.run_dir={run_dir}", "hpc_verl.progress=false",
            *extra]
