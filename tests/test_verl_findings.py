"""What upstream verl does with values its schema accepts: refused before submission where verl would
raise an hour later, a warning with the reason where it ignores them, notes in `hpc-verl plan`.

The rules were read off verl 0.9.1's source; the `source` tests re-read the installed verl so a
release that changes the behaviour fails here instead of keeping stale advice.
"""
from __future__ import annotations

import re

import pytest

from hpc_verl.errors import ConfigError
from hpc_verl.launch.spec.jobconfig import job_from_dict
from hpc_verl.launch.spec.trainer_check import validate_job_trainer
from hpc_verl.profiles import load_profile
from hpc_verl.verl_upstream import config as vconfig
from hpc_verl.verl_upstream import startup
from hpc_verl.verl_upstream import expiry, findings
from hpc_verl.verl_upstream.command import Allocation, build_verl_command

if vconfig.find_verl() is not None:
    startup.preload()  # verl's own check runs in this process: one import, not one per check


pytestmark = pytest.mark.skipif(vconfig.find_verl() is None, reason="upstream verl not installed")

BASE = {"actor_rollout_ref.rollout.name": "vllm", "data.train_batch_size": 256,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 64, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4, "critic.ppo_micro_batch_size_per_gpu": 2,
        "critic.ppo_mini_batch_size": 64, "trainer.save_freq": 10}


def review(extra: dict, nodes: int = 2, gpn: int = 8, **kw) -> list[findings.Finding]:
    overrides = [f"{k}={v}" for k, v in {**BASE, **extra}.items()]
    cmd = build_verl_command(overrides, Allocation(nodes, gpn, 8))
    return findings.review(cmd.resolved, findings.user_keys_of(cmd.user), cmd.verl_version, nodes, gpn, **kw)


def only(found, level):
    (f,) = [f for f in found if f.level == level]
    return f.message


def verl_source(rel: str) -> str:
    return (vconfig.require_verl().package_dir / rel).read_text()


# ----------------------------------------------------------------------------- the rules
def test_a_clean_config_has_no_findings():
    assert review({}) == []


def test_rollout_mode_sync_is_refused_on_verl_0_8_and_later():
    msg = only(review({"actor_rollout_ref.rollout.mode": "sync"}), "error")
    assert "removed in verl 0.8" in msg and "drop the override" in msg
    cfg = {"actor_rollout_ref": {"rollout": {"mode": "sync"}}}
    assert findings.review(cfg, set(), "0.7.1", 1, 8) == []  # older verl still had it


@pytest.mark.parametrize("old", ["actor_rollout_ref.actor.ppo_micro_batch_size",
                                 "actor_rollout_ref.rollout.log_prob_micro_batch_size"])
def test_micro_batch_and_its_per_gpu_twin_together(old):
    # verl's own validate_config refuses the pair: its message is the refusal, before the queue
    with pytest.raises(ConfigError) as e:
        review({old: 64})
    assert "refuses this config at start" in str(e.value) and "You have set both" in str(e.value)
    cfg = {"actor_rollout_ref": {"actor": {"ppo_micro_batch_size": 64, "ppo_micro_batch_size_per_gpu": 2},
                                 "rollout": {"log_prob_micro_batch_size": 64, "log_prob_micro_batch_size_per_gpu": 4}}}
    msg = only(findings.review(cfg, {old}, None, 2, 8), "error")  # the same rule where verl is not installed
    assert f"both {old} and {old}_per_gpu are set" in msg and "raises ValueError" in msg and f"drop {old}" in msg
    # with dynamic batch sizes verl checks neither and uses neither: a warning, not a refusal
    msg = only(review({old: 64, "actor_rollout_ref.actor.use_dynamic_bsz": "true"}), "warning")
    assert "ignore both" in msg


def test_critic_and_reference_pairs_only_when_those_models_run():
    # verl builds the critic's model config (it loads the model) before it checks the pair: without the
    # model's files here its check stops there, and our own rule still finds the pair
    assert any(f.level == "error" for f in review({"critic.ppo_micro_batch_size": 16,
                                                    "algorithm.adv_estimator": "gae"}))
    assert review({"critic.ppo_micro_batch_size": 16, "algorithm.adv_estimator": "grpo"}) == []
    ref = {"actor_rollout_ref.ref.log_prob_micro_batch_size": 64}
    assert review({**ref, "actor_rollout_ref.actor.use_kl_loss": "false", "algorithm.use_kl_in_reward": "false"}) == []
    with pytest.raises(ConfigError, match="actor_rollout_ref.ref.log_prob_micro_batch_size"):
        review({**ref, "actor_rollout_ref.actor.use_kl_loss": "true"})


