"""Upstream verl as a trainer: its real config (verl 0.9.1 files, composed with Hydra),
override validation with did-you-mean, the main_ppo command and the batch arithmetic."""
from __future__ import annotations

import warnings

import pytest

from hpc_verl.errors import ConfigError
from hpc_verl.util.batch_rules import check_ppo_arithmetic
from hpc_verl.verl_upstream import command as vcmd
from hpc_verl.verl_upstream import config as vconfig
from hpc_verl.verl_upstream import startup
from hpc_verl.verl_upstream.command import Allocation, build_verl_command
from hpc_verl.verl_upstream.overrides import check_overrides, parse_override, parse_overrides, suggest_key

if vconfig.find_verl() is not None:
    startup.preload()  # verl's own check runs in this process: one import, not one per check


needs_verl = pytest.mark.skipif(vconfig.find_verl() is None, reason="upstream verl not installed")
ROLLOUT = "actor_rollout_ref.rollout.name=vllm"
A100x2 = Allocation(2, 8, 64, "profile 'ib-a100' (2 nodes)")
#: what verl's validate_config requires of a job without dynamic batch sizes
MICRO = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=4"]


@pytest.fixture(scope="module")
def schema():
    s = vconfig.schema()
    if s is None:
        pytest.skip("upstream verl not installed")
    return s


# ----------------------------------------------------------------------------- the key set
@needs_verl
def test_composed_key_set_has_the_keys_users_set(schema):
    for key in ("actor_rollout_ref.rollout.gpu_memory_utilization", "data.train_batch_size", "trainer.nnodes",
                "trainer.n_gpus_per_node", "ray_kwargs.ray_init.num_cpus", "actor_rollout_ref.rollout.name",
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                "actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.ppo_mini_batch_size"):
        assert key in schema.keys, key
    # containers are keys too (overrides may set a whole section), leaves have defaults
    assert "actor_rollout_ref.rollout" in schema.keys
    assert schema.defaults["trainer.nnodes"] == 1
    assert schema.source == "hydra" and len(schema.keys) > 500


@needs_verl
def test_hydra_composition_matches_the_shipped_snapshot(schema):
    """Composing the defaults list ourselves and verl's flattened snapshot agree
    (up to defaults-list group names, which are not config values)."""
    snap = vconfig.load_schema(str(vconfig.find_verl().package_dir), use_hydra=False)
    assert snap.source.startswith("_generated")
    assert snap.keys <= schema.keys
    assert schema.keys - snap.keys <= schema.groups


# ----------------------------------------------------------------------------- overrides
def test_parse_override_forms():
    assert parse_override("a.b=1").op == "set"
    assert parse_override("+a.b=1").op == "add"
    assert parse_override("++a.b=1").op == "force_add"
    d = parse_override("~a.b")
    assert d.op == "delete" and d.value is None
    with pytest.raises(ConfigError, match="expected key=value"):
        parse_override("trainer.nnodes")
    with pytest.raises(ConfigError, match="not a dotted config key"):
        parse_override("trainer nnodes=2")


