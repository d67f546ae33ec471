"""One side of a benchmark as a tagged tree of processes: its memory, its CPU time, what it leaves behind.

A side that starts Ray has processes that are not its children (the raylet starts
the workers, a worker starts vLLM's engine core), so the tree is found by a tag
instead: ``tag_env()`` puts ``HPCV_BENCH_TAG=<unique>`` in the side's environment,
every process it starts inherits it, and :class:`TreeSampler` reads
``/proc/*/environ`` for it.

While the side runs the sampler records the sum of resident memory (RSS, from
``statm``) and of proportional memory (PSS, ``smaps_rollup``: shared library
pages split among the processes mapping them) at each tick and keeps the peaks;
and the CPU time of the tree against the machine's busy time on the side's CPUs,
which gives the *foreign* load: CPU time someone else spent on those CPUs during
the run (a noisy run is refused by the caller). ``leftovers()`` lists what is
still alive after the side's main process ended; ``kill_leftovers()`` ends it.
"""
from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Sequence

TAG = "HPCV_BENCH_TAG"
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")


def tag_env() -> dict[str, str]:
    """The environment entry that marks every process of one run."""
    return {TAG: uuid.uuid4().hex}


def tagged(tag: str, known: dict[int, bool] | None = None) -> list[int]:
    """Pids whose environment carries ``tag`` (``known`` caches the answer per pid)."""
    needle = f"{TAG}={tag}".encode()
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        hit = known.get(pid) if known is not None else None
        if hit is None:
            try:
                hit = needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if known is not None:
                known[pid] = hit
        if hit:
            out.append(pid)
    return out


def _rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0


def _cpu_ticks(pid: int) -> int:
    """utime + stime of the process itself (its children count on their own)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return 0


def busy_ticks(cpus: Sequence[int]) -> int:
    """Non-idle ticks of ``cpus`` since boot (``/proc/stat``)."""
    total = 0
    wanted = {f"cpu{c}" for c in cpus}
    for line in Path("/proc/stat").read_text().splitlines():
        parts = line.split()
        if parts and parts[0] in wanted:
            vals = [int(v) for v in parts[1:]]
            total += sum(vals) - vals[3] - (vals[4] if len(vals) > 4 else 0)   # minus idle and iowait
    return total


class TreeSampler(threading.Thread):
    """Peaks of RSS and PSS of a tagged tree, and its CPU time against the machine's, until ``stop()``."""

    def __init__(self, tag: str, cpus: Sequence[int], interval_s: float = 0.25, pss_every: int = 4) -> None:
        super().__init__(daemon=True)
        self.tag, self.cpus, self.interval_s, self.pss_every = tag, list(cpus), interval_s, pss_every
        self.peak_rss = self.peak_pss = 0
        self.max_procs = 0
        self._known: dict[int, bool] = {}
        self._ticks: dict[int, int] = {}
        self._busy0 = busy_ticks(self.cpus)
        self._t0 = time.time()
        self._halt = threading.Event()

    def run(self) -> None:
        n = 0
        while not self._halt.is_set():
            self.sample(with_pss=n % self.pss_every == 0)
            n += 1
            self._halt.wait(self.interval_s)

    def sample(self, with_pss: bool = True) -> None:
        pids = tagged(self.tag, self._known)
        self.max_procs = max(self.max_procs, len(pids))
        self.peak_rss = max(self.peak_rss, sum(_rss(p) for p in pids))
        if with_pss:
            self.peak_pss = max(self.peak_pss, sum(_pss(p) for p in pids))
        for p in pids:
            self._ticks[p] = max(self._ticks.get(p, 0), _cpu_ticks(p))

    def stop(self) -> dict[str, float]:
        """End sampling; the figures: peaks in GB, the tree's and the foreign CPU seconds."""
        self._halt.set()
        self.join(timeout=5)
        elapsed = time.time() - self._t0
        busy = (busy_ticks(self.cpus) - self._busy0) / _TICK
        own = sum(self._ticks.values()) / _TICK
        foreign = max(busy - own, 0.0)
        return {"peak_rss_gb": round(self.peak_rss / 1e9, 3), "peak_pss_gb": round(self.peak_pss / 1e9, 3),
                "max_processes": self.max_procs, "cpu_s": round(own, 1), "foreign_cpu_s": round(foreign, 1),
                "foreign_load": round(foreign / max(elapsed * len(self.cpus), 1e-9), 3)}


def leftovers(tag: str) -> list[int]:
    return [p for p in tagged(tag) if p != os.getpid()]


def kill_leftovers(tag: str, wait_s: float = 5.0) -> list[str]:
    """SIGKILL what of the run is still alive; the command lines of what was found."""
    found = []
    for pid in leftovers(tag):
        try:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80])
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    deadline = time.time() + wait_s
    while leftovers(tag) and time.time() < deadline:
        time.sleep(0.1)
    return found
