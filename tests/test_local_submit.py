"""``hpc-verl submit --profile local``: the main job on this machine, end to end.

Real components throughout: the rendered script run by bash, the shipped sample data
preprocessed to parquet, the model check, a one-node Ray through our bootstrap
(ports from the profile's block, never Ray's defaults), the built-in trainer on a tiny
random model on CPU, the registry, and list/status/logs/cancel. Nothing is faked.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from hpc_verl.launch.backends import local, supervisor
from hpc_verl.launch.spec.jobconfig import job_from_dict, load_job_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("model") / "tiny"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-m", "hpc_verl", "make-tiny-model", str(out)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return out


@pytest.fixture
def home(tmp_path):
    """A private registry; whatever a test leaves running is killed (by its job marker), even on failure.
    (tests/test_faults.py checks by process group and session that nothing at all is left.)"""
    h = tmp_path / "home"
    yield {"HPC_VERL_HOME": str(h)}
    for d in (h / "jobs").glob("*") if (h / "jobs").exists() else []:
        for pid in supervisor.marked_pids(str(d)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _workdir(tmp_path: Path, tiny_model: Path) -> Path:
    wd = tmp_path / "work"
    (wd / "models").mkdir(parents=True)
    (wd / "models" / "tiny").symlink_to(tiny_model)
    return wd


def test_example_job_is_the_embedded_default():
    example = load_job_config(str(REPO / "examples" / "job_local_demo.yaml"))
    default = job_from_dict(local.demo_job_dict(), "default")
    assert example.trainer.overrides == default.trainer.overrides
    assert (example.name, example.model.path, example.data.dir) == (default.name, default.model.path,
                                                                    default.data.dir)
    assert (REPO / example.data.raw).resolve() == Path(default.data.raw).resolve()


def test_submit_local_end_to_end(cli, tmp_path, tiny_model, home):
    wd = _workdir(tmp_path, tiny_model)
    res = cli("submit", "--profile", "local", cwd=wd, env=home, timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for stage in ("stage preprocess: done", "stage model-check: done", "ray-up: 1 nodes and 0 GPUs ready",
                  "stage train: done", "job finished"):
        assert stage in res.stdout, stage
    # our trainer starts with Ray (it loads torch, Ray and its data meanwhile) and connects once the
    # barrier's record is there: that may print before the barrier's own "ready" line does
    out = res.stdout
    assert out.index("train: starting the trainer now") < out.index("ray-up: head") < \
        out.index("Connected to Ray cluster")
    assert (wd / "data" / "gsm8k" / "train.parquet").exists()  # preprocessed once, next to the job
    jobs = list((Path(home["HPC_VERL_HOME"]) / "jobs").iterdir())
    assert len(jobs) == 1
    rec = json.loads((jobs[0] / "job.json").read_text())
    assert rec["scheduler"] == "local" and rec["exit_code"] == 0 and rec["pid"] and rec["supervisor_pid"]
    assert Path(rec["run_dir"]).name == f"local-demo-{rec['job_id']}"   # fixed at submission: a rerun continues there
    run_dir = Path(rec["run_dir"])
    assert f"run directory: {run_dir}" in res.stdout
    # results: metrics with rising step numbers, a PNG, a checkpoint
    rows = [json.loads(line) for line in (run_dir / "checkpoints" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, 6))
    assert (run_dir / "checkpoints" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "checkpoints" / "global_step_5").is_dir()
    # the job ran with this interpreter, and Ray on the profile's port block (not 6379)
    script = Path(rec["script"]).read_text()
    assert f"HPCV_PYTHON={os.path.realpath(sys.executable)}" in script or \
        f"HPCV_PYTHON={sys.executable}" in script
    head = json.loads((run_dir / "ray" / "head.json").read_text())
    assert not head["address"].endswith(":6379")
    st = cli("status", str(rec["job_id"]), "--json", env=home)
    d = json.loads(st.stdout)
    assert d["state"] == "COMPLETED" and d["exit_code"] == "0"
    assert {"preprocess", "model-check", "train"} <= set(d["stages_done"])
    assert supervisor.marked_pids(str(jobs[0])) == []  # Ray and the trainer are gone when submit returns
    assert "COMPLETED" in cli("list", env=home).stdout
    # the last steps as a table, under verl's metric names
    table = cli("logs", str(rec["job_id"]), "--metrics", "3", env=home)
    assert table.returncode == 0 and "last 3 step(s)" in table.stdout and "critic/score/mean" in table.stdout
    assert [ln.split()[1] for ln in table.stdout.splitlines() if ln.startswith("│")][-3:] == ["3", "4", "5"]


def test_a_trainer_that_fails_while_ray_comes_up_ends_the_job_with_its_own_status(cli, tmp_path, tiny_model,
                                                                                   home):
    """The trainer starts with Ray; if it fails before the barrier has passed (here: a parquet
    without reward_model, found when it reads the data), the job ends FAILED with the trainer's
    status 2 and its one line, once Ray is up; no hang on Ray, nothing left running."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    wd = _workdir(tmp_path, tiny_model)
    (wd / "data").mkdir()
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i} + 1 = ?"}],
             "ability": "math", "extra_info": {"index": i}} for i in range(16)]
    pq.write_table(pa.Table.from_pylist(rows), wd / "data" / "train.parquet")
    job = local.demo_job_dict()
    job["data"] = {"dir": "data"}
    job["model"] = {"path": "models/tiny"}
    (wd / "job.yaml").write_text(yaml.safe_dump(job))
    t0 = time.monotonic()
    res = cli("submit", "--profile", "local", "--config", "job.yaml", cwd=wd, env=home, timeout=150)
    assert res.returncode != 0 and time.monotonic() - t0 < 120, res.stdout[-2000:]
    out = res.stdout + res.stderr
    assert "no reward_model.ground_truth" in out and "Traceback" not in out, out[-3000:]
    assert "train: the trainer exited with status 2" in out, out[-3000:]
    rec = json.loads(next((Path(home["HPC_VERL_HOME"]) / "jobs").iterdir()).joinpath("job.json").read_text())
    assert rec["exit_code"] == 2
    assert supervisor.marked_pids(str(next((Path(home["HPC_VERL_HOME"]) / "jobs").iterdir()))) == []


