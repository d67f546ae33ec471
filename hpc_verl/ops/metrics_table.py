"""``hpc-verl logs JOB --metrics``: the trainer's last steps as a table (verl's metric names)."""
from __future__ import annotations

from pathlib import Path

from hpc_verl.errors import HpcVerlError

COLUMNS = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "critic/vf_loss",
           "response_length/mean", "rollout/staleness", "timing_s/step", "perf/throughput")
METRICS_FILE = "metrics.jsonl"


def find_metrics(run_dir: str) -> Path:
    """The run's metrics.jsonl: in the run dir, or the trainer's default_local_dir below it."""
    root = Path(run_dir)
    for candidate in (root / METRICS_FILE, root / "checkpoints" / METRICS_FILE):
        if candidate.is_file():
            return candidate
    found = sorted(root.glob(f"**/{METRICS_FILE}")) if root.is_dir() else []
    if found:
        return found[0]
    raise HpcVerlError(f"no {METRICS_FILE} under {root} yet: the trainer writes it after its first step "
                       f"(or this job does not run the built-in trainer)")


def print_last_steps(run_dir: str, n: int) -> int:
    from rich.console import Console
    from rich.table import Table

    from hpc_verl.trainer.metrics import read_metrics

    if n < 1:
        raise HpcVerlError(f"--metrics {n}: give a number of steps >= 1")
    path = find_metrics(run_dir)
    rows = read_metrics(path)[-n:]
    present = [c for c in COLUMNS if any(isinstance(r.get(c), (int, float)) for r in rows)]
    table = Table(title=f"last {len(rows)} step(s) of {path}")
    table.add_column("step", justify="right")
    for col in present:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.get("step", "?")),
                      *(f"{r[c]:.4g}" if isinstance(r.get(c), (int, float)) else "-" for c in present))
    Console(width=220).print(table)
    return 0
