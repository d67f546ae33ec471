"""A training curve in the terminal: one metric of ``metrics.jsonl`` as a small block-character chart.

The PNG (``hpc-verl plot``) needs an image viewer; on a login node over ssh the
terminal is what there is. Each column is the mean of an equal run of steps,
drawn with eighth-block characters, so 120 steps fit in 60 columns and 8 rows
without losing the shape; the first and last ``window`` steps' means are the
numbers a person checks ("did it learn?").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from hpc_verl.errors import HpcVerlError

BLOCKS = " ▁▂▃▄▅▆▇█"


@dataclass(frozen=True)
class Curve:
    """One metric's values by step, with the summary a reader wants."""

    key: str
    steps: list[int]
    values: list[float]
    window: int = 10

    @property
    def first_mean(self) -> float:
        head = self.values[:self.window]
        return sum(head) / len(head)

    @property
    def last_mean(self) -> float:
        tail = self.values[-self.window:]
        return sum(tail) / len(tail)


def curve_of(rows: Sequence[dict[str, Any]], key: str = "critic/score/mean", window: int = 10) -> Curve:
    """The metric ``key`` by step (the last record of a repeated step wins, as after a resume)."""
    by_step: dict[int, float] = {}
    for r in rows:
        v = r.get(key)
        if "step" in r and isinstance(v, (int, float)) and math.isfinite(v):
            by_step[int(r["step"])] = float(v)
    if not by_step:
        raise HpcVerlError(f"no '{key}' values in the metrics (keys there: "
                           f"{', '.join(sorted({k for r in rows for k in r})[:12]) or 'none'})")
    steps = sorted(by_step)
    return Curve(key, steps, [by_step[s] for s in steps], max(1, min(window, len(steps))))


def chart_lines(curve: Curve, width: int = 60, height: int = 8) -> list[str]:
    """The chart as plain lines: a y-axis with three labels, the columns, the step range below."""
    values, n = curve.values, len(curve.values)
    cols = max(1, min(width, n))
    buckets = [values[i * n // cols:(i + 1) * n // cols] or [values[min(i * n // cols, n - 1)]] for i in range(cols)]
    means = [sum(b) / len(b) for b in buckets]
    lo, hi = min(means), max(means)
    if curve.key.startswith(("reward", "critic/score")):  # scores live in [0, 1]: a fixed scale, runs compare
        lo, hi = min(lo, 0.0), max(hi, 1.0)
    span = (hi - lo) or 1.0
    eighths = [round((m - lo) / span * height * 8) for m in means]
    labels = {0: f"{hi:.2f}", height // 2: f"{(lo + hi) / 2:.2f}", height - 1: f"{lo:.2f}"}
    pad = max(len(t) for t in labels.values())
    lines = []
    for row in range(height):
        level = (height - 1 - row) * 8  # eighths below this row
        cells = "".join(BLOCKS[max(0, min(8, e - level))] for e in eighths)
        lines.append(f"{labels.get(row, ''):>{pad}} ┤{cells}")
    first, last = str(curve.steps[0]), str(curve.steps[-1])
    lines.append(f"{'':>{pad}} └{'─' * cols}")
    lines.append(f"{'':>{pad}}  {first}{last:>{max(cols - len(first), len(last) + 1)}} step")
    return lines


def steps_per_column(curve: Curve, width: int = 60) -> float:
    return len(curve.values) / max(1, min(width, len(curve.values)))


def render(curve: Curve, width: int = 60, height: int = 8) -> Any:
    """A rich Panel: the chart and the first/last means."""
    from rich.panel import Panel
    from rich.text import Text

    body = Text("\n".join(chart_lines(curve, width, height)), style="green")
    body.append(f"\nmean {curve.key}: first {curve.window} steps {curve.first_mean:.3f} -> last {curve.window} "
                f"steps {curve.last_mean:.3f}", style="bold")
    per = steps_per_column(curve, width)
    title = f"{curve.key} over {len(curve.steps)} steps" + (f" ({per:.3g} per column)" if per > 1 else "")
    return Panel(body, title=title, expand=False)
