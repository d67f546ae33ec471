"""The PPO graph's nodes run in-process (InlineRunner: same graph, no Ray): GAE + critic + KL paths,
version stamping, and that a checkpoint restores actor, critic, optimiser and KL state exactly."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401


def _trainer(tiny_model, digits_data, run_dir, steps, *extra):
    from hpc_verl.trainer.config.schema import load_config
    from hpc_verl.trainer.driver.inline_runner import InlineRunner
    from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer
    cfg = load_config(None, digit_overrides(tiny_model, digits_data, run_dir, steps, (
        "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.horizon=100", "actor_rollout_ref.actor.use_kl_loss=true", "critic.optim.lr=1e-3",
        "actor_rollout_ref.rollout.n=2", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", *extra)))
    return PPOTrainer(cfg, runner=InlineRunner(), progress=False)


def test_gae_critic_kl_graph_and_exact_restore(tiny_model, digits_data, tmp_path):
    from hpc_verl.trainer.driver.checkpoint import latest_checkpoint, list_checkpoints
    run = tmp_path / "run"
    tr = _trainer(tiny_model, digits_data, run, 3, "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2")
    assert tr.fit() == 0
    h = tr.history
    assert [m["step"] for m in h] == [1, 2, 3]
    assert [m["rollout/policy_version"] for m in h] == [0, 1, 2]  # each rollout used the latest policy
    assert all("critic/vf_loss" in m and "actor/kl_loss" in m for m in h)
    assert h[0]["actor/reward_kl_penalty"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert abs(h[2]["actor/reward_kl_penalty"]) > 1e-6  # moved away from the reference (the k1 estimate may be negative)
    assert h[0]["actor/reward_kl_penalty_coeff"] != h[2]["actor/reward_kl_penalty_coeff"]  # adaptive controller moved
    # keep-last-2 rotation, latest pointer
    assert [s for s, _ in list_checkpoints(run)] == [2, 3]
    assert latest_checkpoint(run).name == "global_step_3"

    # a fresh trainer with resume_mode=auto restores every piece of state exactly
    tr2 = _trainer(tiny_model, digits_data, run, 3)
    from hpc_verl.trainer.driver.inline_runner import InlineRunner
    tr2.runner = InlineRunner()
    tr2.runner.start(tr2.cfg.to_dict(), tr2.total_steps)
    tr2._restore(latest_checkpoint(run))
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from hpc_verl.trainer.driver.checkpoint import load_checkpoint
    from hpc_verl.trainer.engine.sharded import read_sharded
    ckpt = latest_checkpoint(run)
    state, parts = load_checkpoint(ckpt)
    saved_actor, saved_critic = read_sharded(ckpt / "actor"), read_sharded(ckpt / "critic")
    actor = tr2.runner.instances["actor_update"].worker
    model_sd, optim_sd = get_state_dict(actor.model.module, actor.optimizer)
    for k, v in model_sd.items():
        assert torch.equal(v, saved_actor["model"][k]), k
    some = next(iter(optim_sd["state"]))
    assert torch.equal(optim_sd["state"][some]["exp_avg"], saved_actor["optim"]["state"][some]["exp_avg"])
    critic_node = tr2.runner.instances["critic"]
    for k, v in critic_node.worker.model.module.state_dict().items():
        assert torch.equal(v, saved_critic["model"][k]), k
    assert critic_node.kl_ctrl.value == torch.load(ckpt / "critic" / "kl_ctrl.pt")["kl_ctrl"]["value"]
    rollout = tr2.runner.instances["actor_rollout"].worker
    assert rollout.version == 3 and tr2.version == 3 and tr2.step == 3
    for k, v in rollout.model.state_dict().items():  # weights re-published to the rollout on resume
        assert torch.equal(v, saved_actor["model"][k]), k
    assert tr2.sampler.state_dict() == state["data"] and state["format"] == 2
    tr2.runner.shutdown()
