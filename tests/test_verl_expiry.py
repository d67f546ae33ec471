"""Upstream verl and the time limit, piece by piece: the rendered script, the end-time file the Ray
workers follow, and the supervisor that turns the preemption file into "save, stop, requeue".

The supervisor runs a real child process; verl itself needs GPUs, so a small Python script stands in
for it here (it writes verl's checkpoint layout: global_step_N/ and latest_checkpointed_iteration.txt).
The whole path on the SLURM test bed is tests/test_slurm_verl_expiry.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from hpc_verl.launch.spec.jobconfig import job_from_dict
from hpc_verl.launch.spec.render import render_sbatch
from hpc_verl.profiles import load_profile
from hpc_verl.errors import REQUEUE_EXIT_CODE
from hpc_verl.verl_upstream import expiry, supervise

REPO = Path(__file__).resolve().parents[1]
VERL_JOB = {"name": "v", "trainer": {"module": "verl.trainer.main_ppo", "overrides": {
    "actor_rollout_ref.rollout.name": "hf", "trainer.save_freq": 5}}}


def _verl_job(**overrides):
    job = {**VERL_JOB, "trainer": {**VERL_JOB["trainer"],
                                   "overrides": {**VERL_JOB["trainer"]["overrides"], **overrides}}}
    return job_from_dict(job, "test")


# ----------------------------------------------------------------------------- the rendered script
def test_slurm_verl_job_exports_the_end_time_before_ray_and_runs_under_the_supervisor():
    script = render_sbatch(load_profile("testbed"), _verl_job())
    assert f"export {expiry.EXPIRY_ENV}=\"$end\"" in script
    assert "squeue -h -j \"$SLURM_JOB_ID\" -o %e" in script
    pipeline = script[script.index("# ---- the pipeline"):]
    # exported (and the watcher started) before the containers and Ray start on the nodes
    assert pipeline.index("hpcv_expiry_start") < pipeline.index("hpcv_containers_up") < pipeline.index("hpcv_ray_up")
    assert "-m hpc_verl.verl_upstream.supervise -- \"$HPCV_PYTHON\" -m \"$HPCV_TRAINER_MODULE\"" in script
    # verl's keys the launcher derives: resume from the run dir's checkpoints, save before the signal
    for key in ("trainer.default_local_dir=$HPCV_RUN_DIR/checkpoints", "trainer.resume_mode=auto",
                "trainer.esi_redundant_time=60"):  # testbed: slurm.signal_lead_s 60
        assert f'"{key}"' in script


def test_job_settings_win_over_the_derived_ones():
    script = render_sbatch(load_profile("testbed"), _verl_job(**{"trainer.resume_mode": "disable",
                                                                 "trainer.esi_redundant_time": 300}))
    assert '"trainer.resume_mode=auto"' not in script and "trainer.resume_mode=disable" in script
    assert '"trainer.esi_redundant_time=60"' not in script and "trainer.esi_redundant_time=300" in script


def test_no_expiry_without_slurm_and_none_for_the_builtin_trainer():
    local = render_sbatch(load_profile("local"), _verl_job())
    assert "hpcv_expiry_start" not in local and expiry.EXPIRY_ENV not in local
    assert "hpc_verl.verl_upstream.supervise" in local  # the supervisor still runs verl
    builtin = render_sbatch(load_profile("testbed"), job_from_dict({"name": "b"}, "test"))
    assert "hpcv_expiry" not in builtin and "verl_upstream.supervise" not in builtin
    assert "esi_redundant_time" not in builtin


def test_expiry_partial_runs_against_a_fake_squeue(tmp_path):
    """The partial's functions in bash with a squeue stand-in (the test bed test uses the real one)."""
    script = render_sbatch(load_profile("testbed"), _verl_job())
    start = script.index("# ---- upstream verl and the time limit")
    part = script[start:script.index("\n# ----", start + 10)]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "squeue").write_text('#!/bin/bash\ncat "$END_FILE"\n')
    (bindir / "squeue").chmod(0o755)
    end_file = tmp_path / "end"
    end_file.write_text("2031-05-06T07:08:09\n")
    driver = textwrap.dedent(f"""
        set -euo pipefail
        hpcv_log() {{ echo "LOG $*"; }}
        HPCV_RUN_DIR={tmp_path}; HPCV_JOB_ID=7; SLURM_JOB_ID=7; HPCV_ENV_NAMES=(); HPCV_STEP_PIDS=()
        {part}
        hpcv_expiry_update
        echo "VAR=${expiry.EXPIRY_ENV} FILE=$(cat "$HPCV_EXPIRY_FILE") NAMES=${{HPCV_ENV_NAMES[*]}}"
        echo 2031-05-06T07:38:09 > "$END_FILE"
        hpcv_expiry_update
        echo "VAR=${expiry.EXPIRY_ENV} FILE=$(cat "$HPCV_EXPIRY_FILE")"
        echo NONE > "$END_FILE"
        hpcv_expiry_update
        echo "VAR=${expiry.EXPIRY_ENV}"
        """)
    out = subprocess.run(["bash", "-c", driver], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "END_FILE": str(end_file),
                              "TZ": "UTC"})
    assert out.returncode == 0, out.stderr
    first, changed, kept = [ln for ln in out.stdout.splitlines() if ln.startswith("VAR=")]
    t0 = int(datetime(2031, 5, 6, 7, 8, 9, tzinfo=timezone.utc).timestamp())
    assert first == f"VAR={t0} FILE={t0} NAMES={expiry.EXPIRY_ENV}"
    assert changed == f"VAR={t0 + 1800} FILE={t0 + 1800}"
    assert kept == f"VAR={t0 + 1800}"  # no end time (e.g. unlimited): keep the last known one
    assert "LOG time limit changed: job 7 now ends at 2031-05-06 07:38:09 (was 2031-05-06 07:08:09)" in out.stdout