@needs_verl
@pytest.mark.parametrize("typo,meant", [
    ("trainer.nnode", "trainer.nnodes"),
    ("actor_rollout_ref.rollout.gpu_memory_utilisation", "actor_rollout_ref.rollout.gpu_memory_utilization"),
    ("actor_rollout_ref.rollout.tensor_parallel_size", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("data.train_batch", "data.train_batch_size"),
    ("trainer.total_epoch", "trainer.total_epochs"),
])
def test_did_you_mean_on_full_dotted_keys(schema, typo, meant):
    assert suggest_key(typo, schema.keys) == meant
    (line,) = check_overrides(parse_overrides([f"{typo}=1"]), schema)
    assert f"unknown key '{typo}'" in line and f"did you mean '{meant}'" in line and "\n" not in line


@needs_verl
def test_no_suggestion_for_nonsense(schema):
    assert suggest_key("trainer.zzzzqqq", schema.keys) is None


@needs_verl
def test_append_force_delete_and_groups(schema):
    ok = parse_overrides(["+trainer.my_new_key=1", "++trainer.nnodes=2", "model_engine=dp", "~trainer.logger",
                          "trainer.logger=[console,wandb]"])
    assert check_overrides(ok, schema) == []
    (line,) = check_overrides(parse_overrides(["+trainer.nnodes=2"]), schema)
    assert "already exists" in line and "drop the '+'" in line
    (line,) = check_overrides(parse_overrides(["trainer.nnodes=two"]), schema)
    assert "expects an integer" in line
    (line,) = check_overrides(parse_overrides(["actor_rollout_ref.actor.fsdp_config.param_offload=yes"]), schema)
    assert "true or false" in line


# ----------------------------------------------------------------------------- command
@needs_verl
def test_command_derives_allocation_and_composes():
    cmd = build_verl_command([ROLLOUT, "data.train_batch_size=1024", "trainer.total_epochs=2", *MICRO], A100x2)
    assert cmd.argv[:3] == ["python3", "-m", "verl.trainer.main_ppo"]
    assert cmd.derived == ["trainer.nnodes=2", "trainer.n_gpus_per_node=8"]
    assert cmd.env_required == ["RAY_ADDRESS"] and cmd.verl_version
    cfg = vcmd.resolved_config(cmd.overrides)
    assert cfg["trainer"]["nnodes"] == 2 and cfg["trainer"]["n_gpus_per_node"] == 8
    assert cfg["actor_rollout_ref"]["rollout"]["name"] == "vllm"
    assert cfg["ray_kwargs"]["ray_init"]["num_cpus"] is None


def test_allocation_values_are_never_typed_twice():
    same = build_verl_command([ROLLOUT, "trainer.nnodes=2"], A100x2, check_keys=False)
    assert same.overrides.count("trainer.nnodes=2") == 1
    with pytest.raises(ConfigError) as e:
        build_verl_command([ROLLOUT, "trainer.nnodes=4"], A100x2, check_keys=False)
    assert "trainer.nnodes=4" in str(e.value) and "has 2 nodes" in str(e.value)
    with pytest.raises(ConfigError, match="has 8 GPUs per node"):
        build_verl_command([ROLLOUT, "trainer.n_gpus_per_node=4"], A100x2, check_keys=False)


def test_num_cpus_depends_on_who_starts_ray():
    with pytest.raises(ConfigError, match="Ray refuses num_cpus when connecting"):
        build_verl_command([ROLLOUT, "ray_kwargs.ray_init.num_cpus=8"], A100x2, check_keys=False)
    own = build_verl_command([ROLLOUT], Allocation(1, 8, 64), attach_to_ray=False, check_keys=False)
    assert "ray_kwargs.ray_init.num_cpus=64" in own.derived and own.env_required == []


def test_rollout_name_is_required():
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.name' is required"):
        build_verl_command(["data.train_batch_size=1024"], A100x2, check_keys=False)


@needs_verl
def test_misspelt_override_refused_with_did_you_mean():
    with pytest.raises(ConfigError) as e:
        build_verl_command([ROLLOUT, "actor_rollout_ref.rollout.gpu_memory_utilisation=0.9"], A100x2)
    msg = str(e.value)
    assert "did you mean 'actor_rollout_ref.rollout.gpu_memory_utilization'" in msg and "\n" not in msg


@needs_verl
def test_batch_not_dividing_gpus_refused_with_numbers():
    with pytest.raises(ConfigError) as e:
        build_verl_command([ROLLOUT, "data.train_batch_size=1000"], A100x2)
    msg = str(e.value)
    assert "1000" in msg and "16 GPUs" in msg and "992 or 1008" in msg


def test_without_verl_keys_are_skipped_with_a_warning(monkeypatch):
    monkeypatch.setattr(vconfig, "find_verl", lambda: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cmd = build_verl_command([ROLLOUT, "trainer.nnode=3"], A100x2)
    assert any("not installed" in str(w.message) for w in caught)
    assert cmd.warnings and "trainer.nnode=3" in cmd.user
    # arithmetic still runs on the user's own values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="not divisible"):
            build_verl_command([ROLLOUT, "data.train_batch_size=1000"], A100x2)


# ----------------------------------------------------------------------------- arithmetic
def _cfg(tbs=1024, n=1, tp=2, mini=256, micro=None, sp=1, dyn=False, critic=True):
    actor = {"ppo_mini_batch_size": mini, "ppo_micro_batch_size_per_gpu": micro,
             "ulysses_sequence_parallel_size": sp, "use_dynamic_bsz": dyn}
    cfg = {"data": {"train_batch_size": tbs},
           "actor_rollout_ref": {"actor": actor, "rollout": {"n": n, "tensor_model_parallel_size": tp}},
           "algorithm": {"adv_estimator": "gae" if critic else "grpo"}}
    if critic:
        cfg["critic"] = {"ppo_mini_batch_size": mini, "ppo_micro_batch_size_per_gpu": micro}
    return cfg


def test_arithmetic_good_config_passes():
    assert check_ppo_arithmetic(_cfg(micro=4), 2, 8) == []


def test_arithmetic_batch_times_n():
    (msg,) = check_ppo_arithmetic(_cfg(tbs=100, n=1, mini=16, critic=False), 2, 8)[:1]
    assert "data.train_batch_size (100)" in msg and "16 GPUs" in msg
    # rollout.n makes up for it: 100 × 4 = 400 = 16 × 25
    assert not [p for p in check_ppo_arithmetic(_cfg(tbs=100, n=4, mini=64, critic=False), 2, 8)
                if "train_batch_size (100)" in p]


def test_arithmetic_tp_and_micro_batches():
    probs = check_ppo_arithmetic(_cfg(tp=3, critic=False), 1, 8)
    assert any("tensor_model_parallel_size (3) does not divide the 8 GPUs per node" in p for p in probs)
    probs = check_ppo_arithmetic(_cfg(micro=3, critic=False), 2, 8)
    assert any("ppo_micro_batch_size_per_gpu (3) does not divide the per-GPU mini-batch 16" in p for p in probs)
    probs = check_ppo_arithmetic(_cfg(mini=24, critic=False), 2, 8)
    assert any("24" in p and "16 data-parallel ranks" in p for p in probs)
    probs = check_ppo_arithmetic(_cfg(tbs=128, mini=256, critic=False), 2, 8)
    assert any("actor_rollout_ref.actor.ppo_mini_batch_size (256) is larger than data.train_batch_size (128)" in p
               for p in probs)
    # the critic has its own mini/micro batches
    assert any(p.startswith("critic.") for p in check_ppo_arithmetic(_cfg(micro=3), 2, 8))
    # dynamic batch sizes skip the per-GPU checks, as verl does
    assert check_ppo_arithmetic(_cfg(tbs=1000, dyn=True, micro=3, critic=False), 2, 8) == []


def test_arithmetic_on_flat_keys():
    flat = {"data.train_batch_size": 1000, "actor_rollout_ref.rollout.n": 1}
    (msg,) = check_ppo_arithmetic(flat, 2, 8)
    assert "1000" in msg


def test_ray_itself_refuses_num_cpus_when_attaching():
    """Why num_cpus is not derived in attach mode: verl's main_ppo calls
    ray.init(**ray_kwargs.ray_init) and, with RAY_ADDRESS set, Ray raises before
    connecting (port 1: nothing is started or reached)."""
    import os
    import subprocess
    import sys
    pytest.importorskip("ray")
    code = ("import ray\ntry:\n ray.init(num_cpus=2)\nexcept ValueError as e:\n print('REFUSED', e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1", "RAY_USAGE_STATS_ENABLED": "0"})
    assert "REFUSED" in res.stdout and "num_cpus" in res.stdout, res.stdout + res.stderr


@needs_verl
def test_delete_needs_an_existing_key(schema):
    (line,) = check_overrides(parse_overrides(["~trainer.loger"]), schema)
    assert "cannot delete 'trainer.loger'" in line and "did you mean 'trainer.logger'" in line


@needs_verl
def test_without_hydra_keys_come_from_verls_snapshot(monkeypatch):
    snap = vconfig.load_schema(str(vconfig.find_verl().package_dir), use_hydra=False)
    monkeypatch.setattr(vconfig, "schema", lambda use_hydra=True, **_: snap)
    cmd = build_verl_command([ROLLOUT, "data.train_batch_size=1024"], A100x2)
    assert any("hydra-core is not installed" in w for w in cmd.warnings)
    with pytest.raises(ConfigError, match="did you mean 'trainer.nnodes'"):
        build_verl_command([ROLLOUT, "trainer.nnode=2"], A100x2)
    # defaults fill in what the user did not set: verl's mini-batch 256 on 24 GPUs does not split
    with pytest.raises(ConfigError, match="256"):
        build_verl_command([ROLLOUT, "data.train_batch_size=1032"], Allocation(3, 8, 64))


# ----------------------------------------------------------------------------- the config verl builds
GRPO = [ROLLOUT, "algorithm.adv_estimator=grpo", "data.train_batch_size=64", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16", *MICRO[:2]]


def refusal(overrides, alloc=A100x2, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        build_verl_command(overrides, alloc, **kw)
    assert "\n" not in str(e.value)
    return str(e.value)


@needs_verl
def test_key_added_with_plus_that_verls_dataclass_lacks_is_refused_with_verls_own_reason():
    msg = refusal([*GRPO, "+actor_rollout_ref.actor.policy_loss.tau_pos=1.0"])
    assert "PolicyLossConfig" in msg and "has no field 'tau_pos'" in msg
    # verl's own check says the same when our key check is not the one to catch it (a forced add)
    msg = refusal([*GRPO, "++actor_rollout_ref.actor.policy_loss.tau_pos=1.0"])
    assert "refuses this config at start" in msg and "unexpected keyword argument 'tau_pos'" in msg


@needs_verl
def test_types_come_from_verls_dataclass_annotations():
    build_verl_command([*GRPO, "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0"], A100x2)  # str | float
    assert "expects an integer" in refusal([*GRPO, "actor_rollout_ref.actor.ppo_mini_batch_size=lots"])


@needs_verl
def test_megatron_keys_are_known_and_its_data_parallel_size_is_gpus_over_tp_pp_cp():
    meg = [*GRPO, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]
    for choice, hydra in ((["model_engine=megatron"], ()), ([], ["--config-name", "ppo_megatron_trainer"]),
                          ([], ["--config-name=ppo_megatron_trainer.yaml"])):
        cmd = build_verl_command([*meg, *choice], A100x2, hydra_args=hydra)
        assert cmd.resolved["actor_rollout_ref"]["actor"]["strategy"] == "megatron"
    # 16 GPUs / (TP 2 × PP 2) = 4 data-parallel ranks: 64 × 4 / 4 = 64 samples per rank, which a log-prob
    # micro-batch of 48 does not divide (on all 16 GPUs as data parallel, 16 per rank, it would be "larger")
    msg = refusal([*meg, "model_engine=megatron", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=48"])
    assert "the 64 samples each of the 4 data-parallel ranks" in msg
    # without the engine choice the Megatron keys do not exist (verl's default engine is FSDP)
    assert "unknown key 'actor_rollout_ref.actor.megatron.tensor_model_parallel_size'" in refusal(meg)


@needs_verl
def test_group_at_package_choices_compose():
    cmd = build_verl_command([*GRPO, "actor@actor_rollout_ref.actor=megatron_actor",
                              "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"], A100x2)
    assert cmd.resolved["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] == 2
    assert "config group 'actr' does not exist" in refusal([*GRPO, "actr@actor_rollout_ref.actor=megatron_actor"])


@needs_verl
def test_hydra_settings_pass_through():
    cmd = build_verl_command([*GRPO, "hydra.run.dir=/tmp/x", "hydra.job.chdir=false"], A100x2)
    assert "hydra.run.dir=/tmp/x" in cmd.overrides


@needs_verl
@pytest.mark.parametrize("override, needle", [
    ("actor_rollout_ref.rollout.val_temperature=0.6",
     "calls this setting 'actor_rollout_ref.rollout.val_kwargs.temperature'"),
    ("actor_rollout_ref.rollout.n_val=4", "'actor_rollout_ref.rollout.val_kwargs.n'"),
    ("actor_rollout_ref.actor.fsdp_config.grad_offload=true", "removed it (last in verl 0.2)"),
    ("ray_init.num_cpus=8", "calls this setting 'ray_kwargs.ray_init.num_cpus'"),
])
def test_a_port_from_an_older_verl_gets_verls_own_successor_or_removal(override, needle):
    msg = refusal([*GRPO, override])
    assert needle in msg and "did you mean" not in msg


@needs_verl
def test_did_you_mean_only_when_likely_else_the_sections_keys():
    # a close name, but 'x' is no temperature: no guess, the section's keys instead
    msg = refusal([*GRPO, "actor_rollout_ref.rollout.temprature=x"])
    assert "did you mean" not in msg and "keys under 'actor_rollout_ref.rollout':" in msg
    msg = refusal([*GRPO, "actor_rollout_ref.rollout.temprature=0.7"])
    assert "did you mean 'actor_rollout_ref.rollout.temperature'" in msg
    msg = refusal([*GRPO, "trainer.wibble=3"])
    assert "keys under 'trainer':" in msg and "total_epochs" in msg


@needs_verl
def test_every_finding_of_one_check_on_one_line():
    msg = refusal([*GRPO, "trainer.nnode=2", "trainer.total_epoch=3"])
    assert msg.index("trainer.nnode") < msg.index("and 1 more") < msg.index("trainer.total_epoch")


@needs_verl
def test_verls_check_runs_in_a_child_python_when_verl_is_not_imported_here(tmp_path):
    """The CLI's path: verl's modules are not in the process, so its check runs in a child Python."""
    import subprocess
    import sys

    code = ("import sys\nfrom hpc_verl.verl_upstream import startup, config\n"
            "assert not startup._in_process()\n"
            "i = config.require_verl()\n"
            "r = startup.run_checks(str(i.config_dir), 'ppo_trainer', sys.argv[1:])\n"
            "assert 'verl' not in sys.modules, 'verl was imported into the checking process'\n"
            "print(r.problem)\n")
    res = subprocess.run([sys.executable, "-c", code, ROLLOUT, "trainer.nnodes=1", "trainer.n_gpus_per_node=8",
                          "+actor_rollout_ref.actor.policy_loss.tau_pos=1.0"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    assert "PolicyLossConfig" in res.stdout and "tau_pos" in res.stdout


@needs_verl
def test_verls_verdict_is_kept_for_the_same_request(tmp_path, monkeypatch):
    """validate, render and submit of one job pay verl's import once: the second check of the same
    request reads the kept verdict (no child Python: subprocess.run would fail here)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(startup, "_in_process", lambda: False)
    install = vconfig.require_verl()
    args = [ROLLOUT, "trainer.nnodes=1", "trainer.n_gpus_per_node=8", "+actor_rollout_ref.actor.policy_loss.tau_pos=1"]
    first = startup.run_checks(str(install.config_dir), "ppo_trainer", args)
    assert first.problem and "tau_pos" in first.problem
    monkeypatch.setattr(startup.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert startup.run_checks(str(install.config_dir), "ppo_trainer", args) == first
