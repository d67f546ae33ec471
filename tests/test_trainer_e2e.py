"""The trainer end to end through the dataflow graph on a private Ray (CPU): kill/resume,
the preemption signal, and the learning proof.

Each test runs ``hpc-verl train`` as a user would (a subprocess in its own process
group, Ray started privately on random ports by the trainer) and kills exactly
that process group when it is done or fails.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]


def _start_train(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("RAY_ADDRESS", None)  # never join someone else's Ray
    fh = open(log, "w")
    return subprocess.Popen([sys.executable, "-m", "hpc_verl", "train", "--no-progress", *args], cwd=REPO,
                            env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def _kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _train_to_end(args: list[str], log: Path, timeout_s: float = 540) -> None:
    """Run ``hpc-verl train`` to its end (its whole process group killed afterwards); it must exit 0."""
    proc = _start_train(args, log)
    try:
        rc = proc.wait(timeout=timeout_s)
    finally:
        _kill_group(proc)
    assert rc == 0, log.read_text()[-3000:]


def _records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _stop_at(gate: float) -> tuple[str, ...]:
    """trainer.stop_when for a learning gate: end the run once the 5-step mean reward reaches ``gate``."""
    return ("trainer.stop_when.metric=critic/score/mean", f"trainer.stop_when.at_least={gate}",
            "trainer.stop_when.window_steps=5")


def _first_reached(scores: list[float], gate: float) -> int | None:
    """The first step whose 5-step mean score is >= ``gate`` (the mean as the trainer's stop rule takes it)."""
    smooth = [sum(scores[i - 5:i]) / 5 for i in range(5, len(scores) + 1)]
    return next((i + 5 for i, v in enumerate(smooth) if v >= gate), None)


def _wait_for(cond, proc: subprocess.Popen, log: Path, timeout_s: float = 400) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        if proc.poll() is not None:
            pytest.fail(f"trainer exited early with {proc.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)
    pytest.fail(f"timed out waiting; log:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_kill_after_checkpoint_then_resume_and_preempt(tiny_model, digits_data, tmp_path):
    from hpc_verl.data.dataset import ResumableSampler
    from hpc_verl.errors import REQUEUE_EXIT_CODE
    from hpc_verl.trainer.driver.checkpoint import latest_checkpoint

    run_dir = tmp_path / "run"
    args = digit_overrides(tiny_model, digits_data, run_dir, 40, ("trainer.save_freq=2", "trainer.seed=3"))
    log1 = tmp_path / "run1.log"
    p1 = _start_train(args, log1)
    try:
        _wait_for(lambda: (run_dir / "global_step_2" / "trainer_state.json").exists(), p1, log1)
        _kill_group(p1)  # SIGKILL: no chance to clean up or save
        p1.wait(timeout=60)
    finally:
        _kill_group(p1)
    ckpt = latest_checkpoint(run_dir)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    ckpt_step = state["step"]
    assert ckpt_step >= 2 and ckpt_step % 2 == 0 and state["policy_version"] == ckpt_step

    log2 = tmp_path / "run2.log"
    p2 = _start_train(args, log2)  # trainer.resume_mode=auto is the default
    try:
        _wait_for(lambda: any(r.get("run/start_step") == ckpt_step for r in _records(run_dir)), p2, log2)
        p2.send_signal(signal.SIGUSR2)  # the launcher's preemption signal
        rc = p2.wait(timeout=300)
    finally:
        _kill_group(p2)
    assert rc == REQUEUE_EXIT_CODE, log2.read_text()[-3000:]

    resumed = [r for r in _records(run_dir) if r.get("run/start_step") == ckpt_step]
    assert resumed and resumed[0]["step"] == ckpt_step + 1  # continues at the checkpoint's step
    assert resumed[0]["policy_version"] == ckpt_step + 1
    # same data position: the batch after the checkpoint is the one an uninterrupted run would draw
    sampler = ResumableSampler(256, 16, seed=3)
    expected = [sampler.next_batch()[0] for _ in range(ckpt_step + 1)][-1]
    assert resumed[0]["data/first_index"] == expected
    # steps before the checkpoint kept from run 1, nothing duplicated
    steps = [r["step"] for r in _records(run_dir)]
    assert steps == list(range(1, len(steps) + 1))
    # where each step's time went: the phases are measured, inside the step's time
    for r in _records(run_dir):
        phases = [r["timing_s/gen"], r["timing_s/old_log_prob"], r["timing_s/update_actor"]]
        assert min(phases) >= 0 and r["timing_s/update_actor"] > 0 and sum(phases) < r["timing_s/step"], r
    # the preemption checkpoint is at the last finished step and is now the latest
    last = latest_checkpoint(run_dir)
    assert last.name == f"global_step_{steps[-1]}" and steps[-1] > ckpt_step


@pytest.mark.learning
@pytest.mark.parametrize("world", [1, 2])
def test_tiny_model_learns_digit_task_through_dataflow(tiny_model, digits_data, tmp_path, world):
    """From random weights: mean reward < 0.2 at the start, >= 0.9 (5-step mean) within 150 iterations,
    with one rank and with two data-parallel ranks (two rollout replicas, a DDP actor). The run ends
    (trainer.stop_when) at the first step that meets the gate; its schedule is still 150 steps long."""
    run_dir = tmp_path / "run"
    seed = int(os.environ.get("HPC_VERL_LEARNING_SEED", "1"))
    args = digit_overrides(tiny_model, digits_data, run_dir, 150, (f"trainer.seed={seed}", "trainer.save_freq=-1",
                                                                     f"trainer.n_gpus_per_node={world}",
                                                                     "actor_rollout_ref.actor.strategy=ddp",
                                                                     *_stop_at(0.9)))
    log = tmp_path / "train.log"
    t0 = time.monotonic()
    _train_to_end(args, log)
    recs = _records(run_dir)
    rewards = [r["critic/score/mean"] for r in recs]
    start = sum(rewards[:5]) / 5
    smooth = [sum(rewards[i - 5:i]) / 5 for i in range(5, len(rewards) + 1)]
    reached = _first_reached(rewards, 0.9)
    print(f"learning: W={world}, seed {seed}, first-5 mean reward {start:.3f}, last-5 {smooth[-1]:.3f}, 0.9 reached at "
          f"iteration {reached}, stopped at {len(rewards)}, wall {time.monotonic() - t0:.0f}s")
    assert start < 0.2
    assert reached is not None and max(smooth) >= 0.9
    # stopped at exactly the first step that met the gate, within the 150 iterations
    assert [r["step"] for r in recs] == list(range(1, reached + 1)) and reached <= 150
    assert "stop_when: critic/score/mean mean over the last 5 steps" in log.read_text()
    # the run leaves a checkpoint (the one a normal end writes) and a plot can be made from its metrics
    assert (run_dir / f"global_step_{reached}" / "actor" / ".metadata").is_file()
    state = json.loads((run_dir / f"global_step_{reached}" / "trainer_state.json").read_text())
    assert state["step"] == reached and state["total_steps"] == 150
    if world == 2:
        status = json.loads((run_dir / "dataflow_status.json").read_text())
        assert [w["rows"] > 0 for w in status["nodes"]["actor_rollout"]["workers"]] == [True, True]
        # where each update went, the slowest and fastest rank, at every step
        phases = [f"timing_s/update_actor/{p}{m}" for p in ("forward", "backward", "allreduce", "optimizer")
                  for m in ("", "_min")]
        assert all(all(k in r for k in phases) and r["perf/rank_imbalance"] >= 1 for r in _records(run_dir))
        # each actor rank fetched only the rollout rows it trains on: half of every batch
        ranks = status["nodes"]["actor_update"]["workers"]
        total = sum(r["n_responses"] for r in _records(run_dir))
        assert [w["fetched_rows"] for w in ranks] == [total // 2, total // 2]
        # each rank's own phase times of its last update, in the status and on the dashboard
        assert [w["rank"] for w in ranks] == [0, 1]
        assert all(w["timings"]["update_actor/forward"] > 0 and w["timings"]["update_actor/allreduce"] >= 0
                   for w in ranks)
        from rich.console import Console

        from hpc_verl.ops.dashboard import render
        con = Console(record=True, width=200)
        con.print(render([status]))
        shown = con.export_text()
        assert "per-rank phase times of the last update" in shown and "update_actor/backward" in shown
    from hpc_verl.trainer.observe.metrics import plot_run
    assert plot_run(run_dir).stat().st_size > 1000


@pytest.mark.learning
def test_one_step_off_policy_learns_and_is_never_more_than_one_version_behind(tiny_model, digits_data, tmp_path):
    """hpc_verl.one_step_off_policy: the rollout (its own process: device_mapping) generates step k+1
    while step k trains. It still learns (>= 0.9 within 200 iterations) and every batch is trained at
    most one policy version after the one that generated it (checked by the trainer at every step and
    recorded as rollout/staleness). The run ends on the gate (trainer.stop_when): the step already in
    flight when it is met finishes too, unless that step was a checkpoint step (nothing in flight).
    The checkpoint every 50 steps falls inside the run, so its drain is checked."""
    run_dir = tmp_path / "run"
    args = digit_overrides(tiny_model, digits_data, run_dir, 200, (
        "trainer.seed=1", "trainer.save_freq=50", "trainer.n_gpus_per_node=2",
        "hpc_verl.device_mapping={actor: [0], rollout: [1]}", "hpc_verl.one_step_off_policy=true",
        *_stop_at(0.9)))
    log = tmp_path / "train.log"
    t0 = time.monotonic()
    _train_to_end(args, log)
    recs = _records(run_dir)
    scores = [r["critic/score/mean"] for r in recs]
    smooth = [sum(scores[i - 5:i]) / 5 for i in range(5, len(scores) + 1)]
    reached = _first_reached(scores, 0.9)
    print(f"one-step-off-policy: 0.9 reached at iteration {reached}, stopped at {len(recs)}, last-5 "
          f"{smooth[-1]:.3f}, wall {time.monotonic() - t0:.0f}s")
    assert sum(scores[:5]) / 5 < 0.2 and reached is not None and reached <= 200
    end = reached if reached % 50 == 0 else reached + 1   # save_freq=50: the pipeline is drained there
    assert [r["step"] for r in recs] == list(range(1, end + 1))
    stale = [r["rollout/staleness"] for r in recs]
    assert set(stale) <= {0, 1} and stale.count(1) > 0.75 * len(stale)   # overlapped, never more than one behind
    # the checkpoint at step 50 drained the pipeline: step 51 was generated with the newest version
    assert recs[50]["rollout/staleness"] == 0 and recs[50]["rollout/policy_version"] == 50
    # the run ended as a normal end does: the final checkpoint at its last step, the schedule's length kept
    state = json.loads((run_dir / f"global_step_{end}" / "trainer_state.json").read_text())
    assert state["step"] == end and state["total_steps"] == 200
