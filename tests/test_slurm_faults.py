"""A node lost mid-job on the real SLURM test bed: its Ray raylet is SIGKILLed while the job trains.

The job's Ray node watcher sees the node's supervisor report the death and ends the training stage
with one line naming the node. A job that may not requeue ends FAILED within 60 s, its state saying
why; a requeue-able one requeues itself once and the next run resumes from its last checkpoint.
Either way no Ray process, port or temp dir of the job is left on any node.
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from test_slurm_e2e import assert_clean, batch_log, job_yaml, result, submit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _kill_node2_raylet(bed, job_id: int, run_dir: str) -> tuple[int, float]:
    deadline = time.monotonic() + 180
    while "step 3/" not in batch_log(run_dir):
        assert time.monotonic() < deadline, batch_log(run_dir)
        assert bed.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), batch_log(run_dir)
        time.sleep(0.5)
    node = json.loads((Path(run_dir) / "ray" / "nodes" / "node2.json").read_text())
    assert node.get("role") == "worker" and node.get("raylet_pid"), node
    os.kill(node["raylet_pid"], signal.SIGKILL)
    return node["raylet_pid"], time.monotonic()


def _lost_node_line(log: str, pid: int) -> str:
    lines = [ln for ln in log.splitlines() if f"node node2: raylet (pid {pid}) killed by SIGKILL" in ln]
    assert lines, log[-4000:]
    return lines[0]


def test_a_lost_node_fails_the_job_within_a_minute_naming_the_node(slurm_testbed, tmp_path):
    bed = slurm_testbed
    job_id, run_dir = submit(bed, "testbed-local", job_yaml(tmp_path, "lost", steps=400, step_s=0.5),
                             "slurm.requeue=false")
    pid, t0 = _kill_node2_raylet(bed, job_id, run_dir)
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=60) == "FAILED", batch_log(run_dir)
    took = time.monotonic() - t0
    assert took < 60, f"the job took {took:.0f}s to end after node2's raylet was killed"
    log = batch_log(run_dir)
    _lost_node_line(log, pid)
    assert "requeueing" not in log and "Traceback" not in log
    st = json.loads(bed.cli("status", str(job_id), "--json").stdout)
    assert st["state"] == "FAILED" and "node2" in st["reason"] and "raylet" in st["reason"], st
    assert_clean(run_dir, job_id)


def test_a_lost_node_requeues_the_job_once_and_it_resumes(slurm_testbed, tmp_path):
    from hpc_verl.launch.backends import slurm

    bed = slurm_testbed
    job_id, run_dir = submit(bed, "testbed-local", job_yaml(tmp_path, "lostrq", steps=24, step_s=0.5))
    pid, _ = _kill_node2_raylet(bed, job_id, run_dir)
    deadline = time.monotonic() + 120
    while True:
        info = slurm.job_info(job_id, env=bed.env)
        if info and info.restarts >= 1:
            break
        assert time.monotonic() < deadline, f"not requeued: {info}; log:\n{batch_log(run_dir)[-4000:]}"
        time.sleep(0.5)
    bed.release_requeued(job_id, run_dir)
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", batch_log(run_dir)[-4000:]
    log = batch_log(run_dir)
    _lost_node_line(log, pid)
    assert "train: a node failed; requeueing the job" in log and "stage train: interrupted by a node failure" in log
    assert "(restart 1 of" in log and "restart 2 of" not in log
    r = result(run_dir)
    assert r["restart_count"] == 1 and r["final_step"] == 24 and r["alive_nodes"] == 2
    assert 3 <= r["start_step"] < 24  # resumed from the checkpoint, not from 0
    assert re.search(rf"resumed from step {r['start_step']}, SLURM_RESTART_COUNT=1", log)
    assert_clean(run_dir, job_id)
