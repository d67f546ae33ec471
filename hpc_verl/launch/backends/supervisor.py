"""The one owner of a local job's processes: ``python -m hpc_verl.launch.backends.supervisor supervise JOB_DIR``.

Every local job, foreground or detached, runs under one supervisor in a session of its own.
It makes itself a child subreaper, so whatever the job starts (steps under ``setsid``, the
Ray daemons ``ray start`` leaves behind, Ray's agents) stays in its process tree, even once
their parents are gone; it runs the job's script, forwards a stop signal to it once (the
script's trap stops the trainer and Ray in order), and when the script has ended it ends
every process still in its tree and their process groups, removes Ray temp dirs a killed
node left, and records the exit status. Nothing depends on an environment marker (Ray's
agents do not inherit it) or on the terminal that started the job (a foreground submit
only follows the log, so a closed ssh session or a dead pipe cannot kill the script
before its clean-up).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from hpc_verl.launch import registry
from hpc_verl.util import procs
from hpc_verl.util.package import with_package_on_pythonpath

MODULE = "hpc_verl.launch.backends.supervisor"   # python -m MODULE supervise JOB_DIR
MARKER_ENV = "HPCV_LOCAL_JOB"   # every process of the script inherits it: the last resort of cancel()
LOG_NAME = "job.log"
#: how long the job's processes may take to end by themselves after the script (Ray: a few seconds)
REAP_WAIT_S = 5.0
REAP_GRACE_S = 5.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: how often the watchdog notes the sessions and processes of the job (see :func:`watch`)
WATCH_POLL_S = 0.25
WATCH_STOP = b"q"
# SLURM variables the script would take for its own (job id, submit dir, restart count, CPUs)
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_SUBMIT_DIR", "SLURM_RESTART_COUNT", "SLURM_CPUS_PER_TASK",
               "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS")


@contextlib.contextmanager
def updating(job_dir: str) -> Iterator[registry.JobRecord]:
    """The job's record, loaded and saved under a lock (the supervisor and ``cancel`` both write it)."""
    with open(Path(job_dir) / ".job.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rec = registry.load(job_dir)
        yield rec
        rec.save()


def profile_of(rec: registry.JobRecord) -> dict[str, Any]:
    try:
        return json.loads((Path(rec.job_dir) / "profile.json").read_text())
    except (OSError, ValueError):
        return {}


def job_env(rec: registry.JobRecord, cpus: int) -> dict[str, str]:
    """The script's environment: ours, minus SLURM's job variables, plus the job marker."""
    env = with_package_on_pythonpath({k: v for k, v in os.environ.items() if k not in _SLURM_VARS})
    env[MARKER_ENV] = rec.job_dir
    env.setdefault("HPCV_RAY_NUM_CPUS", str(cpus))
    return env


def runs(pid: int | None, job_dir: str) -> bool:
    """``pid`` lives and is this job's supervisor or script (its command line names the job dir;
    guards against a reused pid)."""
    if not procs.alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return job_dir.encode() in fh.read()
    except OSError:
        return False


def marked_pids(job_dir: str) -> list[int]:
    """Live processes carrying this job's marker (all but Ray's agents); for a supervisor-less cancel."""
    mark = f"{MARKER_ENV}={job_dir}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark in (d / "environ").read_bytes().split(b"\0") and procs.alive(int(d.name)):
                out.append(int(d.name))
        except OSError:
            continue
    return out


def end_marked(job_dir: str, grace_s: float = 3.0) -> list[int]:
    """TERM, then KILL, the live processes outside our tree that carry the job's marker (an attached
    shell inherits it from the job's attach.sh); returns their pids."""
    pids = marked_pids(job_dir)
    procs.end_pids(pids, grace_s)
    return pids


# ---------------------------------------------------------------------------- the supervisor
class Supervisor:
    """Runs the script of one job and owns everything it starts (see the module docstring)."""

    def __init__(self, job_dir: str) -> None:
        self.job_dir = job_dir
        self.script: subprocess.Popen | None = None
        self.stop_signal: int | None = None

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stop_signal is not None:
            return                      # once: the script's clean-up is running
        self.stop_signal = signum
        self._forward()

    def _forward(self) -> None:
        if self.script is not None and self.stop_signal is not None and self.script.poll() is None:
            try:
                os.kill(self.script.pid, self.stop_signal)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        procs.become_subreaper()
        watchdog, stop_watchdog = start_watchdog(self.job_dir)
        for sig in FORWARDED:
            signal.signal(sig, self._on_signal)
        with updating(self.job_dir) as rec:
            cpus = int(profile_of(rec).get("slurm", {}).get("cpus_per_task") or 0)
            with open(Path(self.job_dir) / LOG_NAME, "ab") as log:
                self.script = subprocess.Popen(["bash", rec.script], cwd=rec.submit_dir or None,
                                               env=job_env(rec, cpus), stdin=subprocess.DEVNULL, stdout=log,
                                               stderr=subprocess.STDOUT)
            rec.pid = self.script.pid
            rec.supervisor_pid = os.getpid()
            rec.dry_run = False
        self._forward()                 # a signal that came during the start
        rc = self.script.wait()
        if rc < 0:                      # killed by a signal: the shell's convention, 128 + signal number
            rc = 128 - rc
        left = procs.reap_tree(os.getpid(), wait_s=REAP_WAIT_S, grace_s=REAP_GRACE_S, keep=(watchdog.pid,))
        left += end_marked(self.job_dir)   # outside the tree: a shell of `hpc-verl attach JOB`
        removed = remove_ray_temp_dirs(self.job_dir)
        note = []
        if left:
            note.append(f"ended {len(left)} processes the job left behind")
        if removed:
            note.append(f"removed Ray temp dir(s) {', '.join(removed)}")
        self._log(f"job ended with exit status {rc}" + (f"; {'; '.join(note)}" if note else ""))
        if rc == 0:
            try:
                make_plot(registry.load(self.job_dir))
            except Exception as exc:  # a plot is a nicety; the run's results are already there
                self._log(f"warning: no plot: {type(exc).__name__}: {exc}".splitlines()[0])
        with updating(self.job_dir) as rec:   # last: a recorded exit status means the job is over
            rec.exit_code = rc
            if self.stop_signal is not None and not rec.cancelled:
                rec.cancelled = True
                rec.stop_reason = rec.stop_reason or f"{signal.Signals(self.stop_signal).name} to the job"
        stop_watchdog()
        return rc

    def _log(self, line: str) -> None:
        with open(Path(self.job_dir) / LOG_NAME, "a") as log:
            log.write(f"[hpc-verl {time.strftime('%H:%M:%S', time.gmtime())}] {line}\n")


# ---------------------------------------------------------------------------- the watchdog
def start_watchdog(job_dir: str) -> tuple[subprocess.Popen, Any]:
    """Start this supervisor's watchdog (see :func:`watch`); returns it and the call that stops it."""
    read, write = os.pipe()
    try:
        with open(Path(job_dir) / "supervisor.err", "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", MODULE, "watch", job_dir, str(read), str(os.getpid())],
                                    pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=err, start_new_session=True)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)

    def stop() -> None:
        try:
            os.write(write, WATCH_STOP)
            os.close(write)
        except OSError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc, stop


