"""Docker containers on the real SLURM test bed (two slurmd on this host, fake GPUs).

The test bed starts a dockerd of its own (``docker_testbed``: its own data root, exec root,
socket and pid file in a temp dir; no iptables, no bridge) and loads its image into it; jobs
use ``testbed-docker-local`` (``container.runtime: docker``, ``DOCKER_HOST`` at that daemon).
Each test checks the job's containers are gone afterwards: after a normal end, ``scancel``,
a failed stage and a container that the daemon refuses to start.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from slurm_bed import leftovers
from test_slurm_e2e import assert_two_node_run, batch_log, job_yaml, submit

pytestmark = [pytest.mark.slurm, pytest.mark.docker, pytest.mark.slow]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED"}


def assert_no_container_left(docker, job_dir: str, job_id: int) -> None:
    left = leftovers(job_dir, job_id, docker_host=docker.host)
    assert not left, f"job {job_id} left behind: {left}"
    assert not [n for n in docker.names() if n.startswith(f"hpcv-{job_id}-")]


def wait_for(cond, what: str, timeout_s: float = 120, log: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not seen within {timeout_s}s; log:\n{log and batch_log(log)}"
        time.sleep(0.5)


def owned_by_me(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid


@pytest.mark.timeout(180)
def test_docker_two_node_job_completes_as_the_submitting_user(slurm_testbed, docker_testbed, tmp_path):
    bed, docker = slurm_testbed, docker_testbed
    job_id, job_dir = submit(bed, docker.profile, job_yaml(tmp_path, "dk"))
    assert bed.wait_state(job_id, TERMINAL) == "COMPLETED", batch_log(job_dir)
    assert_two_node_run(job_dir)
    run = Path(job_dir)
    log = (run / "logs" / "containers.log").read_text()
    for node in ("node1", "node2"):  # one container per node, named after job and node
        assert f"container hpcv-{job_id}-{node} up on {node}" in log
        st = json.loads((run / "ray" / "nodes" / f"{node}.json").read_text())
        assert st["in_container"] is True
    # files the container wrote in the run directory belong to the submitting user (docker's --user)
    script = (Path(job_dir).parent / "script.sbatch").read_text()
    assert 'HPCV_ARGS+=(--user "$(id -u):$(id -g)")' in script
    written = [run / "result.json", run / "ray" / "nodes" / "node1.json", run / "ray" / "nodes" / "node2.json"]
    assert {owned_by_me(p) for p in written} == {(os.getuid(), os.getgid())}
    assert_no_container_left(docker, job_dir, job_id)


@pytest.mark.timeout(180)
def test_docker_scancel_removes_the_containers(slurm_testbed, docker_testbed, tmp_path):
    bed, docker = slurm_testbed, docker_testbed
    job_id, job_dir = submit(bed, docker.profile, job_yaml(tmp_path, "dkc", steps=400, step_s=0.5))
    wait_for(lambda: "step 1/400 done" in batch_log(job_dir), "the trainer's first step", log=job_dir)
    names = {f"hpcv-{job_id}-node1", f"hpcv-{job_id}-node2"}
    assert names <= set(docker.names())
    for name in sorted(names):  # the flags the job started them with, as the daemon holds them
        got = docker.daemon.docker("inspect", "--format", "{{.Config.User}} {{.HostConfig.NetworkMode}} "
                                   "{{.HostConfig.ShmSize}} {{.HostConfig.AutoRemove}} {{json .HostConfig.Ulimits}}",
                                   name)
        user, network, shm, autoremove, ulimits = got.stdout.split(" ", 4)
        assert (user, network, shm, autoremove) == (f"{os.getuid()}:{os.getgid()}", "host", str(2**30), "false")
        assert json.loads(ulimits) == [{"Name": "nofile", "Hard": 1024, "Soft": 1024}]
    cancel = bed.cli("cancel", str(job_id))
    assert cancel.returncode == 0, cancel.stderr
    assert bed.wait_state(job_id, TERMINAL, timeout_s=60) == "CANCELLED"
    assert_no_container_left(docker, job_dir, job_id)


@pytest.mark.timeout(180)
def test_docker_failed_stage_removes_the_containers(slurm_testbed, docker_testbed, tmp_path):
    bed, docker = slurm_testbed, docker_testbed
    # the trainer fails inside the container (a bad argument: argparse exits 2)
    job_id, job_dir = submit(bed, docker.profile, _failing_trainer(tmp_path))
    assert bed.wait_state(job_id, TERMINAL) == "FAILED", batch_log(job_dir)
    log = batch_log(job_dir)
    assert "containers: 2 up" in log and "train: the trainer exited with status 2" in log
    assert_no_container_left(docker, job_dir, job_id)


def _failing_trainer(tmp_path: Path) -> str:
    import yaml

    path = tmp_path / "dkbad.yaml"
    path.write_text(yaml.safe_dump({"name": "dkbad", "trainer": {"module": "hpc_verl.bootstrap.workload",
                                                                 "derive_overrides": False,
                                                                 "args": ["--steps", "not-a-number"]}}))
    return str(path)


@pytest.mark.timeout(120)
def test_docker_refused_ulimit_fails_the_job_in_one_line(slurm_testbed, docker_testbed, tmp_path):
    """A limit the daemon cannot set (memlock unlimited above this machine's hard limit) fails the job at
    the container start with the daemon's reason, not later; the created containers are removed."""
    bed, docker = slurm_testbed, docker_testbed
    hard = Path("/proc/self/limits").read_text().split("Max locked memory")[1].split()[1]
    if hard == "unlimited":
        pytest.skip("memlock is unlimited here: the daemon can raise it")
    job_id, job_dir = submit(bed, docker.profile, job_yaml(tmp_path, "dkm"), "container.memlock_unlimited=true")
    assert bed.wait_state(job_id, TERMINAL) == "FAILED", batch_log(job_dir)
    failure = (Path(job_dir) / "failure.txt").read_text()
    assert failure.startswith("containers: 'docker run' failed on node") and "rlimit" in failure, failure
    assert "--ulimit memlock=-1:-1" in (Path(job_dir).parent / "script.sbatch").read_text()
    assert_no_container_left(docker, job_dir, job_id)


@pytest.mark.timeout(240)
def test_docker_usr2_requeue_replaces_the_containers(slurm_testbed, docker_testbed, tmp_path):
    """USR2 before the time limit: checkpoint, requeue; the first run's containers are removed before the
    next run starts its own (same names: job and node), and none is left at the end."""
    from hpc_verl.launch.backends import slurm

    bed, docker = slurm_testbed, docker_testbed
    job_id, job_dir = submit(bed, docker.profile, job_yaml(tmp_path, "dkr", steps=30, step_s=0.5))
    wait_for(lambda: "step 2/30 done" in batch_log(job_dir), "the trainer's second step", log=job_dir)
    first = {n: docker.daemon.docker("inspect", "--format", "{{.Id}}", n).stdout.strip()
             for n in (f"hpcv-{job_id}-node1", f"hpcv-{job_id}-node2")}
    assert all(first.values())
    slurm.scancel(job_id, signal="USR2", batch_only=True, env=bed.env)
    deadline = time.monotonic() + 120
    while True:
        info = slurm.job_info(job_id, env=bed.env)
        if info and info.restarts >= 1 and info.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "RUNNING",
                                                            "COMPLETED"):
            break
        assert time.monotonic() < deadline, f"not requeued: {info}; log:\n{batch_log(job_dir)}"
        time.sleep(0.5)
    def first_runs_containers_gone() -> None:   # before the next run starts its own
        assert not [n for n in docker.names() if n.startswith(f"hpcv-{job_id}-")]
    bed.release_requeued(job_id, job_dir, first_runs_containers_gone)
    assert bed.wait_state(job_id, TERMINAL) == "COMPLETED", batch_log(job_dir)
    log = batch_log(job_dir)
    assert "exiting 99 (requeue me)" in log and f"job dkr ({job_id}), run 1" in log, log
    assert "resumed from step 0," not in log.split(", run 1", 1)[1], log  # the second run resumed
    assert json.loads((Path(job_dir) / "result.json").read_text())["final_step"] == 30
    assert_no_container_left(docker, job_dir, job_id)
