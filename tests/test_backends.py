"""The one backend interface: which backend a request goes to, one job-state vocabulary, one
dry-run object every backend prints, and the operations on a dry run's record (no cluster needed:
real registry, real rendering, the CLI in a subprocess)."""
from __future__ import annotations

import json

import pytest

from hpc_verl.errors import ConfigError, HpcVerlError
from hpc_verl.launch import backends, registry
from hpc_verl.launch.backends import JobInfo, JobState, SubmitRequest


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HPC_VERL_HOME", str(tmp_path / "home"))
    return {"HPC_VERL_HOME": str(tmp_path / "home")}


def test_every_registered_backend_loads_under_its_name():
    for name in backends.BACKENDS:
        backend = backends.get(name)
        assert backend.scheduler == name
        assert isinstance(backend, backends.Backend)
    with pytest.raises(HpcVerlError, match="no backend 'pbs'"):
        backends.get("pbs")


def test_requests_go_to_the_backend_that_runs_them():
    def pick(**request: str) -> str:
        return backends.for_request(SubmitRequest(**request)).scheduler

    assert pick(profile="ib-a100") == "slurm"
    assert pick(profile="local") == "local"
    assert pick(ray_address="http://head:8265") == "rayjob"
    assert pick(cluster="1234", profile="ib-a100") == "rayjob"
    with pytest.raises(ConfigError, match="submit needs --profile NAME"):
        backends.for_request(SubmitRequest())


def test_one_state_vocabulary():
    assert JobState.of("requeued") is JobState.REQUEUED and not JobState.REQUEUED.terminal
    assert all(JobState.of(w).terminal for w in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "LOST", "GONE"))
    assert not any(JobState.of(w).terminal for w in ("PENDING", "RUNNING", "COMPLETING", "DRY-RUN"))
    # a word this version does not know stays visible
    info = JobInfo(JobState.of("BURST_BUFFER"), native="BURST_BUFFER")
    assert info.state is JobState.UNKNOWN and info.label == "UNKNOWN (BURST_BUFFER)" and not info.terminal
    # strings, JSON and formatting see the word itself (status output, scripts comparing states)
    assert JobState.RUNNING == "RUNNING" and f"{JobState.DRY_RUN:>8}" == " DRY-RUN"
    assert json.dumps({"state": JobState.CANCELLED}) == '{"state": "CANCELLED"}'
    from hpc_verl.launch.backends.rayjobs_api import state_of

    assert (state_of("SUCCEEDED"), state_of("STOPPED"), state_of("NEW_IN_RAY_3")) == \
        (JobState.COMPLETED, JobState.CANCELLED, JobState.UNKNOWN)


def test_dry_run_is_one_object_for_every_backend(home):
    slurm = backends.get("slurm")
    dry = slurm.dryrun(SubmitRequest(profile="testbed", name="dr"))
    text = str(dry)
    assert text.startswith(f"dry run (slurm): job directory {dry.record.job_dir}\n")
    assert f"script: {dry.record.script}" in text and f"submit with: sbatch {dry.record.script}" in text
    assert "profile   testbed" in text and "stages    validate -> preprocess" in text
    assert dry.record.dry_run and registry.find(dry.record.job_dir).scheduler == "slurm"
    assert dry.to_dict()["files"] == {"script": dry.record.script}
    held = slurm.dryrun(SubmitRequest(profile="testbed", hold=True))
    assert held.record.role == registry.ROLE_CLUSTER and "hold -> collect" in str(held)
    with pytest.raises(ConfigError, match="'hpc-verl cluster up' needs a SLURM profile"):
        slurm.dryrun(SubmitRequest(profile="local", hold=True))
    rayjob = backends.get("rayjob")
    ray_dry = rayjob.dryrun(SubmitRequest(ray_address="127.0.0.1:1", config=None, name="rd"))
    assert str(ray_dry).startswith("dry run (rayjob): job directory ")
    assert "request: " in str(ray_dry) and "driver    python3 -m hpc_verl.trainer.main" in str(ray_dry)
    assert "submit with" not in str(ray_dry)


def test_cli_dry_run_then_status_logs_cancel(cli, home):
    res = cli("submit", "--profile", "testbed", "--dry-run", "--name", "dr", env=home)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("dry run (slurm): job directory ") and "submit with: sbatch " in res.stdout
    job_dir = res.stdout.split("job directory ", 1)[1].split()[0]
    name = job_dir.rsplit("/", 1)[1]
    st = json.loads(cli("status", name, "--json", env=home).stdout)
    assert (st["state"], st["kind"], st["job_id"]) == ("DRY-RUN", "slurm", None)
    assert "DRY-RUN" in cli("list", env=home).stdout
    for verb, needle in (("logs", "was a dry run; it has no logs"), ("cancel", "was a dry run; nothing to cancel")):
        out = cli(verb, name, env=home)
        assert out.returncode == 2 and f"job {name} {needle}" in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_cluster_and_address_together_are_refused(home):
    with pytest.raises(ConfigError, match="either --cluster JOB or --ray-address URL, not both"):
        backends.get("rayjob").dryrun(SubmitRequest(cluster="1", ray_address="http://h:8265"))


def test_a_job_that_holds_no_cluster_is_refused_in_one_line(home):
    dry = backends.get("slurm").dryrun(SubmitRequest(profile="testbed", name="x"))
    with pytest.raises(HpcVerlError, match="is not a cluster job"):
        backends.get("rayjob").dryrun(SubmitRequest(cluster=dry.record.job_dir))


def test_a_hostile_name_is_refused_before_anything_is_written(cli, home, tmp_path):
    marker = tmp_path / "pwned"
    for extra in (["--profile", "testbed"], ["--ray-address", "http://127.0.0.1:1"]):
        res = cli("submit", *extra, "--dry-run", "--name", f"x; touch {marker}", env=home)
        assert res.returncode == 2 and "--name must be letters, digits" in res.stderr, res.stderr
        assert not marker.exists() and not list((tmp_path / "home").glob("jobs/*"))
