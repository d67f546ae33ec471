"""Trainer config: verl key names, strict keys and values, batch arithmetic, device mapping."""
from __future__ import annotations

import pytest

from hpc_verl.errors import ConfigError
from hpc_verl.trainer.config.schema import check_batch_arithmetic, load_config, validate_for_run


def test_defaults_and_overrides_use_verl_names(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  train_batch_size: 32\nactor_rollout_ref:\n  rollout:\n    n: 4\n    name: hf\n"
                 "algorithm:\n  adv_estimator: grpo\n")
    cfg = load_config(f, ["data.train_batch_size=64", "actor_rollout_ref.actor.optim.lr=1e-3",
                          "trainer.default_local_dir=/x/${trainer.experiment_name}"])
    assert cfg.data.train_batch_size == 64  # command line beats file
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(1e-3)  # YAML 1.1 reads 1e-3 as text
    assert cfg.trainer.default_local_dir == "/x/ppo"
    assert cfg.critic.enable is False  # derived: grpo needs no critic
    assert cfg.critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.hpc_verl.run_dir == "/x/ppo"


@pytest.mark.parametrize("override,needle", [
    ("data.trian_batch_size=3", "did you mean 'data.train_batch_size'"),
    ("actor_rollout_ref.rollout.nam=hf", "did you mean 'actor_rollout_ref.rollout.name'"),
    ("trainer.nnodes=two", "expected an integer"),
    ("data.train_batch_size=0", "must be > 0"),
    ("actor_rollout_ref.rollout.name=vlm", "not one of hf, vllm (did you mean 'vllm'?)"),
    ("algorithm.adv_estimator=ppo", "not one of gae, grpo"),
    ("hpc_verl.cpu_matmul=mkl", "not one of onednn, torch"),
    ("algorithm.gamma=1.5", "within [0, 1]"),
    ("algorithm.kl_ctrl=3", "is a section"),
    ("trainer.save_freq=true", "expected an integer"),
    ("hpc_verl.device_mapping={actor: [0, 9]}", "outside 0..7"),
    ("hpc_verl.device_mapping={actr: [0]}", "did you mean 'actor'"),
    ("nonsense", "expected key=value"),
])
def test_bad_overrides_are_one_line(override, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg


def test_bad_yaml_file_names_file_and_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("data:\n  train_batch_size: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: not valid YAML"):
        load_config(f)
    f.write_text("data:\n  max_prompt_lenght: 10\n")
    with pytest.raises(ConfigError, match="did you mean 'data.max_prompt_length'"):
        load_config(f)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_batch_arithmetic_problems():
    cfg = {"data": {"train_batch_size": 6}, "actor_rollout_ref": {"rollout": {"n": 1}, "actor": {
        "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 3}}, "algorithm": {"adv_estimator": "grpo"}}
    problems = check_batch_arithmetic(cfg, 4)
    assert any("6 responses is not divisible by 4 GPUs" in p for p in problems)
    # a valid verl-like layout: 8 GPUs, 1024 prompts x 5, mini 256 -> 160 responses per GPU, micro 16
    good = {"data": {"train_batch_size": 1024}, "actor_rollout_ref": {"rollout": {"n": 5}, "actor": {
        "ppo_mini_batch_size": 256, "ppo_micro_batch_size_per_gpu": 16}}, "critic": {"ppo_micro_batch_size_per_gpu": 32}}
    assert check_batch_arithmetic(good, 8) == []
    good["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 24  # 160 % 24 != 0
    problems = check_batch_arithmetic(good, 8)
    assert len(problems) == 1 and "does not divide the per-GPU mini-batch" in problems[0] and "160" in problems[0]
    # on CPU (0 GPUs) only the mini/micro relation is checked
    cpu = {"data": {"train_batch_size": 6}, "actor_rollout_ref": {"rollout": {"n": 3}, "actor": {
        "ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 3}}, "algorithm": {"adv_estimator": "grpo"}}
    assert check_batch_arithmetic(cpu, 0) == []
    cpu["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"] = 8
    assert "larger than data.train_batch_size" in check_batch_arithmetic(cpu, 0)[0]


def test_validate_for_run_catches_inconsistent_settings(tmp_path):
    base = [f"actor_rollout_ref.model.path={tmp_path}", f"data.train_files={tmp_path}/t.parquet", "trainer.device=cpu"]
    with pytest.raises(ConfigError, match="grpo needs actor_rollout_ref.rollout.n >= 2"):
        validate_for_run(load_config(None, base + ["algorithm.adv_estimator=grpo", "data.train_batch_size=8",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=8"]))
    with pytest.raises(ConfigError, match="rloo needs actor_rollout_ref.rollout.n >= 2"):
        validate_for_run(load_config(None, base + ["algorithm.adv_estimator=rloo", "data.train_batch_size=8",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=8"]))
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path is not set"):
        validate_for_run(load_config(None, ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]))
    with pytest.raises(ConfigError, match="not divisible by 16 GPUs"):
        validate_for_run(load_config(None, base + ["trainer.device=cuda", "trainer.nnodes=2",
                                                   "data.train_batch_size=12",
                                                   "actor_rollout_ref.actor.ppo_mini_batch_size=4"]))


def test_device_mapping_gives_roles_worker_groups():
    from hpc_verl.trainer.config.topology import topology
    cfg = load_config(None, ["trainer.n_gpus_per_node=8", "trainer.nnodes=2", "algorithm.adv_estimator=gae",
                             "hpc_verl.device_mapping={actor: [0,1,2,3], rollout: '4,5,6,7', critic: [0,1,2,3], "
                             "ref: [4,5,6,7]}", "actor_rollout_ref.actor.use_kl_loss=true"])
    topo = topology(cfg)
    # same ids share one process per GPU; disjoint ids are separate groups; 4 GPUs x 2 nodes each
    assert {n: g.roles for n, g in topo.groups.items()} == {"actor": ("actor", "critic"), "rollout": ("rollout", "ref")}
    assert all(g.world_size == 8 and g.ranks_per_node == 4 and g.resources == {"GPU": 1.0}
               for g in topo.groups.values())
    assert topo.group_of("reward") is None and topo.rollout_replicas == 8   # the rule reward takes no GPU
    assert cfg.hpc_verl.device_mapping["rollout"] == [4, 5, 6, 7]
    # the default (no mapping): every role shares all GPUs, one process each (hybrid engine)
    topo = topology(load_config(None, ["trainer.n_gpus_per_node=2", "algorithm.adv_estimator=gae"]))
    assert list(topo.groups) == ["hybrid"] and topo.groups["hybrid"].roles == ("actor", "rollout", "critic")
    assert topo.groups["hybrid"].world_size == 2
    # on CPU n_gpus_per_node counts ranks (0, what a CPU-only allocation derives, is one)
    cpu = topology(load_config(None, ["trainer.device=cpu", "trainer.n_gpus_per_node=0"]))
    assert cpu.groups["hybrid"].world_size == 1 and cpu.groups["hybrid"].resources == {"CPU": 1.0}
    with pytest.raises(ConfigError, match=r"actor \[0, 1, 2\] and rollout \[2, 3\] overlap on \[2\]"):
        topology(load_config(None, ["trainer.n_gpus_per_node=4", "hpc_verl.device_mapping={actor: [0,1,2], "
                                    "rollout: [2,3]}"]))
    with pytest.raises(ConfigError, match="tensor parallelism needs rollout.name=vllm"):
        topology(load_config(None, ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    # vLLM: rollout replicas = rollout GPUs / TP, each replica process holds TP GPUs
    topo = topology(load_config(None, ["hpc_verl.device_mapping={actor: [0,1,2,3], rollout: [4,5,6,7]}",
                                       "actor_rollout_ref.rollout.name=vllm",
                                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    assert topo.rollout_replicas == 2 and topo.groups["rollout"].resources == {"GPU": 2.0}


def test_cli_train_unknown_key_one_line(cli):
    res = cli("train", "data.trian_batch_size=4")
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "did you mean 'data.train_batch_size'" in lines[0], res.stderr
    res = cli("train", "--print-config", "data.train_batch_size=4")
    assert res.returncode == 0 and "train_batch_size: 4" in res.stdout


def test_verl_values_of_the_loss_and_schedule_keys_load():
    """verl 0.9.1's names (their maths: tests/test_verl_parity.py); a critic is GAE's only."""
    cfg = load_config(None, ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                             "actor_rollout_ref.actor.loss_scale_factor=128", "actor_rollout_ref.actor.kl_loss_type=k3+",
                             "algorithm.kl_penalty=k2", "algorithm.adv_estimator=reinforce_plus_plus",
                             "critic.optim.warmup_style=cosine", "critic.loss_agg_mode=token-sum"])
    assert cfg.critic.optim.lr_scheduler_type == "cosine" and cfg.critic.loss_scale_factor == 128
    assert cfg.critic.enable is False and cfg.critic.shuffle is False
    for bad, needle in (("critic.loss_agg_mode=token_mean", "did you mean 'token-mean'"),
                        ("algorithm.kl_penalty=full", "not one of"),
                        ("actor_rollout_ref.actor.optim.lr_scheduler_type=wsd", "not one of constant, cosine"),
                        ("actor_rollout_ref.actor.loss_scale_factor=0", "must be > 0")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="critic for GAE only"):
        load_config(None, ["algorithm.adv_estimator=rloo", "critic.enable=true"])


def test_the_rollout_names_the_config_accepts_are_the_registered_engines():
    """``rollout.name`` is one of rollout.ROLLOUTS' engines, and each of them is accepted."""
    from hpc_verl.trainer.config.schema import ROLLOUT_NAMES
    from hpc_verl.trainer.rollout import ROLLOUTS

    assert set(ROLLOUT_NAMES) == set(ROLLOUTS)