def test_missing_model_fails_in_one_line_and_writes_nothing(cli, tmp_path, home):
    wd = tmp_path / "work"
    wd.mkdir()
    cfg = wd / "job.yaml"
    job = local.demo_job_dict()
    job["model"] = {"path": "models/missing"}
    cfg.write_text(yaml.safe_dump(job))
    res = cli("submit", "--profile", "local", "--config", str(cfg), cwd=wd, env=home)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "model-check" in lines[0] and "models/missing" in lines[0]
    assert "make-tiny-model" in lines[0] and "Traceback" not in res.stderr
    jobs = Path(home["HPC_VERL_HOME"]) / "jobs"
    assert not jobs.exists() or not list(jobs.iterdir())
    assert not (wd / "data").exists()


def test_bad_trainer_override_is_refused_before_anything_runs(cli, tmp_path, tiny_model, home):
    wd = _workdir(tmp_path, tiny_model)
    res = cli("submit", "--profile", "local", "trainer.total_epoch=1", cwd=wd, env=home)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    jobs = Path(home["HPC_VERL_HOME"]) / "jobs"
    assert not jobs.exists() or not list(jobs.iterdir())


def test_detach_then_cancel_leaves_nothing_running(cli, tmp_path, tiny_model, home):
    wd = _workdir(tmp_path, tiny_model)
    res = cli("submit", "--profile", "local", "--detach", "trainer.total_training_steps=2000",
              "trainer.save_freq=0", cwd=wd, env=home)
    assert res.returncode == 0, res.stderr
    job_dir = next((Path(home["HPC_VERL_HOME"]) / "jobs").iterdir())
    rec = json.loads((job_dir / "job.json").read_text())
    job_id = str(rec["job_id"])
    assert "started local job" in res.stdout and job_id in res.stdout
    run_dir = Path(rec["run_dir"])
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (run_dir / "checkpoints" / "metrics.jsonl").exists():
        assert json.loads(cli("status", job_id, "--json", env=home).stdout)["state"] == "RUNNING"
        time.sleep(1)
    assert (run_dir / "checkpoints" / "metrics.jsonl").exists(), "training did not start"
    assert supervisor.marked_pids(str(job_dir))  # Ray and the trainer are running
    logs = cli("logs", job_id, env=home)
    assert "stage train: start" in logs.stdout
    out = cli("cancel", job_id, env=home, timeout=120)
    assert out.returncode == 0 and f"cancelled job {job_id}" in out.stdout, out.stderr
    assert supervisor.marked_pids(str(job_dir)) == []
    d = json.loads(cli("status", job_id, "--json", env=home).stdout)
    assert d["state"] == "CANCELLED" and d["exit_code"] not in ("", "0")
    assert "cleanup" in cli("logs", job_id, "--follow", env=home, timeout=30).stdout  # --follow ends: job over


