"""``trainer.stop_when``: the rule (window, threshold, missing metric), its config validation, and the
driver ending a run on it as a normal end does (final checkpoint, exit 0, the same step on resume,
nothing left in flight with one-step-off-policy), with a scripted runner in place of the graph."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hpc_verl.errors import ConfigError, HpcVerlError
from hpc_verl.trainer.config.schema import load_config
from hpc_verl.trainer.driver.early_stop import StopRule, StopWhen
from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: F401

M = "critic/score/mean"


def _rule(window: int = 5, **target: float) -> StopRule:
    return StopRule(StopWhen(metric=M, window_steps=window, **target))


def _feed(rule: StopRule, values: list[float]) -> list[int]:
    """The steps at which the rule says stop."""
    return [s for s, v in enumerate(values, 1) if rule.observe(s, {M: v, "actor/pg_loss": 0.1})]


# ---------------------------------------------------------------- the rule
def test_no_decision_before_the_window_is_full():
    assert _feed(_rule(at_least=0.5), [1.0, 1.0, 1.0, 1.0]) == []
    assert _feed(_rule(at_least=0.5), [1.0] * 5) == [5]
    assert _feed(_rule(window=1, at_least=0.5), [0.1, 0.7]) == [2]


def test_exactly_at_the_threshold_stops_and_just_below_does_not():
    assert _feed(_rule(at_least=0.5), [0.5] * 5) == [5]                       # mean == target: met
    assert _feed(_rule(at_least=0.5), [0.5] * 4 + [0.4999]) == []
    assert _feed(_rule(at_most=0.25), [0.25] * 5) == [5]
    assert _feed(_rule(at_most=0.25), [0.25] * 4 + [0.2501]) == []


def test_the_mean_is_the_last_window_steps_in_step_order():
    vals = [0.0, 0.0, 0.2, 0.9, 1.0, 1.0, 0.9, 0.6, 1.0, 1.0]   # means 0.88 at step 8, 0.9 at 9
    smooth = [sum(vals[i - 5:i]) / 5 for i in range(5, len(vals) + 1)]     # what a reader of metrics.jsonl computes
    first = next(i + 5 for i, v in enumerate(smooth) if v >= 0.9)
    rule = _rule(at_least=0.9)
    steps = _feed(rule, vals)
    assert steps[0] == first == 9


def test_below_the_target_never_stops_and_nan_never_meets_it():
    assert _feed(_rule(at_least=0.9), [0.89] * 50) == []
    assert _feed(_rule(at_least=0.0), [math.nan] + [1.0] * 4) == []
    assert _feed(_rule(at_most=1.0), [math.nan] * 5) == []


@pytest.mark.parametrize("metrics,needle", [
    ({"critic/score/max": 1.0, "critic/score/min": 0.0, "actor/entropy": 2.0}, "is not among the metrics of step 1"),
    ({M: "n/a", "critic/score/max": 1.0}, "is 'n/a', not a number, in the metrics of step 1"),
    ({M: None, "critic/score/max": 1.0}, "is None, not a number"),
])
def test_a_missing_metric_is_one_line_naming_it_and_some_that_exist(metrics, needle):
    with pytest.raises(ConfigError) as ei:
        _rule(at_least=0.5).observe(1, metrics)
    msg = str(ei.value)
    assert "\n" not in msg and needle in msg and f"'{M}'" in msg and "trainer.stop_when.metric" in msg
    assert "critic/score/max" in msg   # the closest of those the step has


def test_seeded_window_continues_across_a_resume():
    recs = [{"step": s, M: v} for s, v in enumerate([0.0, 1.0, 1.0, 1.0, 1.0], 1)]
    rule = _rule(at_least=0.9)
    rule.seed(recs[1:])                 # steps 2-5: four values
    assert rule.check(5) is None
    assert rule.observe(6, {M: 1.0}).step == 6
    gap = _rule(at_least=0.9)
    gap.seed([*recs[1:], {"step": 6}, {"step": 7, M: 1.0}])   # a step without the metric breaks the window
    assert list(gap.values) == [1.0]
    nan = _rule(window=2, at_least=0.0)
    nan.seed([{"step": 1, M: None}])    # metrics.jsonl writes NaN as null
    assert math.isnan(nan.values[0])


# ---------------------------------------------------------------- the config
def test_config_is_off_by_default_and_takes_a_section_or_null(tmp_path):
    assert StopWhen.from_config(load_config(None).trainer.stop_when) is None
    on = load_config(None, [f"trainer.stop_when={{metric: {M}, at_least: 1}}"]).trainer.stop_when
    assert StopWhen.from_config(on) == StopWhen(metric=M, window_steps=5, at_least=1.0)
    assert isinstance(on.at_least, float)
    f = tmp_path / "c.yaml"
    f.write_text(f"trainer:\n  stop_when:\n    metric: actor/pg_loss\n    at_most: -0.5\n    window_steps: 3\n")
    assert StopWhen.from_config(load_config(f).trainer.stop_when) == StopWhen("actor/pg_loss", 3, at_most=-0.5)
    assert StopWhen.from_config(load_config(f, ["trainer.stop_when=null"]).trainer.stop_when) is None
    f.write_text("trainer:\n  stop_when: null\n")
    assert load_config(f).trainer.stop_when.window_steps == 5


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.stop_when.metric=x", "trainer.stop_when.at_least=high"],
     "'trainer.stop_when.at_least': expected a number, got 'high'"),
    (["trainer.stop_when.metric=x", "trainer.stop_when.at_most=true"], "expected a number, got True"),
    (["trainer.stop_when.metric=[a, b]", "trainer.stop_when.at_least=1"],
     "'trainer.stop_when.metric': expected a string"),
    (["trainer.stop_when.window_steps=2.5"], "'trainer.stop_when.window_steps': expected an integer, got 2.5"),
    (["trainer.stop_when.window_steps=0"], "'trainer.stop_when.window_steps': must be > 0"),
    (["trainer.stop_when.at_lest=0.9"], "did you mean 'trainer.stop_when.at_least'"),
    (["trainer.stop_when={metric: x, at_leest: 1}"], "did you mean 'trainer.stop_when.at_least'"),
    (["trainer.stop_when=5"], "'trainer.stop_when' is a section"),
    (["trainer.stop_when.metric=x"], "needs a target: set trainer.stop_when.at_least"),
    (["trainer.stop_when.at_least=0.9"], "is set but trainer.stop_when.metric is null"),
    (["trainer.stop_when.metric=x", "trainer.stop_when.at_least=0", "trainer.stop_when.at_most=1"], "both set"),
    (["trainer.stop_when.metric=x", "trainer.stop_when.at_least=.nan"], "expected a finite number"),
    (["trainer.stop_when.metric=''", "trainer.stop_when.at_least=1"], "expected a metric name"),
])
def test_bad_stop_when_is_one_config_error_line(overrides, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(None, overrides)
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg, msg


def test_cli_refuses_a_bad_type_in_one_line(cli):
    res = cli("train", "--dry-run", "trainer.stop_when.metric=critic/score/mean", "trainer.stop_when.at_least=high")
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "trainer.stop_when.at_least" in lines[0], res.stderr


# ---------------------------------------------------------------- the driver
class ScriptedRunner:
    """The graph replaced by a script: step s scores ``scores[s - 1]``; saves and loads a version file.
    ``stream`` keeps ``depth`` steps in flight as the dataflow runtime does (each item is produced before
    the one ahead of it has finished), and counts what it produced and what finished."""

    def __init__(self, scores: list[float]) -> None:
        self.scores = scores
        self.version = 0
        self.produced = self.finished = 0

    def start(self, cfg, total_steps):
        self.total_steps = total_steps

    def run_step(self, batch):
        self.version += 1
        self.finished += 1
        return {"rollout/policy_version": batch["required_version"], "actor/policy_version": self.version,
                "actor/pg_loss": 0.0, M: self.scores[batch["step"] - 1], "n_responses": 1}

    def stream(self, produce, depth):
        pending, exhausted = [], False
        while True:
            while not exhausted and len(pending) < depth:
                item = produce()
                if item is None:
                    exhausted = True
                    break
                self.produced += 1
                pending.append(item)
            if not pending:
                return
            yield self.run_step(pending.pop(0))

    def call(self, node, method, *args, **kwargs):
        if method == "save_checkpoint":
            Path(args[0]).mkdir(parents=True)
            (Path(args[0]) / "version.json").write_text(str(self.version))
        elif method == "load_checkpoint":
            self.version = int((Path(args[0]) / "version.json").read_text())
        elif method == "get_version":
            return self.version
        elif method == "state_dict":
            return {}
        return None

    def call_all(self, node, method, *args, **kwargs):
        return [self.call(node, method, *args, **kwargs)]

    def publish_policy(self, version):
        pass

    def shutdown(self):
        pass


@pytest.fixture
def model_and_data(tiny_model, digits_data):
    return tiny_model, digits_data


def _trainer(model_and_data, run_dir, scores, *extra):
    from hpc_verl.trainer.driver.ppo_trainer import PPOTrainer
    model, data = model_and_data
    cfg = load_config(None, digit_overrides(model, data, run_dir, 30, (
        "trainer.logger=[file]", f"trainer.stop_when={{metric: {M}, at_least: 0.9}}", *extra)))
    return PPOTrainer(cfg, runner=ScriptedRunner(scores), progress=False)


SCORES = [0.1, 0.1, 0.1, 0.5, 0.9, 1.0, 1.0, 0.9, 0.9] + [1.0] * 21   # 5-step means: 0.86 at step 8, 0.94 at 9


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_run_ends_at_the_step_that_met_the_target_as_a_normal_end(model_and_data, tmp_path, caplog):
    run = tmp_path / "run"
    tr = _trainer(model_and_data, run, SCORES, "trainer.save_freq=4")
    with caplog.at_level("INFO", logger="hpc_verl.trainer"):
        assert tr.fit() == 0
    assert _steps(run) == list(range(1, 10)) and tr.step == 9 and tr.stopped.step == 9
    assert tr.last_checkpoint.name == "global_step_9"
    assert (run / "latest_checkpointed_iteration.txt").read_text() == "9\n"
    state = json.loads((run / "global_step_9" / "trainer_state.json").read_text())
    assert state["step"] == 9 and state["total_steps"] == 30 == tr.total_steps   # the LR schedule's length is kept
    lines = [r.getMessage() for r in caplog.records if "stop_when" in r.getMessage()]
    assert len(lines) == 1 and f"{M} mean over the last 5 steps is 0.94" in lines[0] and "at step 9 of 30" in lines[0]


def test_a_resumed_run_stops_at_the_same_step(model_and_data, tmp_path):
    import shutil
    run = tmp_path / "run"
    assert _trainer(model_and_data, run, SCORES, "trainer.save_freq=8").fit() == 0
    shutil.rmtree(run / "global_step_9")                     # as if it had been preempted after step 8
    (run / "latest_checkpointed_iteration.txt").write_text("8\n")
    tr = _trainer(model_and_data, run, SCORES, "trainer.save_freq=8")
    assert tr.fit() == 0 and tr.start_step == 8 and tr.step == 9     # window = steps 5-8 recorded + step 9
    assert _steps(run) == list(range(1, 10)) and tr.last_checkpoint.name == "global_step_9"
    again = _trainer(model_and_data, run, SCORES, "trainer.save_freq=8")
    assert again.fit() == 0 and again.step == 9 and again.history == []   # met before the resume: no step


def test_one_step_off_policy_finishes_the_step_in_flight_and_starts_no_other(model_and_data, tmp_path):
    run = tmp_path / "run"
    tr = _trainer(model_and_data, run, SCORES, "trainer.n_gpus_per_node=2", "hpc_verl.one_step_off_policy=true",
                  "hpc_verl.device_mapping={actor: [0], rollout: [1]}")
    assert tr.fit() == 0
    assert tr.stopped.step == 9 and tr.step == 10 and _steps(run) == list(range(1, 11))
    assert tr.runner.produced == tr.runner.finished == 10              # nothing left in flight
    assert [m["rollout/staleness"] for m in tr.history] == [0] + [1] * 9
    assert tr.last_checkpoint.name == "global_step_10"
    # a stop at a checkpoint step (the pipeline drained there) has nothing in flight
    tr = _trainer(model_and_data, tmp_path / "run2", SCORES, "trainer.n_gpus_per_node=2", "trainer.save_freq=9",
                  "hpc_verl.one_step_off_policy=true", "hpc_verl.device_mapping={actor: [0], rollout: [1]}")
    assert tr.fit() == 0 and tr.step == 9 == tr.runner.produced


def test_a_metric_the_steps_do_not_have_fails_at_the_first_step(model_and_data, tmp_path):
    run = tmp_path / "run"
    tr = _trainer(model_and_data, run, SCORES, "trainer.stop_when.metric=critic/score/meen")
    with pytest.raises(HpcVerlError) as ei:
        tr.fit()
    msg = str(ei.value)
    assert "\n" not in msg and "'critic/score/meen' is not among the metrics of step 1" in msg and M in msg
    assert _steps(run) == [1]
