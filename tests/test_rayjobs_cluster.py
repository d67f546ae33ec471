"""`hpc-verl cluster up` -> two Ray Jobs submissions -> `cluster down`, on the real SLURM test bed.

Real SLURM (two slurmd on this host, fake GPUs), real Ray started by our bootstrap
inside the allocation with the job's own token, real Jobs API.
"""
from __future__ import annotations

import json
import re
import sys

import pytest

from slurm_bed import leftovers

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

DRIVER = ("import ray, sys; ray.init(); "
          "print('ALIVE', sum(1 for n in ray.nodes() if n['Alive']), 'ARGV', sys.argv[1:])")


def test_cluster_up_two_submissions_down(slurm_testbed, tmp_path):
    bed = slurm_testbed
    res = bed.cli("cluster", "up", "--profile", "testbed-local", "--nodes", "2", "--time-min", "10",
                  "--wait-timeout-s", "300", timeout=360)
    assert res.returncode == 0, res.stderr + res.stdout
    job_id = int(re.search(r"cluster job (\d+) is up: 2 node\(s\)", res.stdout).group(1))
    address = re.search(r"Ray Jobs address: (\S+)", res.stdout).group(1)
    token_file = re.search(r"token file: +(\S+)", res.stdout).group(1)
    assert str(job_id) in token_file  # never a shared token: the job's own file
    job_dir = token_file.rsplit("/ray/token", 1)[0]
    try:
        config = tmp_path / "job.yaml"
        config.write_text(json.dumps({"name": "into-cluster", "trainer": {"module": "x"},
                                      "ray_job": {"command": [sys.executable, "-c", DRIVER]}}))
        # one through the registry (--cluster), one the way an outside user would (address + token file)
        r1 = bed.cli("submit", "--cluster", str(job_id), "--config", str(config), "trainer.total_epochs=1")
        assert r1.returncode == 0, r1.stderr
        r2 = bed.cli("submit", "--ray-address", address, "--ray-token-file", token_file,
                     "--profile", "testbed-local", "--config", str(config))
        assert r2.returncode == 0, r2.stderr
        sids = [r.stdout.split("submitted Ray job ")[1].split()[0] for r in (r1, r2)]
        for sid in sids:
            logs = bed.cli("logs", sid, "--follow", timeout=180)
            assert logs.returncode == 0, logs.stdout + logs.stderr
            assert "ALIVE 2" in logs.stdout  # the driver saw both SLURM nodes' Ray
        # the profile's derived overrides reached the driver with concrete values (2 nodes x 4 GPUs)
        assert "'trainer.total_epochs=1', 'trainer.nnodes=2', 'trainer.n_gpus_per_node=4'" in \
            bed.cli("logs", sids[0]).stdout
        listing = bed.cli("list").stdout
        assert str(job_id) in listing and listing.count("COMPLETED") >= 2
        st = json.loads(bed.cli("status", sids[1], "--json").stdout)
        assert st["state"] == "COMPLETED" and st["ray_address"] == address
    finally:
        down = bed.cli("cluster", "down", str(job_id), timeout=180)
    assert down.returncode == 0 and f"cluster job {job_id}:" in down.stdout, down.stderr
    assert bed.job_state(job_id) in {"CANCELLED", "COMPLETED"}
    # its Ray is gone: asking about a job in it is one clear line, exit 2
    res = bed.cli("status", sids[0])
    assert res.returncode == 2 and "cannot reach the Ray Jobs API" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    left = leftovers(job_dir, job_id)
    assert not left, f"cluster job {job_id} left behind: {left}"