def test_rollout_replica_spanning_nodes():
    msg = only(review({"actor_rollout_ref.rollout.tensor_model_parallel_size": 16}, transport="ethernet"), "warning")
    assert "TP 16 × DP 1 × PP 1 = 16 GPUs" in msg and "spans 2 nodes of 8 GPUs" in msg and "TCP sockets" in msg
    # data-parallel ranks of one replica count too
    msg = only(review({"actor_rollout_ref.rollout.tensor_model_parallel_size": 8,
                       "actor_rollout_ref.rollout.data_parallel_size": 2}), "warning")
    assert "= 16 GPUs" in msg and "TCP" not in msg
    assert "not a multiple of the 8 GPUs" in only(review({"actor_rollout_ref.rollout.tensor_model_parallel_size": 12}),
                                                  "error")
    assert "the allocation has 16" in only(review({"actor_rollout_ref.rollout.tensor_model_parallel_size": 32}),
                                           "error")
    assert review({"actor_rollout_ref.rollout.tensor_model_parallel_size": 8}) == []


def test_pipeline_parallel_rollout_is_refused_for_server_rollouts():
    msg = only(review({"actor_rollout_ref.rollout.tensor_model_parallel_size": 4,
                       "actor_rollout_ref.rollout.pipeline_model_parallel_size": 2}), "error")
    assert "NotImplementedError" in msg and "vllm" in msg


def test_keys_verl_accepts_but_ignores():
    msg = only(review({"actor_rollout_ref.nccl_timeout": 3600}), "warning")
    assert msg.startswith("actor_rollout_ref.nccl_timeout is accepted but ignored by verl 0.9.1")
    assert "timeout_second=None" in msg and "drop it" in msg
    # only what the job sets is its business, and only for the verl series the table was read from
    cmd = build_verl_command([f"{k}={v}" for k, v in {**BASE, "actor_rollout_ref.nccl_timeout": 3600}.items()],
                             Allocation(2, 8, 8))
    assert findings.review(cmd.resolved, findings.user_keys_of(cmd.user), "0.10.0", 2, 8) == []


def test_time_limit_warnings_only_for_slurm_jobs():
    assert review({}) == []
    found = review({"trainer.save_freq": -1, "trainer.esi_redundant_time": 100}, time_limited=True)
    msgs = {f.key: f.message for f in found}
    assert "writes no checkpoint at all" in msgs["trainer.save_freq"]
    assert "trainer.esi_redundant_time does nothing" in msgs["trainer.use_v1"]
    assert "trainer.use_v1" not in {f.key for f in review({"trainer.use_v1": "false"}, time_limited=True)}


# ----------------------------------------------------------------------------- the launcher
def _job(**extra):
    return job_from_dict({"name": "v", "trainer": {"module": "verl.trainer.main_ppo",
                                                   "overrides": {**BASE, **extra}}}, "job.yaml")


