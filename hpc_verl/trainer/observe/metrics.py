"""What the user sees: a rich progress bar per step, metrics.jsonl, a PNG of the curves, a summary table."""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable

from hpc_verl.errors import HpcVerlError
from hpc_verl.util.fs import atomic_target
from hpc_verl.util.fs import atomic_write_text

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "curves.png"

# the curves worth a panel, in order; missing ones are skipped
PLOT_KEYS = ("critic/score/mean", "actor/reward_kl_penalty", "actor/ppo_kl", "actor/pg_loss", "critic/vf_loss",
             "actor/entropy", "response_length/mean", "perf/tokens_per_s", "actor/grad_norm")


class MetricsLog:
    """Append one JSON object per step to ``<run_dir>/metrics.jsonl`` (flushed each line)."""

    def __init__(self, run_dir: str | os.PathLike[str], resume_step: int = 0) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step and self.path.exists():
            # drop steps after the checkpoint we resume from: they will be recomputed
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        elif not resume_step and self.path.exists():
            self.path.unlink()
        self._fh = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(_jsonable(record), sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif hasattr(v, "item"):
            out[k] = v.item()
        else:
            out[k] = v
    return out


def read_metrics(path: str | os.PathLike[str]) -> list[dict]:
    p = Path(path)
    if p.is_dir():
        p = p / METRICS_FILE
    if not p.is_file():
        raise HpcVerlError(f"{p} not found; give a run directory of 'hpc-verl train' (it holds {METRICS_FILE})")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            raise HpcVerlError(f"{p} line {n}: not valid JSON; the metrics file is damaged") from None
    return rows


class StepProgress:
    """A rich progress bar whose description carries the latest reward, KL, losses and throughput."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        self.enabled = enabled
        self.progress = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        console = Console(file=sys.stderr)
        self.progress = Progress(TextColumn("[bold]PPO"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), console=console, transient=False)
        self.task = self.progress.add_task("starting", total=total_steps, completed=start_step)
        self.progress.start()

    def update(self, step: int, m: dict) -> None:
        if not self.progress:
            return
        parts = [f"score {m.get('critic/score/mean', float('nan')):.3f}", f"kl {m.get('actor/ppo_kl', 0.0):.4f}",
                 f"pg {m.get('actor/pg_loss', float('nan')):+.3f}"]
        if "critic/vf_loss" in m:
            parts.append(f"vf {m['critic/vf_loss']:.3f}")
        parts.append(f"{m.get('perf/samples_per_s', 0.0):.1f} samples/s")
        parts.append(f"{m.get('perf/tokens_per_s', 0.0):.0f} tok/s")
        self.progress.update(self.task, completed=step, description=" | ".join(parts))

    def close(self) -> None:
        if self.progress:
            self.progress.stop()


def summary_table(rows: list[dict], run_dir: str | os.PathLike[str], file: Any = None) -> None:
    """First/last/best of the main metrics, printed as a rich table."""
    from rich.console import Console
    from rich.table import Table
    if not rows:
        return
    table = Table(title=f"PPO run summary ({run_dir})")
    for col in ("metric", "first", "last", "best"):
        table.add_column(col, justify="right" if col != "metric" else "left")
    for key in ("critic/score/mean", "actor/reward_kl_penalty", "actor/ppo_kl", "actor/pg_loss", "critic/vf_loss",
                "actor/entropy", "response_length/mean", "perf/samples_per_s", "perf/tokens_per_s", "timing_s/step"):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if not vals:
            continue
        best = max(vals) if key.startswith(("critic/score", "perf")) else min(vals)
        table.add_row(key, f"{vals[0]:.4g}", f"{vals[-1]:.4g}", f"{best:.4g}")
    table.add_row("steps", str(rows[0].get("step")), str(rows[-1].get("step")), "")
    Console(file=file or sys.stderr).print(table)


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
             keys: Iterable[str] = PLOT_KEYS) -> Path:
    """Write a PNG with one panel per metric curve (matplotlib, Agg backend: no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    by_step: dict[int, dict] = {}
    for r in rows:  # a resumed run may repeat steps: the last record wins
        if "step" in r:
            by_step[int(r["step"])] = r
    steps = sorted(by_step)
    present = [k for k in keys if any(isinstance(by_step[s].get(k), (int, float)) for s in steps)]
    if not steps or not present:
        raise HpcVerlError(f"{run_dir}: no plottable metrics yet (is the run past its first step?)")
    cols = 2
    nrows = -(-len(present) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(10, 2.8 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, present):
        xs = [s for s in steps if isinstance(by_step[s].get(key), (int, float))]
        ax.plot(xs, [by_step[s][key] for s in xs], lw=1.5)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    target = Path(out) if out else Path(run_dir) / PLOT_FILE
    try:
        with atomic_target(target) as tmp:
            fig.savefig(tmp, dpi=90, format="png")  # (the temp name ends in .tmp)
    finally:
        plt.close(fig)
    return target
