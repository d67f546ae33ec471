"""Units of the SLURM backend and the job registry that need no cluster."""
from __future__ import annotations

import json
import os

import pytest

from hpc_verl.errors import JobNotFoundError
from hpc_verl.launch import registry
from hpc_verl.launch.backends.slurm import parse_scontrol


def test_parse_scontrol_keeps_values_with_spaces():
    line = ("JobId=7 JobName=my job UserId=root(0) JobState=RUNNING Reason=None Requeue=1 Restarts=1 "
            "NodeList=node[1-2] Command=/tmp/a b/script.sbatch ExitCode=0:0")
    d = parse_scontrol(line)
    assert d["JobId"] == "7" and d["JobName"] == "my job" and d["JobState"] == "RUNNING"
    assert d["Restarts"] == "1" and d["NodeList"] == "node[1-2]"
    assert d["Command"] == "/tmp/a b/script.sbatch" and d["ExitCode"] == "0:0"


def test_registry_roundtrip_and_lookup(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_VERL_HOME", str(tmp_path))
    d = registry.new_job_dir("demo")
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    rec = registry.JobRecord(name="demo", job_dir=str(d), profile="testbed", job_id=4242,
                             run_dir=str(d / "demo-4242"))
    rec.save()
    assert json.loads((d / "job.json").read_text())["job_id"] == 4242
    assert registry.find("4242").job_dir == str(d)
    assert registry.find(d.name).job_id == 4242
    with pytest.raises(JobNotFoundError, match="'999' is not in the registry"):
        registry.find("999")


def test_cli_status_of_unknown_job_is_one_line(cli, tmp_path):
    proc = cli("status", "31337", env={"HPC_VERL_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "31337" in proc.stderr


def test_submit_dry_run_writes_job_dir_without_sbatch(cli, tmp_path):
    proc = cli("submit", "--profile", "testbed", "--dry-run", env={"HPC_VERL_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    jobs = list((tmp_path / "jobs").iterdir())
    assert len(jobs) == 1
    script = (jobs[0] / "script.sbatch").read_text()
    assert "-m hpc_verl.bootstrap plan --job-dir" in script
    assert "bootstrap wait --job-dir" in script and "sleep 10" not in script
    assert json.loads((jobs[0] / "job.json").read_text())["dry_run"] is True


def test_submit_bad_profile_leaves_nothing(cli, tmp_path):
    proc = cli("submit", "--profile", "testbed", "--set", "slurm.nodez=2", env={"HPC_VERL_HOME": str(tmp_path)})
    assert proc.returncode == 2 and "nodez" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "jobs").exists() or not list((tmp_path / "jobs").iterdir())


def test_local_job_states_share_the_slurm_record(tmp_path):
    """A local job is reported with the same JobInfo as a SLURM one; a vanished process is LOST
    (terminal, so `logs --follow` stops), not RUNNING forever."""
    import subprocess
    import sys

    from hpc_verl.launch import registry
    from hpc_verl.launch.backends import local

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rec = registry.JobRecord(name="x", job_dir=str(tmp_path), profile="local", scheduler="local", pid=dead.pid)
    info = local.info(rec)
    assert (info.state, info.terminal, info.source) == ("LOST", True, "local")
    assert "without recording its exit status" in info.reason
    rec.exit_code = 3
    info = local.info(rec)
    assert (info.state, info.exit_code, info.terminal) == ("FAILED", "3", True)
    rec.exit_code, rec.pid = None, os.getpid()  # alive, but not this job's (no marker in its environment)
    assert local.info(rec).state == "LOST"
