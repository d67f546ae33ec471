"""A training run's progress as the stall watchdog reads it, from outside the trainer.

Two sources, one per trainer: the built-in trainer's ``metrics.jsonl`` (one record per step) and,
for upstream verl, ``progress.jsonl`` in the run directory, which the launcher's verl supervisor
appends to for each ``step:N - ...`` line verl prints (verl knows nothing of it). Both are JSON
lines with a ``step``; a new line is progress.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

#: written by ``verl_upstream.supervise`` in the run directory, read by the watchdog
PROGRESS_FILE = "progress.jsonl"
#: the built-in trainer's per-step records (``trainer.metrics``), in the run dir or its checkpoint dir
METRICS_FILE = "metrics.jsonl"
#: verl's console logger: ``step:3 - actor/pg_loss:...`` (maybe behind Ray's ``(TaskRunner pid=1)``)
STEP_LINE = re.compile(r"(?:^|[\s)])step:(\d+) - ")


def step_of_line(line: str) -> int | None:
    """The step number of a verl step line (None: not one)."""
    m = STEP_LINE.search(line)
    return int(m.group(1)) if m else None


def append_step(path: str | os.PathLike[str], step: int) -> None:
    """One progress record (appended whole: a reader sees the line or nothing of it)."""
    line = json.dumps({"step": step, "time": round(time.time(), 3)}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def sources(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The files a run's progress can appear in."""
    root = Path(run_dir)
    return [root / PROGRESS_FILE, root / METRICS_FILE, root / "checkpoints" / METRICS_FILE]


class ProgressReader:
    """New step records since this reader started (records already there belong to an earlier run)."""

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.paths = sources(run_dir)
        self.offsets = {p: self._size(p) for p in self.paths}
        self.partial = {p: b"" for p in self.paths}

    @staticmethod
    def _size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return 0

    def new_steps(self) -> list[int]:
        """Steps recorded since the last call, in file order."""
        out: list[int] = []
        for path in self.paths:
            size = self._size(path)
            if size < self.offsets[path]:   # rewritten from the start
                self.offsets[path], self.partial[path] = 0, b""
            if size == self.offsets[path]:
                continue
            with open(path, "rb") as fh:
                fh.seek(self.offsets[path])
                data = self.partial[path] + fh.read(size - self.offsets[path])
            self.offsets[path] = size
            *lines, self.partial[path] = data.split(b"\n")
            for raw in lines:
                try:
                    step = json.loads(raw).get("step")
                except (ValueError, AttributeError):
                    continue
                if isinstance(step, int):
                    out.append(step)
        return out