# ----------------------------------------------------------------------------- the workers' view
def test_refresh_environ_follows_the_file(tmp_path):
    f = tmp_path / "expiry"
    env: dict[str, str] = {}
    assert not expiry.refresh_environ(f, env) and env == {}  # no file yet: nothing set
    f.write_text("1967526489\n")
    assert expiry.refresh_environ(f, env) and env[expiry.EXPIRY_ENV] == "1967526489"
    assert not expiry.refresh_environ(f, env)
    f.write_text("garbage")
    assert not expiry.refresh_environ(f, env) and env[expiry.EXPIRY_ENV] == "1967526489"


def test_follow_thread_updates_this_process(tmp_path, monkeypatch):
    f = tmp_path / "expiry"
    f.write_text("100\n")
    monkeypatch.setenv(expiry.EXPIRY_FILE_ENV, str(f))
    monkeypatch.setenv(expiry.POLL_ENV, "0.1")
    monkeypatch.setattr(expiry, "_follower", None)
    expiry.follow_expiry_file()
    assert os.environ[expiry.EXPIRY_ENV] == "100"
    f.write_text("200\n")
    deadline = time.monotonic() + 10
    while os.environ[expiry.EXPIRY_ENV] != "200":
        assert time.monotonic() < deadline, "the worker never saw the new end time"
        time.sleep(0.05)


def test_runtime_env_hook_adds_the_setup_hook_and_keeps_one_the_job_has():
    assert expiry.runtime_env_hook(None) == {"worker_process_setup_hook": expiry.SETUP_HOOK}
    env = expiry.runtime_env_hook({"env_vars": {"A": "1"}})
    assert env == {"env_vars": {"A": "1"}, "worker_process_setup_hook": expiry.SETUP_HOOK}
    assert expiry.runtime_env_hook({"worker_process_setup_hook": "x.y"})["worker_process_setup_hook"] == "x.y"