def watch(job_dir: str, fd: int, supervisor: int) -> int:
    """The supervisor's watchdog: a small process in a session of its own that holds a pipe from
    the supervisor. Every WATCH_POLL_S it notes the job's processes (the supervisor's tree: it is
    their subreaper) and the sessions that belong to the job alone. When the supervisor dies
    without stopping it (``kill -9``, the OOM killer: EOF on the pipe, or a new parent), its
    orphans would go to init and run on, Ray's agents for minutes; so the watchdog SIGKILLs
    every process of those sessions, the noted processes, whatever names the job's Ray temp
    dirs, and the job's marked processes, removes the temp dirs and records the end."""
    own = os.getsid(0)
    sessions: set[int] = set()
    noted: dict[int, str] = {}
    while True:
        ready, _, _ = select.select([fd], [], [], WATCH_POLL_S)
        if ready:
            try:
                data = os.read(fd, 64)
            except OSError:
                data = b""
            if WATCH_STOP in data:
                return 0
            if not data:
                break
        if os.getppid() != supervisor:
            break
        table = procs.process_table()
        tree = set(procs.descendants(supervisor, table)) | ({supervisor} if supervisor in table else set())
        tree.discard(os.getpid())
        noted.update({p: table[p].start for p in tree})
        # a session of the job: one whose every process is in the supervisor's tree (never the
        # session of a terminal the supervisor was started from)
        members: dict[int, set[int]] = {}
        for pid, st in table.items():
            members.setdefault(st.sid, set()).add(pid)
        sessions |= {sid for sid in {table[p].sid for p in tree} if sid != own and members[sid] <= tree}
    t0 = time.monotonic()
    rec = registry.load(job_dir)
    from hpc_verl.bootstrap.raydir import node_states

    temps = tuple(st["temp_dir"] for st in (node_states(rec.run_dir) if rec.run_dir else {}).values()
                  if st.get("temp_dir"))
    killed = set(procs.kill_everything(sessions, temps))
    table = procs.process_table()
    strays = [p for p, start in noted.items() if p in table and table[p].start == start and p != os.getpid()]
    procs.end_pids(strays, grace_s=0.0)
    killed |= set(strays) | set(end_marked(job_dir, grace_s=0.0))
    removed = remove_ray_temp_dirs(job_dir)
    with updating(job_dir) as cur:
        if cur.exit_code is None:
            cur.exit_code = 128 + signal.SIGKILL
            cur.stop_reason = cur.stop_reason or f"its supervisor (pid {supervisor}) died before the job ended"
    with open(Path(job_dir) / LOG_NAME, "a") as log:
        log.write(f"[hpc-verl {time.strftime('%H:%M:%S', time.gmtime())}] the job's supervisor (pid {supervisor}) "
                  f"died; its watchdog killed the job's {len(killed)} processes in {time.monotonic() - t0:.1f}s"
                  + (f" and removed Ray temp dir(s) {', '.join(removed)}" if removed else "") + "\n")
    return 0


