"""``python -m hpc_verl.bootstrap.watchdog VERB``: the stall watchdog of a training job, from outside the trainer.

watch   (head node, while the trainer runs) exit ``STALL_EXIT`` once no new step came for the
        timeout (``util.progress`` says what a step is); writes ``stall.json`` in the run directory
dump    (every node, after a stall) the Python stack of every process of the job on this node, with
        py-spy, to ``<run dir>/stacks/<node>/``, and where each waits to ``<node>.where.jsonl``
report  (batch script) the one failure line: "stalled: no step for N s after step K; waiting at ..."

Timeouts: before the first step, ``watchdog.startup_timeout_s`` (model load, engine start-up, the
first weight sync); then ``watchdog.stall_timeout_s`` as given, or, unset, one derived from the first
steps' times: the longest of the first step with its start-up, ``DERIVE_FACTOR`` times the slowest of
the next steps, and ``MIN_DERIVED_S``. While the job checkpoints for a preemption
(``$HPCV_PREEMPT_FILE``) the watchdog waits: that path has its own bound.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hpc_verl.util import procs
from hpc_verl.util.progress import ProgressReader

STALL_FILE = "stall.json"
STACKS_DIR = "stacks"
STALL_EXIT = 3
#: set (to 1) in the environment of the watchdog's own processes, which are not dumped
SELF_ENV = "HPCV_WATCHDOG_SELF"
#: the steps whose times the derived timeout is read from (the first, then the next ones)
DERIVE_STEPS = 3
DERIVE_FACTOR = 10.0
MIN_DERIVED_S = 300.0
POLL_S = 2.0
PYSPY_TIMEOUT_S = 30.0
#: frames of these packages say where a rank waits better than the library frames inside them
JOB_CODE = ("verl", "hpc_verl", "vllm")


def _log(msg: str) -> None:
    print(f"[hpc-verl watchdog {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Limits:
    """What ends a run: no first step within ``startup_s``, then no step within ``stall_s``."""

    startup_s: float
    stall_s: Optional[float] = None   # None: derived from the first steps

    def derive(self, first_s: float, intervals: list[float]) -> float:
        """The derived stall timeout: never shorter than the first step with its start-up."""
        slowest = max(intervals) if intervals else 0.0
        return max(first_s, DERIVE_FACTOR * slowest, MIN_DERIVED_S)


class Watch:
    """The watchdog's state, advanced by :meth:`tick` (clock injected for tests)."""

    def __init__(self, run_dir: str, limits: Limits, preempt_file: str | None = None,
                 clock=time.monotonic) -> None:
        self.run_dir, self.limits, self.preempt_file, self.clock = run_dir, limits, preempt_file, clock
        self.reader = ProgressReader(run_dir)
        self.start = self.last = clock()
        self.step: Optional[int] = None
        self.times: list[float] = []     # when each of the first steps came (clock)
        self.timeout = limits.startup_s
        self.paused = False
        _log(f"watching {run_dir}: the first step must come within {limits.startup_s:.0f} s "
             "(watchdog.startup_timeout_s)")

    def _on_steps(self, steps: list[int], now: float) -> None:
        first = self.step is None
        self.step, self.last = steps[-1], now
        if len(self.times) < DERIVE_STEPS:
            self.times.append(now)
        if self.limits.stall_s is not None:
            if first:
                self.timeout = self.limits.stall_s
                _log(f"step {self.step} after {now - self.start:.0f} s; from now on no step for "
                     f"{self.timeout:.0f} s ends the job (watchdog.stall_timeout_s)")
            return
        if len(self.times) > DERIVE_STEPS or (not first and len(self.times) < 2):
            return
        first_s = self.times[0] - self.start
        intervals = [b - a for a, b in zip(self.times, self.times[1:])]
        chosen = self.limits.derive(first_s, intervals)
        if chosen != self.timeout or first:
            self.timeout = chosen
            slow = f", {DERIVE_FACTOR:g} x the slowest step since ({max(intervals):.0f} s)" if intervals else ""
            _log(f"step {self.step}: no step for {chosen:.0f} s ends the job (derived: the longest of the first step "
                 f"with its start-up ({first_s:.0f} s){slow} and {MIN_DERIVED_S:.0f} s; set "
                 "watchdog.stall_timeout_s to choose)")

    def tick(self) -> Optional[dict]:
        """One look: the stall record when the run has stalled, else None."""
        now = self.clock()
        steps = self.reader.new_steps()
        if steps:
            self._on_steps(steps, now)
        if self.preempt_file and os.path.exists(self.preempt_file):
            if not self.paused:
                _log("preemption: waiting while the trainer checkpoints (its own bound applies)")
            self.paused, self.last = True, now
            return None
        self.paused = False
        quiet = now - self.last
        if quiet < self.timeout:
            return None
        return {"after_step": self.step, "quiet_s": round(quiet), "timeout_s": round(self.timeout),
                "phase": "start-up" if self.step is None else "training"}