# ----------------------------------------------------------------------------- the supervisor
FAKE_VERL = """
import os, sys, time, signal
from pathlib import Path
ckpt = Path([a.split("=", 1)[1] for a in sys.argv if a.startswith("trainer.default_local_dir=")][-1])
save_every, step_s = int(os.environ["SAVE_EVERY"]), float(os.environ["STEP_S"])
print("hook", os.environ.get("RAY_RUNTIME_ENV_HOOK"), "end", os.environ.get("%(var)s"), flush=True)
signal.signal(signal.SIGTERM, lambda *_: (print("TERM", flush=True), sys.exit(143)))
for step in range(1, 10_000):
    time.sleep(step_s)
    if step %% save_every == 0:
        (ckpt / f"global_step_{step}").mkdir(parents=True, exist_ok=True)
        (ckpt / "latest_checkpointed_iteration.txt").write_text(str(step))
        print("saved", step, flush=True)
""" % {"var": expiry.EXPIRY_ENV}


def _supervise(tmp_path: Path, save_every: int, step_s: float, end_in_s: float | None):
    (tmp_path / "fake_verl.py").write_text(FAKE_VERL)
    env = {**os.environ, "SAVE_EVERY": str(save_every), "STEP_S": str(step_s),
           "HPCV_PREEMPT_FILE": str(tmp_path / "PREEMPT"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_RUNTIME_ENV_HOOK", None)
    if end_in_s is not None:
        (tmp_path / "expiry").write_text(f"{time.time() + end_in_s:.0f}\n")
        env[expiry.EXPIRY_FILE_ENV] = str(tmp_path / "expiry")
    return subprocess.Popen([sys.executable, "-m", "hpc_verl.verl_upstream.supervise", "--", sys.executable,
                             str(tmp_path / "fake_verl.py"), f"trainer.default_local_dir={tmp_path / 'ckpt'}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def test_preemption_waits_for_the_next_save_then_requeues(tmp_path):
    proc = _supervise(tmp_path, save_every=2, step_s=0.3, end_in_s=600)
    tracker = tmp_path / "ckpt" / supervise.TRACKER_FILE
    _wait_for(tracker)
    first = int(tracker.read_text())
    (tmp_path / "PREEMPT").write_text("")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == REQUEUE_EXIT_CODE, err
    assert f"hook {expiry.RUNTIME_ENV_HOOK} end " in out  # the trainer's Ray gets the follow hook and the end
    saved = [int(ln.split()[1]) for ln in out.splitlines() if ln.startswith("saved")]
    assert saved[-1] > first and int(tracker.read_text()) == saved[-1]  # a new save came, then the stop
    assert "TERM" in out  # verl was stopped by the supervisor, not left running
    assert f"verl saved global_step_{saved[-1]}: stopping it" in err
    assert f"verl stopped; the requeued run resumes from global_step_{saved[-1]}" in err


def test_preemption_without_a_new_save_stops_before_the_end(tmp_path):
    """No save comes (save_freq far away): verl is stopped STOP_MARGIN_S before the job's end."""
    proc = _supervise(tmp_path, save_every=10_000, step_s=0.2, end_in_s=supervise.STOP_MARGIN_S + 3)
    time.sleep(1)
    (tmp_path / "PREEMPT").write_text("")
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == REQUEUE_EXIT_CODE, err
    assert time.monotonic() - t0 < 20
    assert "no new checkpoint in time" in err and "resumes from no checkpoint" in err


def test_a_signal_stops_verl_and_is_passed_on(tmp_path):
    proc = _supervise(tmp_path, save_every=10_000, step_s=0.2, end_in_s=None)
    time.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "TERM" in out


def test_verl_exit_status_is_passed_through(tmp_path):
    res = subprocess.run([sys.executable, "-m", "hpc_verl.verl_upstream.supervise", "--", sys.executable, "-c",
                          "import sys; sys.exit(3)"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 3


@pytest.mark.parametrize("argv,expected", [
    (["trainer.default_local_dir=/a", "x=1", "trainer.default_local_dir=/b"], "/b"),
    (["+trainer.default_local_dir=/c"], "/c"), (["x=1"], None)])
def test_checkpoint_dir_is_the_last_override(argv, expected):
    got = supervise.checkpoint_dir(argv)
    assert (str(got) if got else None) == expected