def test_resume_refuses_changes_a_running_job_and_leaves_a_dry_run_untouched(cli, tmp_path, tiny_model, home):
    """``submit --resume JOB`` runs that job again as it was submitted (its own run dir); what it
    cannot do is one line, and ``--dry-run`` only says what it would do."""
    import subprocess

    wd = _workdir(tmp_path, tiny_model)
    res = cli("submit", "--profile", "local", "--dry-run", cwd=wd, env=home)
    assert res.returncode == 0, res.stderr
    job_dir = next((Path(home["HPC_VERL_HOME"]) / "jobs").iterdir())
    job_id = str(json.loads((job_dir / "job.json").read_text())["job_id"])

    def one_line(*args: str) -> str:
        r = cli("submit", *args, cwd=wd, env=home)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
        return r.stderr

    assert "leave out --profile" in one_line("--resume", job_id, "--profile", "local")
    assert "leave out" in one_line("--resume", job_id, "trainer.total_training_steps=3")
    assert "job '4242' is not in the registry" in one_line("--resume", "4242")
    before = (job_dir / "job.json").read_text()
    res = cli("submit", "--resume", job_id, "--dry-run", cwd=wd, env=home)
    assert res.returncode == 0, res.stderr
    assert f"resume   local job {job_id} in {job_dir}/local-demo-{job_id}, from the start" in res.stdout
    assert (job_dir / "job.json").read_text() == before
    # a job whose script still runs (a real process naming the job dir stands in for it) is not run twice
    holder = subprocess.Popen(["sh", "-c", "sleep 60", str(job_dir)])
    try:
        rec = json.loads(before)
        rec.update(dry_run=False, pid=holder.pid)
        (job_dir / "job.json").write_text(json.dumps(rec))
        assert f"job {job_id} is RUNNING; wait for it or 'hpc-verl cancel {job_id}'" in one_line("--resume", job_id)
    finally:
        holder.kill()
        holder.wait()


def test_a_failed_stage_is_named_with_its_last_line_in_the_log_and_status(cli, tmp_path, tiny_model, home):
    """A preprocess module whose import fails (a missing dependency) ends the job with
    'error: preprocess: <its last line>' in the job log, and that line is the status reason."""
    wd = _workdir(tmp_path, tiny_model)
    (wd / "badprep.py").write_text("import hpc_verl_missing_dependency  # noqa\n")
    job = local.demo_job_dict()
    job["data"] = {**job["data"], "preprocess_module": "badprep", "dir": "data"}
    job["model"] = {"path": "models/tiny"}
    (wd / "job.yaml").write_text(yaml.safe_dump(job))
    res = cli("submit", "--profile", "local", "--config", "job.yaml", cwd=wd, env=home, timeout=150)
    assert res.returncode != 0
    want = "preprocess: ModuleNotFoundError: No module named 'hpc_verl_missing_dependency'"
    assert f"error: {want}" in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    job_id = next((Path(home["HPC_VERL_HOME"]) / "jobs").iterdir()).name
    status = cli("status", job_id, "--json", cwd=wd, env=home)
    assert want in json.loads(status.stdout)["reason"], status.stdout
