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
