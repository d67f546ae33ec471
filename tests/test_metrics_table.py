"""``hpc-verl logs JOB --metrics`` for upstream verl: the steps come from verl's console lines in the
job's log (verl writes no metrics.jsonl), as printed through Ray; a resumed step counts once."""
from __future__ import annotations

import pytest

from hpc_verl.errors import HpcVerlError
from hpc_verl.ops.metrics_table import last_steps, steps_from_log

VERL_LOG = (
    "\x1b[36m(TaskRunner pid=4121)\x1b[0m step:1 - actor/pg_loss:np.float64(-0.25) - critic/score/mean:0.0 - "
    "timing_s/step:2.51 - perf/throughput:1.2e3\n"
    "(TaskRunner pid=4121) Training Progress:  50%|#####     | 1/2\n"
    "(TaskRunner pid=4121) step:2 - critic/score/mean:0.125 - timing_s/step:nan\n"
    "hpc-verl: requeued\n"
    "(TaskRunner pid=5000) step:2 - critic/score/mean:0.25 - timing_s/step:2.0\n"
    "(TaskRunner pid=5000) step:3 - critic/score/mean:0.5 - timing_s/step:2.1\n")


def test_steps_from_verl_console_lines() -> None:
    rows = steps_from_log(VERL_LOG)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["actor/pg_loss"] == -0.25 and rows[0]["perf/throughput"] == 1200.0
    assert rows[1]["critic/score/mean"] == 0.25          # the resumed run's print of step 2
    assert steps_from_log("no steps here\nstep:x - a:1\n") == []


def _verl_line(step: int, n_items: int) -> str:
    return f"step:{step} - " + " - ".join(f"timing_s/part_{k}:{step}.{k:04d}123456789" for k in range(n_items))


def test_a_long_step_line_that_ray_forwarded_in_pieces_is_joined() -> None:
    # As seen with verl 0.9.1 under Ray 2.x: a step line longer than 4 KB is forwarded as a head,
    # with the next forwarded line glued on, and its rest later on a line of its own; a second
    # step's head can come before the first step's rest.
    line1, line2, line3 = _verl_line(1, 120), _verl_line(2, 120), _verl_line(3, 120)
    cut1 = line1.index("part_60:") + len("part_60:1.00")     # inside a number
    cut2 = line2.index(" - timing_s/part_70") + 2           # right after " -"
    cut3 = line3.index("part_90:") + 4                       # inside a key, and the rest never comes
    log = "\n".join([
        "\x1b[36m(TaskRunner pid=7)\x1b[0m " + line1[:cut1]
        + "\x1b[36m(WorkerDict pid=9)\x1b[0m INFO: update_weights done, time cost: 0.03s",
        "(AgentLoopWorker pid=11) WARNING: no builder",
        "(TaskRunner pid=7) " + line2[:cut2] + "(WorkerDict pid=9) INFO: saved",
        "Training Progress:  50%|#####     | 1/2",
        "done",
        line1[cut1:],
        "(TaskRunner pid=7) ",
        line2[cut2:],
        "(TaskRunner pid=7) " + line3[:cut3] + "(TaskRunner pid=7) ",
        "[hpc-verl 10:00:00] time limit changed",
    ]) + "\n"
    rows = steps_from_log(log)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["timing_s/part_60"] == 1.0060123456789 and len(rows[0]) == 121
    assert rows[1]["timing_s/part_70"] == 2.0070123456789 and len(rows[1]) == 121
    assert len(rows[2]) == 1 + 90 and rows[2]["timing_s/part_89"] == 3.0089123456789   # parts 0..89, not the cut one
    # a line that is itself whole keeps its items up to one that is not key:value
    assert steps_from_log("step:4 - a:1 - b:two words - c:3\n") == [{"step": 4, "a": 1.0}]


def test_metrics_file_first_then_the_log(tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    log = tmp_path / "job.out"
    log.write_text(VERL_LOG)
    rows, source = last_steps(str(run), [str(log)])
    assert source == str(log) and len(rows) == 3
    (run / "metrics.jsonl").write_text('{"step": 7, "critic/score/mean": 1.0}\n')
    rows, source = last_steps(str(run), [str(log)])
    assert source.endswith("metrics.jsonl") and rows == [{"step": 7, "critic/score/mean": 1.0}]
    with pytest.raises(HpcVerlError, match="no metrics.jsonl"):
        last_steps(str(tmp_path / "none"), [str(tmp_path / "missing.out")])
