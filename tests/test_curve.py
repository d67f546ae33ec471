"""The terminal curve (hpc_verl.ops.curve, `hpc-verl plot`) and the README's main job (examples/job_local_digits.yaml)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_verl.errors import HpcVerlError
from hpc_verl.ops.curve import BLOCKS, chart_lines, curve_of

REPO = Path(__file__).resolve().parents[1]


def rows(values, key="critic/score/mean"):
    return [{"step": i + 1, key: v} for i, v in enumerate(values)]


def columns(lines):
    """The chart body as a list of column heights (in eighths), read back from the characters."""
    body = [ln.split("┤", 1)[1] for ln in lines if "┤" in ln]
    width = max(len(b) for b in body)
    heights = []
    for c in range(width):
        heights.append(sum(BLOCKS.index(b[c]) if c < len(b) and b[c] in BLOCKS else 0 for b in body))
    return heights


def test_a_rising_reward_draws_rising_columns():
    values = [min(1.0, i / 100) for i in range(120)]
    c = curve_of(rows(values))
    lines = chart_lines(c, width=60, height=8)
    h = columns(lines)
    assert len(h) == 60 and h == sorted(h) and h[0] <= 1 and h[-1] >= 62  # 8 rows x 8 eighths at the top
    assert lines[0].startswith("1.00 ┤") and lines[7].startswith("0.00 ┤")  # rewards on a fixed 0..1 scale
    assert lines[-1].split()[:2] == ["1", "120"]
    assert c.first_mean == pytest.approx(sum(values[:10]) / 10) and c.last_mean == pytest.approx(1.0)


def test_fewer_steps_than_columns_and_other_metrics():
    c = curve_of(rows([5.0, 3.0, 1.0], key="actor/entropy"), "actor/entropy")
    lines = chart_lines(c, width=60, height=4)
    h = columns(lines)
    assert len(h) == 3 and h[0] > h[1] > h[2] == 0  # own scale: the minimum sits on the axis
    assert lines[0].startswith("5.00 ┤") and lines[3].startswith("1.00 ┤")


def test_repeated_steps_keep_the_last_record_and_missing_metric_is_one_line():
    c = curve_of([{"step": 1, "critic/score/mean": 0.1}, {"step": 2, "critic/score/mean": 0.9}, {"step": 2, "critic/score/mean": 0.3}])
    assert c.values == [0.1, 0.3]
    with pytest.raises(HpcVerlError, match="no 'actor/ppo_kl' values"):
        curve_of([{"step": 1, "critic/score/mean": 0.1}], "actor/ppo_kl")


def test_plot_cli_draws_the_curve_and_checks_the_final_mean(cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    values = [i / 40 for i in range(40)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(values)))
    res = cli("plot", str(run), "--require-final", "0.5")
    assert res.returncode == 0, res.stderr
    assert (run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "critic/score/mean over 40 steps" in res.stdout and "last 10 steps 0.863" in res.stdout and "█" in res.stdout
    res = cli("plot", str(run), "--require-final", "0.9")
    assert res.returncode == 1 and "is 0.863, below --require-final 0.9" in res.stderr
    res = cli("plot", str(run), "--metric", "nope")
    assert res.returncode == 2 and "no 'nope' values" in res.stderr and "Traceback" not in res.stderr


def test_main_job_uses_the_learning_tests_settings():
    """examples/job_local_digits.yaml is the learning proof's config as a job file (no drift)."""
    from hpc_verl.launch.spec.jobconfig import load_job_config
    from trainer_fixtures import digit_overrides

    job = load_job_config(str(REPO / "examples" / "job_local_digits.yaml"))
    proof = dict(o.split("=", 1) for o in digit_overrides(Path("m"), Path("d"), Path("r"), 120))
    mine = {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in job.trainer.overrides.items()}
    launcher = {"actor_rollout_ref.model.path", "data.train_files", "hpc_verl.run_dir", "hpc_verl.progress",
                "trainer.n_gpus_per_node"}   # (the allocation's: the local profile gives one CPU rank)
    for key, value in proof.items():
        if key in launcher:
            continue
        assert key in mine, key
        assert float(mine[key]) == float(value) if value.replace(".", "").replace("e-", "").isdigit() \
            else mine[key] == value, (key, mine[key], value)
    assert (job.model.path, job.data.dir, job.data.raw) == ("models/tiny", "data/digits", None)