def stall_line(stall: dict) -> str:
    """'stalled: no step for N s after step K' (or before the first step)."""
    if stall.get("after_step") is None:
        return (f"stalled: no step for {stall['quiet_s']} s after the train stage started (no first step within "
                f"watchdog.startup_timeout_s={stall['timeout_s']})")
    return f"stalled: no step for {stall['quiet_s']} s after step {stall['after_step']}"


def watch(run_dir: str, limits: Limits, poll_s: float = POLL_S) -> int:
    w = Watch(run_dir, limits, os.environ.get("HPCV_PREEMPT_FILE"))
    while True:
        stall = w.tick()
        if stall is not None:
            _log(stall_line(stall) + "; saving every process's stack")
            tmp = Path(run_dir) / f".{STALL_FILE}.tmp"
            tmp.write_text(json.dumps(stall))
            tmp.replace(Path(run_dir) / STALL_FILE)
            return STALL_EXIT
        time.sleep(poll_s)


# ----------------------------------------------------------------------------- stacks
def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode("utf-8", "replace").split("\0") if "=" in item)


def _is_python(pid: int) -> bool:
    try:
        return "python" in os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def job_processes(run_dir: str, node: str | None) -> list[int]:
    """The Python processes of this job on this node: their environment names the run directory (and
    the node, where SLURM set it: test beds run several nodes on one host), less this process's own."""
    mine = {os.getpid(), os.getppid()}
    out = []
    for pid in sorted(procs.process_table()):
        if pid in mine or not _is_python(pid):
            continue
        env = _environ(pid)
        if env.get("HPCV_RUN_DIR") != run_dir:
            continue
        if node and env.get("SLURMD_NODENAME") not in (None, node):
            continue
        if env.get(SELF_ENV) == "1":   # the watchdog's own processes (the batch script marks them)
            continue
        out.append(pid)
    return out


def pyspy() -> str | None:
    """py-spy: next to this Python (a venv), else on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def where(dump: str) -> Optional[str]:
    """From a py-spy dump: the main thread's innermost frame in job code (verl, hpc_verl, vLLM), else its
    innermost frame, as ``function (file:line)``."""
    blocks: list[tuple[str, list[str]]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            blocks.append((line, []))
        elif blocks and line.startswith("    ") and line.strip().endswith(")"):
            blocks[-1][1].append(line.strip())
    if not blocks:
        return None
    frames = next((f for head, f in blocks if '"MainThread"' in head), blocks[0][1])
    if not frames:
        return None
    for frame in frames:
        func, _, loc = frame[:-1].rpartition(" (")
        short = _job_path(loc)
        if short:
            return f"{func} ({short})"
    return frames[0]


def _job_path(loc: str) -> Optional[str]:
    """``/x/site-packages/verl/a/b.py:195`` -> ``verl/a/b.py:195`` (None: not in job code)."""
    parts = loc.split("/")
    for i in range(len(parts) - 2, -1, -1):   # the innermost package directory of job code
        if parts[i] in JOB_CODE:
            return "/".join(parts[i:])
    return None


def dump(run_dir: str, node: str) -> int:
    """Stacks of this node's job processes to ``stacks/<node>/<pid>.txt``; one summary line each."""
    out_dir = Path(run_dir) / STACKS_DIR / node
    out_dir.mkdir(parents=True, exist_ok=True)
    tool = pyspy()
    pids = job_processes(run_dir, node)
    records = []
    for pid in pids:
        name = _cmdline(pid)[:120]
        if tool is None:
            text, ok = "py-spy is not installed in the job's Python (pip install py-spy)", False
        else:
            try:
                res = subprocess.run([tool, "dump", "--nonblocking", "--full-filenames", "--pid", str(pid)], capture_output=True,
                                     text=True, timeout=PYSPY_TIMEOUT_S)
                text, ok = res.stdout + res.stderr, res.returncode == 0
            except subprocess.TimeoutExpired:
                text, ok = f"py-spy dump did not finish in {PYSPY_TIMEOUT_S:.0f} s", False
        (out_dir / f"{pid}.txt").write_text(f"# {name}\n{text}")
        records.append({"node": node, "pid": pid, "name": name, "where": where(text) if ok else None,
                        "stopped": _stopped(pid),
                        "error": None if ok else text.strip().splitlines()[-1:] or ["no output"]})
    tmp = out_dir.parent / f".{node}.where.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.replace(out_dir.parent / f"{node}.where.jsonl")
    _log(f"{node}: {len(pids)} stack(s) in {out_dir}")
    return 0


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a debugger): state T or t in /proc/PID/stat."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


