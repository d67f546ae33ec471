"""Usable CPUs (hpc_verl.util.cpus) and the trainer's check of CPU ranks against them."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_verl.util import cpus
from trainer_fixtures import digits_data, tiny_model  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


def _cgroup(tmp_path: Path, quota: str) -> Path:
    rel = Path("/proc/self/cgroup").read_text().splitlines()
    line = next((ln for ln in rel if ln.startswith("0::")), None)
    if line is None:
        pytest.skip("no cgroup v2 entry in /proc/self/cgroup")
    d = tmp_path / line.split(":", 2)[2].lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    (d / "cpu.max").write_text(quota + "\n")
    return tmp_path


def test_the_smallest_limit_wins(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    base = cpus.usable_cpus({}, cgroup_root=str(tmp_path / "none"))
    assert (base.count, base.source) == (affinity, "CPU affinity")
    got = cpus.usable_cpus({}, cgroup_root=str(_cgroup(tmp_path / "q", "150000 100000")))
    assert (got.count, got.source) == ((2, "cgroup cpu.max quota") if affinity > 2 else (affinity, "CPU affinity"))
    got = cpus.usable_cpus({}, cgroup_root=str(_cgroup(tmp_path / "half", "50000 100000")))
    assert (got.count, got.source) == (1, "cgroup cpu.max quota")   # rounded up, never 0
    assert cpus.usable_cpus({}, cgroup_root=str(_cgroup(tmp_path / "max", "max 100000"))).count == affinity
    got = cpus.usable_cpus({"SLURM_CPUS_ON_NODE": "4", "SLURM_CPUS_PER_TASK": "1"}, cgroup_root=str(tmp_path))
    assert (got.count, got.source) == (1, "SLURM_CPUS_PER_TASK")


def test_the_refusal_names_cpus_ranks_and_keys():
    two = cpus.UsableCpus(2, "CPU affinity")
    assert cpus.rank_problem(2, two, "trainer.n_gpus_per_node") is None
    line = cpus.rank_problem(8, two, "trainer.n_gpus_per_node")
    assert "\n" not in line and "8 CPU ranks" in line and "2 usable CPU(s) (CPU affinity)" in line
    assert "trainer.n_gpus_per_node to at most 2" in line and "hpc_verl.allow_cpu_oversubscribe=true" in line


def _train(work: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(REPO), HPC_VERL_HOME=str(work / "home"), **(env or {}))
    e.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "hpc_verl", "train", "--config",
                           str(REPO / "examples" / "ppo_digits_tiny.yaml"), *args], cwd=work, env=e,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_too_many_cpu_ranks_are_refused_unless_opted_in(tmp_path, tiny_model, digits_data):
    (tmp_path / "models").mkdir()
    (tmp_path / "data").mkdir()
    (tmp_path / "models" / "tiny").symlink_to(tiny_model)
    (tmp_path / "data" / "digits").symlink_to(digits_data)
    slurm = {"SLURM_CPUS_PER_TASK": "2"}   # (2 usable CPUs wherever this runs: SLURM's variable is one limit)
    res = _train(tmp_path, "trainer.n_gpus_per_node=8", "--check", env=slurm)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "trainer.n_gpus_per_node=8 asks for 8 CPU ranks per node" in lines[0]
    assert "2 usable CPU(s)" in lines[0] and "hpc_verl.allow_cpu_oversubscribe=true" in lines[0]

    res = _train(tmp_path, "trainer.n_gpus_per_node=8", "hpc_verl.allow_cpu_oversubscribe=true", "--check", env=slurm)
    warned = [ln for ln in res.stderr.splitlines() if "warning" in ln]
    assert res.returncode == 0, res.stderr
    assert len(warned) == 1 and "oversubscribed" in warned[0], res.stderr
    assert "CPU ranks per node: 8 on 2 usable CPU(s)" in res.stdout and "(oversubscribed)" in res.stdout

    res = _train(tmp_path, "trainer.n_gpus_per_node=2", "--dry-run", env=slurm)
    assert res.returncode == 0 and "CPU ranks per node: 2 on 2 usable CPU(s)" in res.stdout, res.stderr
    assert "(fits)" in res.stdout


def test_plan_and_doctor_count_a_cpu_profiles_ranks_against_its_cpus():
    # a SLURM profile seen from a login node: what it asks SLURM for per task
    line, problem = cpus.profile_rank_check("slurm", 4, env={})
    assert problem is None and line == "CPU ranks per node: 1 on 4 usable CPU(s) (slurm.cpus_per_task) (fits)"
    # inside the job (or a local profile): the CPUs this process may use; more ranks than those are refused
    line, problem = cpus.profile_rank_check("slurm", 4, env={"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "1"}, ranks=3)
    assert "3 on 1 usable CPU(s) (" in line and "(oversubscribed)" in line
    assert "trainer.n_gpus_per_node to at most 1" in problem
    from hpc_verl.ops.doctor import OK, SKIP, Context, Expectations
    from hpc_verl.ops.doctor_job import check_cpu_ranks
    r = check_cpu_ranks(Expectations(scheduler="slurm", cpus_per_task=8, accelerator="none"), Context(env={}))
    assert r.status == OK and "1 on 8 usable CPU(s)" in r.detail
    assert check_cpu_ranks(Expectations(accelerator="nvidia", gpus_per_node=4), Context(env={})).status == SKIP
    from hpc_verl.verl_upstream.cpu.rules import LOGICAL_GPUS_PER_NODE
    assert LOGICAL_GPUS_PER_NODE == cpus.CPU_PROFILE_RANKS_PER_NODE     # one rule for both trainers


def test_pin_cpus_puts_every_thread_of_a_rank_on_its_core():
    from hpc_verl.errors import ConfigError
    from hpc_verl.trainer.config.schema import load_config
    assert load_config(None, ["hpc_verl.pin_cpus=[0, 1]"])["hpc_verl"]["pin_cpus"] == [0, 1]
    for bad in ("[]", "[-1]", "[a]"):
        with pytest.raises(ConfigError, match="hpc_verl.pin_cpus"):
            load_config(None, [f"hpc_verl.pin_cpus={bad}"])
    # in a fresh process with a second thread already running: both end on the one CPU
    code = ("import os, threading, time, sys\n"
            "from hpc_verl.trainer.engine.device import setup_threads\n"
            "t = threading.Thread(target=time.sleep, args=(2,)); t.start()\n"
            "cpu = max(os.sched_getaffinity(0))\n"
            "setup_threads({'hpc_verl': {'pin_cpus': [cpu]}})\n"
            "masks = {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir('/proc/self/task')}\n"
            "print(cpu, len(masks), all(m == {cpu} for m in masks.values()))\n"
            "try:\n    setup_threads({'hpc_verl': {'pin_cpus': [4096]}})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    first, second = res.stdout.strip().splitlines()
    assert int(first.split()[1]) >= 2 and first.endswith("True"), res.stdout + res.stderr
    assert second.startswith("ConfigError") and "CPU 4096 is not one this process may run on" in second


def test_a_cpu_profile_gives_each_node_several_ranks(tmp_path, cli):
    """cpu.ranks_per_node: verl gets n_gpus_per_node=K and Ray K logical GPUs per node (a TP=2 replica fits in
    one node); the built-in trainer K CPU ranks; refused on GPU profiles, past the task's CPUs, misspelt."""
    from hpc_verl.errors import ProfileError
    from hpc_verl.launch.spec.jobconfig import load_job_config
    from hpc_verl.launch.spec.render import derived_overrides, render_sbatch
    from hpc_verl.launch.spec.trainer_check import validate_job_trainer
    from hpc_verl.profiles import load_profile

    profile = load_profile("local", ["cpu.ranks_per_node=2"])
    job = load_job_config(str(REPO / "examples" / "job_verl_cpu.yaml"))
    job.trainer.overrides.update({"actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
                                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4})
    check = validate_job_trainer(profile, job)
    assert "trainer.n_gpus_per_node=2" in check.command.derived
    script = render_sbatch(profile, job, job_id=7)
    assert "export HPCV_RAY_GPUS_PER_NODE=2" in script and "export HPCV_RAY_NUM_CPUS=9" in script
    assert dict(derived_overrides(profile, job))["trainer.n_gpus_per_node"] == "2"
    # a TP=2 replica inside the node: each node cuts its own CPUs into one set per vLLM rank
    assert f"hpcv_export {cpus.CPU_SETS_ENV} 2" in script
    job.trainer.overrides["actor_rollout_ref.rollout.tensor_model_parallel_size"] = 1
    assert cpus.CPU_SETS_ENV not in render_sbatch(profile, job, job_id=7)
    assert cpus.vllm_cpu_bind({cpus.CPU_SETS_ENV: "2"}, [4, 5, 6, 7, 8]) == "4,5|6,7,8"
    assert cpus.vllm_cpu_bind({cpus.CPU_SETS_ENV: "2", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, [0, 1]) is None
    assert cpus.vllm_cpu_bind({}, [0, 1]) is None
    # the built-in trainer on the same profile: two CPU ranks per node
    builtin = load_job_config(str(REPO / "examples" / "job_local_demo.yaml"))
    assert builtin.trainer.module == "hpc_verl.trainer.main"
    assert dict(derived_overrides(profile, builtin))["trainer.n_gpus_per_node"] == "2"
    assert dict(derived_overrides(load_profile("local"), builtin))["trainer.n_gpus_per_node"] == "$HPCV_GPUS_PER_NODE"
    # hpc-verl plan on the profile: the ranks it will get
    from hpc_verl.ops.scaling import make_plan
    rows = {r.key: r.value for r in make_plan(profile, 1).rows}
    assert rows["trainer.n_gpus_per_node"] == "2" and rows["CPU ranks"] == "2"
    # refusals: one line each
    for overrides, words in ((["accelerator=nvidia", "slurm.gpus_per_node=4", "cpu.ranks_per_node=2"],
                              "cpu.ranks_per_node is 2 but accelerator is 'nvidia'"),
                             (["scheduler=slurm", "slurm.cpus_per_task=1", "cpu.ranks_per_node=2"],
                              "raise slurm.cpus_per_task to at least 2"),
                             (["accelerator=none", "slurm.gpus_per_node=2"], "ranks per CPU node are cpu.ranks_per_node")):
        with pytest.raises(ProfileError, match=re.escape(words)):
            load_profile("local", overrides)
    res = cli("profiles", "show", "local", "--set", "cpu.rank_per_node=2")
    assert res.returncode == 2 and "did you mean 'ranks_per_node'" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_replica_over_nodes_that_share_tmp_is_named_before_submission():
    """verl 0.9.1's weight-sync socket is /tmp/...-rank-{node-local rank}.sock: a TP=2 replica over two
    nodes of one host (a test bed) hangs; one line says so and what keeps the replica inside a node."""
    from hpc_verl.verl_upstream.cpu.rules import shared_tmp_notes

    cfg = {"actor_rollout_ref": {"rollout": {"tensor_model_parallel_size": 2}}}
    (line,) = shared_tmp_notes(cfg, nnodes=2, ranks_per_node=1, one_host=True)
    assert "first weight sync hangs" in line and "cpu.ranks_per_node: 2" in line
    assert shared_tmp_notes(cfg, nnodes=2, ranks_per_node=2, one_host=True) == []
    assert shared_tmp_notes(cfg, nnodes=2, ranks_per_node=1, one_host=False) == []