def remove_ray_temp_dirs(job_dir: str) -> list[str]:
    """Ray temp dirs of nodes whose supervisor was killed before it removed its own (logs kept)."""
    from hpc_verl.bootstrap.node import remove_node_temp_dir
    from hpc_verl.bootstrap.raydir import node_states

    rec = registry.load(job_dir)
    if not rec.run_dir:
        return []
    removed = []
    for node, st in node_states(rec.run_dir).items():
        temp = st.get("temp_dir")
        if temp and Path(temp).exists() and remove_node_temp_dir(rec.run_dir, node, temp):
            removed.append(temp)
    return removed


def trainer_dir(rec: registry.JobRecord) -> Path:
    """Where the built-in trainer wrote metrics.jsonl and its checkpoints (trainer.default_local_dir)."""
    return Path(rec.run_dir) / "checkpoints"


def make_plot(rec: registry.JobRecord) -> Path | None:
    d = trainer_dir(rec)
    if not (d / "metrics.jsonl").exists():
        return None
    from hpc_verl.trainer.observe.metrics import plot_run

    return Path(plot_run(d))


# ---------------------------------------------------------------------------- starting one
def spawn(rec: registry.JobRecord, env_extra: dict[str, str] | None = None) -> subprocess.Popen:
    """Start the job's supervisor in a session of its own (it outlives the process that started it)."""
    env = with_package_on_pythonpath(dict(os.environ))
    env.update(env_extra or {})
    with open(Path(rec.job_dir) / "supervisor.err", "ab") as err:
        return subprocess.Popen([sys.executable, "-m", MODULE, "supervise", rec.job_dir], cwd=rec.submit_dir or None,
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


def wait_started(rec: registry.JobRecord, sup: subprocess.Popen, timeout_s: float) -> registry.JobRecord | None:
    """The record once the supervisor has started the script; None when it exited first or timed out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cur = registry.load(rec.job_dir)
        if cur.pid and cur.supervisor_pid == sup.pid:
            return cur
        if sup.poll() is not None:
            return None
        time.sleep(0.05)
    return None


def supervisor_error(rec: registry.JobRecord) -> str:
    err = (Path(rec.job_dir) / "supervisor.err").read_text(errors="replace").strip().splitlines()
    return err[-1] if err else "no output"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 2 and args[0] == "supervise":
        return Supervisor(args[1]).run()
    if len(args) == 4 and args[0] == "watch" and args[2].isdigit() and args[3].isdigit():
        return watch(args[1], int(args[2]), int(args[3]))
    print(f"usage: python -m {MODULE} supervise JOB_DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