#: Ray's own helper actors, which wait for work whatever the training does
RAY_HELPERS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE")


def is_rank(name: str) -> bool:
    """A process that does the training's work: a Ray actor of the job (verl's workers, vLLM servers,
    the built-in trainer's ranks) or an engine process (vLLM's)."""
    title = name.split(" ")[0]
    return (title.startswith("ray::") and not title.startswith(RAY_HELPERS)) or title.startswith("VLLM::")


def _frame_short(frame: str) -> str:
    """``f (/x/site-packages/ray/_private/worker.py:9)`` -> ``f (ray/_private/worker.py:9)``."""
    func, _, loc = frame[:-1].rpartition(" (")
    for marker in ("/site-packages/", "/dist-packages/", "/lib/python3"):
        if marker in loc:
            loc = loc.split(marker, 1)[1]
            loc = loc.split("/", 1)[1] if marker == "/lib/python3" else loc
            break
    return f"{func} ({loc})"


#: at most this many processes named in the failure line (the rest are in the stack files)
REPORT_MAX = 12


def _short(name: str) -> str:
    first = name.split(" ")[0]
    return first if first.startswith("ray::") else os.path.basename(first) + (
        f" {name.split(' ')[2]}" if name.split(" ")[1:2] == ["-m"] and len(name.split(" ")) > 2 else "")


def report(run_dir: str) -> str:
    """The failure line: the stall and where each job-code process waits (file:line)."""
    try:
        stall = json.loads((Path(run_dir) / STALL_FILE).read_text())
    except (OSError, ValueError):
        return "stalled (no stall record)"
    records = []
    for path in sorted((Path(run_dir) / STACKS_DIR).glob("*.where.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ranks = [r for r in records if is_rank(r["name"])]
    # stopped processes first, then those in job code: the likeliest culprits lead
    ranks.sort(key=lambda r: (not r.get("stopped"), not (r.get("where") and _job_path(
        r["where"][:-1].rpartition(" (")[2])), r["node"], r["pid"]))
    waits = [f"{r['node']} pid {r['pid']} {_short(r['name'])}{' [stopped]' if r.get('stopped') else ''} in "
             f"{_frame_short(r['where']) if r.get('where') else 'an unknown place (' + str(r.get('error')) + ')'}"
             for r in ranks[:REPORT_MAX]]
    others = len(records) - len(waits)
    tail = f"; waiting at: {'; '.join(waits)}" if waits else (
        f"; {len(records)} process(es), none a Ray actor or engine process" if records else "; no stacks saved")
    tail += f" (and {others} more process(es))" if others and waits else ""
    return f"{stall_line(stall)}{tail}; stacks in {Path(run_dir) / STACKS_DIR}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpc_verl.bootstrap.watchdog")
    sub = p.add_subparsers(dest="verb", required=True)
    w = sub.add_parser("watch")
    w.add_argument("--run-dir", required=True)
    w.add_argument("--stall-timeout-s", default="", help="empty: derived from the first steps")
    w.add_argument("--startup-timeout-s", type=float, required=True)
    w.add_argument("--poll-s", type=float, default=POLL_S)
    d = sub.add_parser("dump")
    d.add_argument("--run-dir", required=True)
    d.add_argument("--node", default=os.environ.get("SLURMD_NODENAME") or os.uname().nodename.split(".")[0])
    r = sub.add_parser("report")
    r.add_argument("--run-dir", required=True)
    args = p.parse_args(argv)
    if args.verb == "watch":
        stall = float(args.stall_timeout_s) if args.stall_timeout_s else None
        return watch(args.run_dir, Limits(args.startup_timeout_s, stall), args.poll_s)
    if args.verb == "dump":
        return dump(args.run_dir, args.node)
    print(report(args.run_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
