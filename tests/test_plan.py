"""hpc-verl plan: recommendations that compose against verl's real config and pass the
same arithmetic a submission must pass, scaled by node count, model size and GPU memory."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hpc_verl.errors import ConfigError
from hpc_verl.ops.scaling import gpu_memory_for, make_plan, parse_model_size, verify_plan
from hpc_verl.profiles import load_profile
from hpc_verl.verl_upstream import config as vconfig
from hpc_verl.verl_upstream.command import Allocation, build_verl_command


def rows(plan):
    return {r.key: r for r in plan.rows}


@pytest.mark.parametrize("profile,nodes,size", [("ib-a100", 1, "7B"), ("ib-a100", 4, "7B"), ("ib-a100", 2, "70B"),
                                                ("eth-l40s", 3, "7B"), ("mi300x-rocm", 2, "32B"),
                                                ("roce-h100", 8, "1.5B")])
def test_plan_overrides_are_accepted_by_the_verl_launcher(profile, nodes, size):
    p = load_profile(profile)
    plan = make_plan(p, nodes, size, schema=vconfig.schema())
    assert verify_plan(plan, vconfig.schema()) == []
    # exactly what a user pastes after 'submit': keys valid, composes, arithmetic holds
    cmd = build_verl_command(plan.overrides, Allocation(nodes, p.slurm.gpus_per_node, p.slurm.cpus_per_task))
    assert "actor_rollout_ref.rollout.name=vllm" in cmd.overrides


def test_batch_scales_with_nodes():
    p = load_profile("ib-a100")
    tbs = [int(rows(make_plan(p, n))["data.train_batch_size"].value) for n in (1, 2, 4, 8)]
    assert tbs == [1024, 2048, 4096, 8192]
    assert "4 node(s)" in rows(make_plan(p, 4))["data.train_batch_size"].reason


def test_batch_rounded_to_gpu_multiple_with_rollout_n():
    p = load_profile("mi300x-rocm")   # 8 GPUs per node
    plan = make_plan(p, 3, "7B", rollout_n=5)
    tbs = int(rows(plan)["data.train_batch_size"].value)
    assert (tbs * 5) % 24 == 0 and verify_plan(plan, None) == []


def test_tp_and_offload_follow_model_size_and_gpu_memory():
    p = load_profile("eth-l40s")  # 4 x 48 GB per node
    small = rows(make_plan(p, 1, "1.5B"))
    assert small["actor_rollout_ref.rollout.tensor_model_parallel_size"].value == "1"
    assert small["actor_rollout_ref.actor.fsdp_config.optimizer_offload"].value == "False"
    big = rows(make_plan(p, 1, "32B"))
    assert int(big["actor_rollout_ref.rollout.tensor_model_parallel_size"].value) == 4
    assert big["actor_rollout_ref.actor.fsdp_config.optimizer_offload"].value == "True"
    assert big["actor_rollout_ref.actor.fsdp_config.param_offload"].value == "True"
    assert "offload" in big["actor_rollout_ref.actor.fsdp_config.optimizer_offload"].reason
    # the same model on bigger GPUs keeps everything on the GPU
    roomy = rows(make_plan(p, 1, "7B", gpu_mem_gb=80))
    assert roomy["actor_rollout_ref.actor.fsdp_config.optimizer_offload"].value == "False"
    assert float(roomy["actor_rollout_ref.rollout.gpu_memory_utilization"].value) == 0.9
    tight = rows(make_plan(p, 1, "14B", gpu_mem_gb=24))
    assert float(tight["actor_rollout_ref.rollout.gpu_memory_utilization"].value) < 0.9


def test_critic_offload_key_is_the_installed_verls():
    schema = vconfig.schema()
    if schema is None:
        pytest.skip("verl not installed")
    keys = rows(make_plan(load_profile("ib-a100"), 1, "7B", schema=schema))
    critic = [k for k in keys if k.startswith("critic.") and k.endswith("optimizer_offload")]
    assert critic and critic[0] in schema.keys


def test_every_row_has_a_reason_and_env_advice():
    plan = make_plan(load_profile("ib-a100"), 2)
    assert all(r.reason for r in plan.rows)
    tok = rows(plan)["TOKENIZERS_PARALLELISM"]
    assert tok.kind == "env" and tok.value == "false"
    assert "TOKENIZERS_PARALLELISM=false" not in plan.overrides  # env, not a Hydra override


def test_gpu_memory_lookup_and_errors():
    assert gpu_memory_for(load_profile("ib-a100"))[0] == 80
    assert gpu_memory_for(load_profile("mi300x-rocm"))[0] == 192
    assert gpu_memory_for(load_profile("local"))[0] is None
    with pytest.raises(ConfigError, match="--gpu-mem-gb"):
        gpu_memory_for(dataclasses.replace(load_profile("ib-a100"), name="mystery", description="some GPUs"))
    assert gpu_memory_for(load_profile("ib-a100"), 40.0) == (40.0, "--gpu-mem-gb")
    assert parse_model_size("500M") == 0.5 and parse_model_size("7b") == 7
    with pytest.raises(ConfigError, match="--model-size"):
        parse_model_size("seven")


def test_cli_formats(cli):
    res = cli("plan", "--profile", "ib-a100", "--nodes", "4", "--format", "overrides")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split()
    assert "data.train_batch_size=4096" in lines and all("=" in ln for ln in lines)
    table = cli("plan", "--profile", "ib-a100", "--nodes", "2", "--model-size", "70B")
    assert table.returncode == 0 and "optimizer_offload" in table.stdout and "why" in table.stdout
    js = json.loads(cli("plan", "--profile", "local", "--nodes", "1", "--format", "json").stdout)
    assert js["gpu_mem_gb"] is None and "actor_rollout_ref.rollout.name=hf" in js["overrides"]
    bad = cli("plan", "--profile", "local", "--nodes", "3")
    assert bad.returncode == 2 and "local" in bad.stderr and "Traceback" not in bad.stderr


def test_yaml_format_is_a_valid_verl_job(cli, tmp_path):
    """The yaml block pasted into a verl job file passes the submission checks."""
    import yaml

    from hpc_verl.launch.spec.jobconfig import load_job_config
    from hpc_verl.launch.spec.trainer_check import validate_job_trainer

    res = cli("plan", "--profile", "ib-a100", "--nodes", "2", "--format", "yaml")
    assert res.returncode == 0, res.stderr
    block = yaml.safe_load(res.stdout)
    assert block["trainer"]["overrides"]["data.train_batch_size"] == 2048
    block["trainer"]["module"] = "verl.trainer.main_ppo"
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(block))
    check = validate_job_trainer(load_profile("ib-a100"), load_job_config(str(tmp_path / "job.yaml")))
    assert check.kind == "verl"
