"""``trainer.stop_when``: end a run once a metric's mean over its last steps reaches a target.

The driver decides from the step metrics it records anyway (``metrics.jsonl``), so there is
one decision for all ranks, taken at a step boundary, and the run then ends as a normal end
does (final checkpoint, exit 0). ``trainer.total_training_steps`` keeps its meaning for the
learning-rate schedule: up to the stop, a run is the run without the key. Driver; no torch.
"""
from __future__ import annotations

import difflib
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from hpc_verl.errors import ConfigError

_SHOWN = 6   # metric names a missing-metric error suggests


@dataclass(frozen=True)
class StopWhen:
    """A validated ``trainer.stop_when`` section (``config.schema`` checked types and combinations)."""

    metric: str
    window_steps: int
    at_least: float | None = None
    at_most: float | None = None

    @classmethod
    def from_config(cls, section: Mapping[str, Any] | None) -> StopWhen | None:
        """The rule of ``trainer.stop_when``; None when it is off (no metric)."""
        if not section or section.get("metric") is None:
            return None
        return cls(metric=str(section["metric"]), window_steps=int(section.get("window_steps") or 5),
                   at_least=section.get("at_least"), at_most=section.get("at_most"))

    def reached(self, mean: float) -> bool:
        """Whether a window mean meets the target (NaN never does)."""
        if self.at_least is not None:
            return mean >= self.at_least
        return self.at_most is not None and mean <= self.at_most

    def target(self) -> str:
        return f">= {self.at_least:g}" if self.at_least is not None else f"<= {self.at_most:g}"


@dataclass(frozen=True)
class StopDecision:
    """The step at which the target was met, and the window mean that met it."""

    step: int
    mean: float
    when: StopWhen

    def line(self, total_steps: int) -> str:
        """The one log line of the decision."""
        w = self.when
        return (f"stop_when: {w.metric} mean over the last {w.window_steps} steps is {self.mean:.6g} "
                f"({w.target()}) at step {self.step} of {total_steps}; ending the run")


class StopRule:
    """The last ``window_steps`` values of the metric; says when their mean meets the target.

    The mean is ``sum(window) / window_steps`` in step order, the same float a reader of
    ``metrics.jsonl`` computes, so a test can tell exactly at which step a run must stop.
    """

    def __init__(self, when: StopWhen) -> None:
        self.when = when
        self.values: deque[float] = deque(maxlen=when.window_steps)

    def seed(self, records: Iterable[Mapping[str, Any]]) -> None:
        """The recorded steps before a resume, in step order (``metrics.jsonl`` up to the checkpoint):
        a resumed run stops where an uninterrupted one would. A step without the metric (a run
        with another config) breaks the window."""
        for r in records:
            if self.when.metric not in r:
                self.values.clear()
                continue
            v = r[self.when.metric]
            self.values.append(math.nan if v is None else float(v))   # (metrics.jsonl writes NaN as null)

    def observe(self, step: int, metrics: Mapping[str, Any]) -> StopDecision | None:
        """Take ``step``'s metrics; the decision when the window is full and its mean meets the target."""
        value = metrics.get(self.when.metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(_missing_line(self.when.metric, step, metrics, value))
        self.values.append(float(value))
        return self.check(step)

    def check(self, step: int) -> StopDecision | None:
        """The decision on the values held now (None: keep training)."""
        if len(self.values) < self.when.window_steps:
            return None
        mean = sum(self.values) / self.when.window_steps
        return StopDecision(step, mean, self.when) if self.when.reached(mean) else None


def _missing_line(metric: str, step: int, metrics: Mapping[str, Any], value: Any) -> str:
    """One line: the metric is not a number at this step; the closest numeric metrics it has."""
    numeric = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    close = difflib.get_close_matches(metric, numeric, n=_SHOWN, cutoff=0.0)
    what = "is not among" if metric not in metrics else f"is {value!r}, not a number, in"
    return (f"config key 'trainer.stop_when.metric'={metric!r} {what} the metrics of step {step}; "
            f"closest of its {len(numeric)} numeric metrics: {', '.join(close)}")
