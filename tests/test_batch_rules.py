"""The one set of batch-size rules (hpc_verl.util.batch_rules) that the built-in trainer and the
checks of upstream verl jobs share: per-role group sizes, sequence parallelism, global micro-batches,
verl's defaults for missing keys, and the same wording whichever side asks."""
from __future__ import annotations

from hpc_verl.trainer.config.schema import check_batch_arithmetic, load_config
from hpc_verl.util.batch_rules import VERL_DEFAULTS, batch_problems, check_ppo_arithmetic

ACTOR = "actor_rollout_ref.actor"


MINI, MICRO, MICRO_GPU = (f"{ACTOR}.ppo_mini_batch_size", f"{ACTOR}.ppo_micro_batch_size",
                          f"{ACTOR}.ppo_micro_batch_size_per_gpu")


def cfg(train_batch: int, mini: int) -> dict:
    """A flat verl-style config; GRPO, so no critic."""
    return {"algorithm.adv_estimator": "grpo", "data.train_batch_size": train_batch, MINI: mini}


def test_roles_on_their_own_gpu_groups():
    """The critic on 16 GPUs while the actor has 8: each group's split is checked with its own size."""
    c = {"algorithm.adv_estimator": "gae", "data.train_batch_size": 8, "actor_rollout_ref.rollout.n": 3,
         f"{ACTOR}.ppo_mini_batch_size": 8, "critic.ppo_mini_batch_size": 8}
    assert batch_problems(c, {"actor": 8, "critic": 8, "rollout": 8}) == []
    first, second = batch_problems(c, {"actor": 8, "critic": 16, "rollout": 8})
    assert "= 24 responses is not divisible by 16 GPUs of the critic" in first
    assert "data.train_batch_size=" in first  # a value that works
    assert second.startswith("critic.ppo_mini_batch_size (8) × rollout.n (3) = 24 does not split over 16")
    # the same config, every role on 16 GPUs: one line, no role named
    (msg,) = [p for p in batch_problems(c, {"actor": 16, "critic": 16}) if "responses" in p]
    assert msg.endswith("use e.g. data.train_batch_size=16") and "of the" not in msg


def test_sequence_parallel_divides_the_ranks_into_data_parallel_groups():
    base = cfg(16, 4)
    # 8 ranks, sp 2 -> 4 data-parallel ranks: a mini-batch of 4 splits, per GPU 1
    c = {**base, f"{ACTOR}.ulysses_sequence_parallel_size": 2, MICRO_GPU: 1}
    assert check_ppo_arithmetic(c, 1, 8) == []
    c[MICRO_GPU] = 2  # 4 x 1 / 4 ranks = 1 per GPU: 2 does not divide it
    (msg,) = check_ppo_arithmetic(c, 1, 8)
    assert "per-GPU mini-batch 1 (= 4 × 1 / 4 data-parallel ranks)" in msg
    c = {**base, f"{ACTOR}.ulysses_sequence_parallel_size": 3}
    (msg,) = check_ppo_arithmetic(c, 1, 8)
    assert "ulysses_sequence_parallel_size (3) does not divide the 8 GPUs of the actor" in msg
    # on CPU (no GPUs) one worker does everything: sequence parallelism is not checked
    assert batch_problems(c, {}) == []


def test_global_micro_batch_follows_verl():
    c = {**cfg(64, 32), MICRO: 16}
    assert check_ppo_arithmetic(c, 1, 8) == []  # 16 // 8 = 2 per GPU divides 32 / 8 = 4
    c[MICRO] = 4  # fewer than the 8 GPUs: nothing per GPU
    assert any("(4) × ulysses_sequence_parallel_size (1) is less than the 8 GPUs" in p
               for p in check_ppo_arithmetic(c, 1, 8))
    c[MICRO] = 12  # 32 % 12
    assert any("ppo_mini_batch_size (32) is not divisible by" in p for p in check_ppo_arithmetic(c, 1, 8))
    c[MICRO_GPU] = 2
    (msg,) = check_ppo_arithmetic(c, 1, 8)
    assert "set only one of ppo_micro_batch_size and ppo_micro_batch_size_per_gpu" in msg


def test_rollout_log_prob_micro_batch():
    c = {**cfg(64, 32), "actor_rollout_ref.rollout.log_prob_micro_batch_size": 4}
    assert batch_problems(c, {"actor": 4, "rollout": 4}) == []
    (msg,) = batch_problems(c, {"actor": 4, "rollout": 8})
    assert "log_prob_micro_batch_size (4) is less than the 8 data-parallel ranks of the rollout" in msg
    c["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"] = 1
    assert "set only one of log_prob_micro_batch_size" in batch_problems(c, {"rollout": 4})[0]


def test_missing_keys_take_verls_defaults():
    assert VERL_DEFAULTS["data.train_batch_size"] == 1024
    # nothing given: verl's 1024 prompts, mini 256, TP 2 fit 2 x 8 GPUs; TP 2 does not fit 1 GPU per node
    assert check_ppo_arithmetic({}, 2, 8) == []
    assert any("tensor_model_parallel_size (2) does not divide the 1 GPUs per node" in p
               for p in check_ppo_arithmetic({}, 1, 1))
    # GAE (verl's default) brings the critic, with the actor's mini-batch
    assert [p.split(".")[0] for p in check_ppo_arithmetic({MINI: 100}, 2, 8)] == \
        ["actor_rollout_ref", "critic"]


def test_trainer_and_launcher_say_the_same():
    """The trainer's validate_for_run path and the launcher's check word one problem identically."""
    trainer_cfg = load_config(None, ["trainer.device=cuda", "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                                     "data.train_batch_size=12", f"{ACTOR}.ppo_mini_batch_size=4"])
    from_trainer = check_batch_arithmetic(trainer_cfg, 16)
    from_launcher = check_ppo_arithmetic(trainer_cfg, 2, 8)
    assert from_trainer and from_trainer[0] == from_launcher[0]
    assert "= 12 responses is not divisible by 16 GPUs" in from_trainer[0]


def test_bad_values_are_named():
    (msg,) = batch_problems({"data.train_batch_size": "many"}, {"actor": 8})
    assert msg == "data.train_batch_size must be a positive integer, got 'many'"
    assert batch_problems({"data.train_batch_size": "8", "algorithm.adv_estimator": "grpo",
                           MINI: 8.0}, {"actor": 8}) == []  # as YAML/CLI spell them