def test_errors_refuse_the_job_with_one_line(cli, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("trainer:\n  module: verl.trainer.main_ppo\n  overrides:\n" +
                   "".join(f"    {k}: {v}\n" for k, v in {**BASE, "actor_rollout_ref.rollout.mode": "sync"}.items()))
    out = tmp_path / "job.sbatch"
    res = cli("render", "--profile", "ib-a100", "--config", str(job), "-o", str(out))
    assert res.returncode == 2 and not out.exists() and "Traceback" not in res.stderr
    (line,) = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert line.startswith(f"hpc-verl: error: job config {job}:") and "mode=sync was removed" in line


def test_warnings_are_printed_and_kept(capsys):
    check = validate_job_trainer(load_profile("ib-a100"), _job(**{"actor_rollout_ref.nccl_timeout": 3600}))
    err = capsys.readouterr().err
    assert "hpc-verl: warning: actor_rollout_ref.nccl_timeout is accepted but ignored" in err
    assert any("nccl_timeout" in w for w in check.warnings)
    with pytest.raises(ConfigError, match="rollout replica needs"):
        validate_job_trainer(load_profile("ib-a100"), _job(**{"actor_rollout_ref.rollout.tensor_model_parallel_size":
                                                               64}))


def test_plan_shows_what_verl_will_do_as_notes(cli):
    res = cli("plan", "--profile", "ib-a100", "--nodes", "2", "--format", "json")
    assert res.returncode == 0, res.stderr
    import json
    notes = {r["key"]: r for r in json.loads(res.stdout)["rows"] if r["kind"] == "note"}
    assert "writes no checkpoint" in notes["trainer.save_freq"]["reason"]
    assert notes["trainer.use_v1"]["value"] == "warning"
    local = json.loads(cli("plan", "--profile", "local", "--nodes", "1", "--format", "json").stdout)
    # no time limit, nothing verl would mind; only the CPU ranks against the CPUs (a fact of the machine)
    assert [r["key"] for r in local["rows"] if r["kind"] == "note"] == ["CPU ranks"]


# ----------------------------------------------------------------------------- verl's source, re-read
def test_source_expiry_variable_and_units():
    src = verl_source("utils/checkpoint/checkpoint_manager.py")
    body = src[src.index("def should_save_ckpt_esi"):]  # the last function of the file
    assert f'os.getenv("{expiry.EXPIRY_ENV}")' in body
    assert "float(exp_ts_mlp) - time.time()" in body  # Unix seconds, compared with time.time()
    assert f"save_ckpt_duration: float = {expiry.VERL_SAVE_ESTIMATE_S}" in body


def test_source_only_the_legacy_trainer_saves_before_expiry():
    pkg = vconfig.require_verl().package_dir
    assert "should_save_ckpt_esi(" in verl_source("trainer/ppo/ray_trainer.py")
    v1 = [p for p in (pkg / "trainer" / "ppo" / "v1").glob("*.py") if "should_save_ckpt_esi" in p.read_text()]
    assert v1 == []
    cfg = verl_source("trainer/config/ppo_trainer.yaml")
    assert re.search(r"^\s+use_v1: true$", cfg, re.M)


def test_source_ignored_keys_are_read_nowhere():
    pkg = vconfig.require_verl().package_dir
    code = "\n".join(p.read_text(errors="replace") for p in pkg.rglob("*.py"))
    for key in findings.IGNORED_KEYS:
        leaf = key.rsplit(".", 1)[-1]
        uses = [m.group(0) for m in re.finditer(rf"[.\"']{leaf}\b[\"']?", code)]
        assert not uses, f"verl reads {leaf} now: {uses[:3]}"
    assert "initialize_global_process_group_ray(timeout_second=None)" in verl_source("workers/engine_workers.py")


def test_source_rollout_rules():
    rollout = verl_source("workers/config/rollout.py")
    assert "Rollout mode 'sync' has been removed" in rollout
    assert "not implemented pipeline_model_parallel_size > 1 yet" in rollout
    replica = verl_source("workers/rollout/replica.py")
    assert re.search(r"tensor_model_parallel_size\s*\*\s*self\.config\.data_parallel_size\s*\*\s*"
                     r"self\.config\.pipeline_model_parallel_size", replica)
    assert "must be divisible by gpus_per_node" in replica


def test_source_micro_batch_pairs_are_checked_where_the_rules_say():
    for old, per_gpu, _dyn, where in findings.MICRO_BATCH_PAIRS:
        rel = re.search(r"\((verl/[^)]+)\)", where).group(1).removeprefix("verl/")
        src = verl_source(rel)
        assert old.rsplit(".", 1)[-1] in src and per_gpu.rsplit(".", 1)[-1] in src, (old, rel)
        assert "You have set both" in src or "_check_mutually_exclusive" in src, rel


def test_too_few_cpus_for_verls_placement_groups(capsys):
    src = verl_source("single_controller/ray/base.py")
    assert f"max_colocate_count: int = {findings.VERL_CPUS_PER_GPU}" in src
    assert 'bundle = {"CPU": self.max_colocate_count}' in src
    msg = only(review({}, cpus_per_node=16), "warning")  # 8 GPUs per node need 24
    assert "reserves 3 CPUs per GPU" in msg and "at least 24" in msg
    assert review({}, cpus_per_node=24) == []
    validate_job_trainer(load_profile("ib-a100", ["slurm.cpus_per_task=8"]), _job())
    assert "set slurm.cpus_per_task to at least 24" in capsys.readouterr().err
