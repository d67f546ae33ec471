"""The stall watchdog (``hpc_verl.bootstrap.watchdog``) and the progress it reads (``util.progress``).

Fast: the timeouts on an injected clock, verl's supervisor recording step lines, and the stacks of real
(SIGSTOPped) processes saved with py-spy. The whole path in a real SLURM job (verl, a rank stopped after
step 2; a real hang in verl's first weight sync) is in test_slurm_verl_cpu.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpc_verl.bootstrap import watchdog
from hpc_verl.util import progress

REPO = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _step(run_dir: Path, n: int, source: str = progress.PROGRESS_FILE) -> None:
    progress.append_step(run_dir / source, n)


def test_startup_then_the_given_timeout(tmp_path):
    clock = Clock()
    _step(tmp_path, 7)                                   # an earlier run's record: not progress of this one
    w = watchdog.Watch(str(tmp_path), watchdog.Limits(startup_s=300, stall_s=60), clock=clock)
    clock.now += 299
    assert w.tick() is None
    clock.now += 2
    stall = w.tick()
    assert stall == {"after_step": None, "quiet_s": 301, "timeout_s": 300, "phase": "start-up"}
    assert "after the train stage started" in watchdog.stall_line(stall)
    # a run that makes its first step: from then on the given timeout, as given
    w = watchdog.Watch(str(tmp_path), watchdog.Limits(startup_s=300, stall_s=60), clock=clock)
    clock.now += 250
    _step(tmp_path, 1)
    assert w.tick() is None
    clock.now += 30
    _step(tmp_path, 2, progress.METRICS_FILE)            # the built-in trainer's records count too
    assert w.tick() is None
    clock.now += 59
    assert w.tick() is None
    clock.now += 2
    stall = w.tick()
    assert stall["after_step"] == 2 and stall["quiet_s"] == 61 and stall["timeout_s"] == 60
    assert watchdog.stall_line(stall) == "stalled: no step for 61 s after step 2"


def test_derived_timeout_is_never_shorter_than_the_first_step_and_is_logged(tmp_path, capsys):
    clock = Clock()
    w = watchdog.Watch(str(tmp_path), watchdog.Limits(startup_s=1800), clock=clock)
    clock.now += 400                                     # start-up + first step
    _step(tmp_path, 1)
    w.tick()
    assert w.timeout == 400
    clock.now += 50
    _step(tmp_path, 2)
    w.tick()
    assert w.timeout == 500                              # 10 x the slowest step since
    clock.now += 5
    _step(tmp_path, 3)
    w.tick()
    assert w.timeout == 500
    err = capsys.readouterr().err
    assert "step 1: no step for 400 s ends the job (derived" in err and "step 2: no step for 500 s" in err
    # a preemption's checkpoint is not a stall: the watchdog waits while the file is there
    preempt = tmp_path / "PREEMPT"
    w.preempt_file = str(preempt)
    preempt.touch()
    clock.now += 10_000
    assert w.tick() is None
    preempt.unlink()
    clock.now += 499
    assert w.tick() is None


def test_verls_supervisor_records_each_step_line_and_passes_the_output_on(tmp_path):
    child = ("import sys\nfor i in (1, 2):\n    print(f'(TaskRunner pid=1) step:{i} - actor/pg_loss:0.5')\n"
             "print('done')\n")
    env = {**os.environ, "HPCV_RUN_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "hpc_verl.verl_upstream.supervise", "--", sys.executable, "-c",
                          child], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["(TaskRunner pid=1) step:1 - actor/pg_loss:0.5",
                                       "(TaskRunner pid=1) step:2 - actor/pg_loss:0.5", "done"]
    records = [json.loads(ln) for ln in (tmp_path / progress.PROGRESS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]


def test_the_report_names_stopped_ranks_first_with_short_frames(tmp_path):
    (tmp_path / watchdog.STALL_FILE).write_text(json.dumps({"after_step": None, "quiet_s": 400, "timeout_s": 360}))
    (tmp_path / "stacks").mkdir()
    site = "/v/lib/python3.11/site-packages"
    recs = [{"node": "node1", "pid": 5, "name": "ray::WorkerDict", "stopped": False,
             "where": "send (/x/verl/workers/rollout/bucketed_weight_transfer.py:195)"},
            {"node": "node2", "pid": 9, "name": "ray::WorkerDict", "stopped": True,
             "where": f"Worker.main_loop ({site}/ray/_private/worker.py:1069)"},
            {"node": "node1", "pid": 3, "name": "python -m hpc_verl.bootstrap worker", "stopped": False,
             "where": "NodeSupervisor._run (hpc_verl/bootstrap/node.py:229)"}]
    (tmp_path / "stacks" / "node1.where.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    line = watchdog.report(str(tmp_path))
    assert line.startswith("stalled: no step for 400 s after the train stage started (no first step within "
                           "watchdog.startup_timeout_s=360); waiting at: node2 pid 9 ray::WorkerDict [stopped] in "
                           "Worker.main_loop (ray/_private/worker.py:1069); node1 pid 5 ray::WorkerDict in send "
                           "(/x/verl/workers/rollout/bucketed_weight_transfer.py:195) (and 1 more process(es))"), line


RANK = textwrap.dedent("""
    import sys, time
    def wait_for_weights():
        while True:
            time.sleep(0.05)
    print("ready", flush=True)
    wait_for_weights()
