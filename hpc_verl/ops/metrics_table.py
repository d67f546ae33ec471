"""``hpc-verl logs JOB --metrics``: the trainer's last steps as a table (verl's metric names).

The built-in trainer writes ``metrics.jsonl``. Upstream verl's console logger prints each step as a
line ``step:N - key:value - ...`` (through Ray, behind a ``(TaskRunner pid=...)`` prefix); where
there is no metrics file, those lines are read from the job's logs, so a verl job shows the same
table. A requeued job prints a step again after resuming: the last print of a step counts.

Ray forwards a worker's output line by line as its log monitor reads it, so a line longer than the
worker's write buffer (4 KB; every real verl step line is longer) arrives in pieces: the head keeps
the ``(TaskRunner pid=...)`` prefix and has the next forwarded line glued on, and the rest follows,
unprefixed, a few lines later. The pieces are joined again; a step whose rest never came keeps its
complete items, never a truncated number.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable

from hpc_verl.errors import HpcVerlError

COLUMNS = ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "critic/vf_loss",
           "response_length/mean", "rollout/staleness", "timing_s/step", "perf/throughput")
METRICS_FILE = "metrics.jsonl"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP_START = re.compile(r"(?:^|[\s)])step:(\d+)(?= - )")
_ITEM = re.compile(r"([^\s:]+):(\S+)")
#: Ray's prefix of a forwarded line, ``(TaskRunner pid=12)`` or ``(pid=12, ip=10.0.0.2)``
_RAY_PREFIX = re.compile(r"\((?:[\w.:-]+ )?pid=\d+(?:, ip=[^)\s]+)?\)")
#: the unprefixed rest of a step line that Ray forwarded on its own
_PIECE = re.compile(r"\s*[^\s(]*(?: - [^\s:]+:\S+)+\s*")
#: how far below its head the rest of a cut step line is looked for
PIECE_LOOKAHEAD_LINES = 200
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf)")


def find_metrics(run_dir: str) -> Path | None:
    """The run's metrics.jsonl: in the run dir, or the trainer's default_local_dir below it."""
    root = Path(run_dir)
    for candidate in (root / METRICS_FILE, root / "checkpoints" / METRICS_FILE):
        if candidate.is_file():
            return candidate
    found = sorted(root.glob(f"**/{METRICS_FILE}")) if root.is_dir() else []
    return found[0] if found else None


def steps_from_log(text: str) -> list[dict]:
    """The ``step:N - key:value`` lines of a log as records, one per step (its last print), in order."""
    lines = [_ANSI.sub("", raw) for raw in text.splitlines()]
    used: set[int] = set()
    by_step: dict[int, dict] = {}
    for i, line in enumerate(lines):
        m = _STEP_START.search(line)
        if m is None or i in used:
            continue
        body, whole = _join_pieces(lines, i, m.end(), used)
        rec: dict = {"step": int(m.group(1))}
        items = body.split(" - ")[1:]
        for item in items if whole else items[:-1]:     # the last item of a cut line may be cut too
            kv = _ITEM.fullmatch(item.strip())
            if kv is None:
                break
            value = kv.group(2)
            inner = value[value.find("(") + 1:] if "(" in value else value   # numpy's repr: np.float64(0.5)
            num = _NUMBER.match(inner)
            if num:
                rec[kv.group(1)] = float(num.group(0))
        by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def _glued(text: str) -> tuple[str, bool]:
    """``text`` up to a Ray-prefixed line glued onto it, and whether one was."""
    m = _RAY_PREFIX.search(text)
    return (text[:m.start()], True) if m else (text, False)


def _join_pieces(lines: list[str], i: int, start: int, used: set[int]) -> tuple[str, bool]:
    """The step text that begins at ``lines[i][start:]``, its pieces joined; whether it is whole."""
    body, cut = _glued(lines[i][start:])
    j = i + 1
    while cut:
        for j in range(j, min(len(lines), i + PIECE_LOOKAHEAD_LINES)):
            piece = lines[j]
            if j in used or not piece.strip() or _RAY_PREFIX.match(piece) or _STEP_START.search(piece):
                continue
            rest, cut = _glued(piece)
            if _PIECE.fullmatch(rest):
                break
        else:
            return body, False
        used.add(j)
        body += rest
        j += 1
    return body.rstrip(), True


def last_steps(run_dir: str, logs: Iterable[str] = ()) -> tuple[list[dict], str]:
    """Every step's record and where it came from: metrics.jsonl, else the job's logs."""
    from hpc_verl.trainer.observe.metrics import read_metrics

    path = find_metrics(run_dir)
    if path is not None:
        return read_metrics(path), str(path)
    for log in logs:
        p = Path(log)
        rows = steps_from_log(p.read_text(errors="replace")) if log and p.is_file() else []
        if rows:
            return rows, str(p)
    raise HpcVerlError(f"no {METRICS_FILE} under {run_dir} and no 'step:N - key:value' lines in the job's log yet: "
                       "the trainer reports after its first step")


def print_last_steps(run_dir: str, n: int, logs: Iterable[str] = ()) -> int:
    from rich.console import Console
    from rich.table import Table

    if n < 1:
        raise HpcVerlError(f"--metrics {n}: give a number of steps >= 1")
    rows, source = last_steps(run_dir, logs)
    rows = rows[-n:]
    present = [c for c in COLUMNS if any(isinstance(r.get(c), (int, float)) for r in rows)]
    table = Table(title=f"last {len(rows)} step(s) of {source}")
    table.add_column("step", justify="right")
    for col in present:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r.get("step", "?")),
                      *(f"{r[c]:.4g}" if isinstance(r.get(c), (int, float)) else "-" for c in present))
    Console(width=220).print(table)
    return 0
