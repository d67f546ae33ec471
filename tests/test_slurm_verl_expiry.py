"""Upstream verl survives the time limit, on the real SLURM test bed (two slurmd, real Ray, real squeue).

Real verl needs GPUs, so `tests/verl_stub/verl/trainer/main_ppo.py` stands in for it: a Ray
TaskRunner actor that checks the expiry variable the way verl 0.9.1's `should_save_ckpt_esi` does,
saves in verl's layout and resumes with `trainer.resume_mode=auto`. Everything around it is the
real launcher: the job validated against the installed verl's config, the end time exported from
`squeue`, `scontrol update TimeLimit` while the job runs, SIGUSR2, requeue, resume.
"""
from __future__ import annotations

import json
import re
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from test_slurm_e2e import assert_clean, batch_log, submit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
EXPIRY = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def _end_epoch(bed, job_id: int) -> int:
    end = bed.slurm("squeue", "-h", "-j", str(job_id), "-o", "%e").stdout.strip()
    return int(datetime.fromisoformat(end).timestamp())


def _steps(run_dir: str) -> list[dict]:
    p = Path(run_dir) / "checkpoints" / "stub_steps.jsonl"
    return [json.loads(ln) for ln in p.read_text().splitlines()] if p.exists() else []


def _until(what: str, cond, run_dir: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}; log:\n{batch_log(run_dir)[-4000:]}"
        time.sleep(0.5)


def test_verl_saves_before_the_limit_requeues_and_resumes(slurm_testbed, tmp_path):
    from hpc_verl.launch.backends import slurm

    bed = slurm_testbed
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    stub_path = f"{HERE / 'verl_stub'}:{HERE.parent}"
    (profiles / "testbed-stubverl.yaml").write_text(yaml.safe_dump(
        {"extends": "testbed-local", "description": "test bed, verl replaced by tests/verl_stub",
         "env": {"vars": {"PYTHONPATH": stub_path}}}))
    job = tmp_path / "verl.yaml"
    job.write_text(yaml.safe_dump({"name": "verlx", "trainer": {"module": "verl.trainer.main_ppo", "overrides": {
        "actor_rollout_ref.rollout.name": "hf", "trainer.use_v1": False, "trainer.save_freq": 1000,
        # verl's own start-up check (run before submission) wants the actor's micro-batch sizes
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
        "trainer.total_training_steps": 14,
        # a wider window than the derived 60 s (the signal lead), so that the save comes right after the
        # TimeLimit change below instead of a minute later
        "trainer.esi_redundant_time": 200}}}))
    env = {"HPC_VERL_PROFILE_PATH": f"{profiles}:{bed.env['HPC_VERL_PROFILE_PATH']}", "HPCV_EXPIRY_POLL_S": "1",
           "STUB_STEP_S": "1"}
    job_id, run_dir = submit(bed, "testbed-stubverl", str(job), env=env)

    # run 1: the end time from SLURM (30 min) reaches verl's actor; nothing is close yet
    _until("no step", lambda: len(_steps(run_dir)) >= 2, run_dir)
    first_end = _end_epoch(bed, job_id)
    assert _steps(run_dir)[0]["expiry"] == str(first_end) and not any(s["close"] for s in _steps(run_dir))

    # the admin shortens the job while it runs: the new end must reach the running actor
    elapsed = time.time() - datetime.fromisoformat(
        bed.slurm("squeue", "-h", "-j", str(job_id), "-o", "%S").stdout.strip()).timestamp()
    minutes = int(elapsed // 60) + 4
    assert bed.slurm("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}").returncode == 0
    new_end = _end_epoch(bed, job_id)
    assert new_end < first_end
    _until("the actor never saw the new end", lambda: any(s["expiry"] == str(new_end) for s in _steps(run_dir)),
           run_dir, 60)
    _until("no save before the limit", lambda: any(s["close"] and s["saved"] for s in _steps(run_dir)), run_dir, 60)
    esi = next(s for s in _steps(run_dir) if s["close"] and s["saved"])
    assert esi["remaining"] <= 60 + 1.5 + 200 and esi["step"] < 14
    log = batch_log(run_dir)
    assert "time limit changed: job" in log

    # what --signal=B:USR2@60 sends before the (new) end, sent now
    slurm.scancel(job_id, signal="USR2", batch_only=True, env=bed.env)

    def requeued() -> bool:
        info = slurm.job_info(job_id, env=bed.env)
        return info is not None and info.restarts >= 1
    _until("not requeued", requeued, run_dir, 120)
    # give the requeued run its 30 minutes back, then release it (as test_f does)
    bed.wait_requeue_settled(job_id)
    assert bed.slurm("scontrol", "update", f"JobId={job_id}", "TimeLimit=30").returncode == 0
    time.sleep(2)
    slurm.release_requeued(job_id, env=bed.env)
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", batch_log(run_dir)

    log = batch_log(run_dir)
    steps = _steps(run_dir)
    first = [s for s in steps if s["run"] == 0]
    second = [s for s in steps if s["run"] == 1]
    # the supervisor stopped verl right after its next save (its actor may finish one more while the
    # driver goes down; the tracker names the latest complete one, and that is where run 2 starts)
    stopped_at = int(re.search(r"verl saved global_step_(\d+): stopping it", log).group(1))
    resumed = int(re.search(r"verl stopped; the requeued run resumes from global_step_(\d+)", log).group(1))
    assert "preemption: waiting up to" in log and esi["step"] < stopped_at <= resumed
    assert [s["step"] for s in first if s["saved"]][-1] == resumed
    assert "asks to be requeued (exit 99)" in log and "requeueing job" in log
    assert f"stub-verl: resumed from global_step_{resumed} (resume_mode=auto)" in log
    assert second[0]["step"] == resumed + 1 and second[-1]["step"] == 14
    assert int(second[0]["expiry"]) > new_end  # the requeued run got its own (restored) end time
    assert {s["resume_mode"] for s in steps} == {"auto"}  # derived by the launcher, not set by the job
    assert_clean(run_dir, job_id)