""")


@pytest.mark.skipif(watchdog.pyspy() is None, reason="py-spy not installed (pip install py-spy)")
def test_stacks_of_a_stopped_rank_are_saved_and_the_report_names_where_it_waits(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir).mkdir()
    script = tmp_path / "hpc_verl" / "rank.py"          # a path of "job code", as a verl or hpc_verl frame is
    script.parent.mkdir()
    script.write_text(RANK)
    procs = []
    for node in ("node1", "node2"):
        env = {**os.environ, "HPCV_RUN_DIR": str(run_dir), "SLURMD_NODENAME": node}
        p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
    other = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "HPCV_RUN_DIR": str(tmp_path / "another")})
    assert other.stdout.readline().strip() == "ready"
    try:
        os.kill(procs[0].pid, signal.SIGSTOP)           # a stopped rank: py-spy reads it without ptrace-stopping
        (run_dir / watchdog.STALL_FILE).write_text(json.dumps({"after_step": 2, "quiet_s": 61, "timeout_s": 60}))
        res = subprocess.run([sys.executable, "-m", "hpc_verl.bootstrap.watchdog", "dump", "--run-dir", str(run_dir),
                              "--node", "node1"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(REPO), watchdog.SELF_ENV: "1",
                                  "HPCV_RUN_DIR": str(run_dir)})
        assert res.returncode == 0, res.stderr
        saved = sorted(p.name for p in (run_dir / "stacks" / "node1").iterdir())
        assert saved == [f"{procs[0].pid}.txt"]          # not node2's, not another job's, not the dumper
        text = (run_dir / "stacks" / "node1" / saved[0]).read_text()
        assert "wait_for_weights" in text, text
        line = watchdog.report(str(run_dir))
        # a Ray actor's title names a rank; the stopped one is marked
        assert line.startswith("stalled: no step for 61 s after step 2; "), line
        records = [json.loads(x) for x in (run_dir / "stacks" / "node1.where.jsonl").read_text().splitlines()]
        assert records[0]["stopped"] is True and records[0]["where"] == "wait_for_weights (hpc_verl/rank.py:5)"
        assert watchdog.is_rank("ray::WorkerDict") and watchdog.is_rank("VLLM::Worker")
        assert not watchdog.is_rank("ray::DashboardAgent") and not watchdog.is_rank("/usr/bin/python -m x")
    finally:
        for p in [*procs, other]:
            p.kill()
            p.wait()
