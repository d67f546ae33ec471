"""``python -m hpc_verl.verl_upstream.supervise -- python3 -m verl.trainer.main_ppo ...``

Runs upstream verl under the launcher's preemption contract, which verl itself
does not know: when the batch script creates ``$HPCV_PREEMPT_FILE`` (SLURM's
signal before the time limit), wait for verl's next complete checkpoint
(``<trainer.default_local_dir>/latest_checkpointed_iteration.txt`` changes),
stop verl and exit with the requeue code, so the job requeues itself and the
next run resumes (``trainer.resume_mode=auto``). The wait is bounded: it ends
``STOP_MARGIN_S`` before the job's end (``$HPCV_EXPIRY_FILE``), when verl is
stopped anyway and the next run resumes from its last save, whichever it is.

verl's standard output passes through this process: each ``step:N`` line verl prints is also
a record in ``$HPCV_RUN_DIR/progress.jsonl``, the progress the stall watchdog reads.

The trainer gets ``RAY_RUNTIME_ENV_HOOK`` so that its Ray workers follow the
job's end time (:mod:`hpc_verl.verl_upstream.expiry`). Every decision is a log
line on stderr (the batch log).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hpc_verl.errors import REQUEUE_EXIT_CODE
from hpc_verl.util import progress
from hpc_verl.verl_upstream import expiry

#: verl's tracker file (``get_checkpoint_tracker_filename``), written after a save completes.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: Seconds before the job's end by which verl is stopped: its TERM grace, the Ray teardown and the requeue.
STOP_MARGIN_S = 45.0
#: Without a known end time (no SLURM), how long to wait for a checkpoint after the preemption file.
NO_DEADLINE_WAIT_S = 120.0
TERM_GRACE_S = 15.0
POLL_S = 0.5


def _log(msg: str) -> None:
    print(f"[hpc-verl supervise] {msg}", file=sys.stderr, flush=True)


def checkpoint_dir(argv: Sequence[str]) -> Path | None:
    """``trainer.default_local_dir`` as main_ppo gets it (the last override wins)."""
    found = None
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and key == "trainer.default_local_dir":
            found = value
    return Path(found) if found else None


@dataclass(frozen=True)
class Tracker:
    """What verl's tracker file says right now (None: no checkpoint yet)."""

    step: str | None
    mtime_ns: int | None

    @classmethod
    def read(cls, ckpt_dir: Path | None) -> "Tracker":
        if ckpt_dir is None:
            return cls(None, None)
        path = ckpt_dir / TRACKER_FILE
        try:
            st = path.stat()
            return cls(path.read_text().strip() or None, st.st_mtime_ns)
        except OSError:
            return cls(None, None)

    def describe(self) -> str:
        return f"global_step_{self.step}" if self.step else "no checkpoint (the next run starts over)"


class Supervisor:
    """One verl process group, its preemption handling, and its exit code."""

    def __init__(self, argv: Sequence[str], env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.env = dict(os.environ if env is None else env)
        self.preempt_file = self.env.get("HPCV_PREEMPT_FILE")
        self.expiry_file = self.env.get(expiry.EXPIRY_FILE_ENV)
        self.ckpt_dir = checkpoint_dir(self.argv)
        self.child: subprocess.Popen | None = None
        self.signalled: int | None = None
        run_dir = self.env.get("HPCV_RUN_DIR")
        self.progress_file = os.path.join(run_dir, progress.PROGRESS_FILE) if run_dir else None
        self.relay: threading.Thread | None = None

    def child_env(self) -> dict[str, str]:
        env = dict(self.env)
        if env.get("RAY_RUNTIME_ENV_HOOK"):
            _log(f"RAY_RUNTIME_ENV_HOOK is already {env['RAY_RUNTIME_ENV_HOOK']!r}: verl's Ray workers keep the "
                 "end time they started with")
        else:
            env["RAY_RUNTIME_ENV_HOOK"] = expiry.RUNTIME_ENV_HOOK
        expiry.refresh_environ(self.expiry_file, env)
        return env

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self.child = subprocess.Popen(self.argv, env=self.child_env(), start_new_session=True,
                                      stdout=subprocess.PIPE if self.progress_file else None)
        if self.child.stdout is not None:
            self.relay = threading.Thread(target=self._relay, args=(self.child.stdout,), daemon=True)
            self.relay.start()
        try:
            return self._watch()
        finally:
            if self.child.poll() is None:
                self._stop_child()
            if self.relay is not None:
                self.relay.join(timeout=5.0)

    def _relay(self, stream) -> None:
        """verl's output to ours, line by line; its step lines also to the progress file."""
        out = sys.stdout.buffer
        for raw in iter(stream.readline, b""):
            try:
                out.write(raw)
                out.flush()
            except (OSError, ValueError):
                pass  # our output is gone: verl's still drains, so it never blocks on a full pipe
            step = progress.step_of_line(raw.decode("utf-8", "replace"))
            if step is not None and self.progress_file:
                try:
                    progress.append_step(self.progress_file, step)
                except OSError as exc:
                    _log(f"cannot record step {step} in {self.progress_file}: {exc}")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signalled = signum

    def _watch(self) -> int:
        assert self.child is not None
        while True:
            rc = self.child.poll()
            if rc is not None:
                return rc
            if self.signalled is not None:
                _log(f"got signal {self.signalled}: stopping verl")
                self._stop_child()
                return 128 + self.signalled
            if self.preempt_file and os.path.exists(self.preempt_file):
                return self._preempted()
            time.sleep(POLL_S)

    def _deadline(self) -> tuple[float, str]:
        end = expiry.read_expiry(self.expiry_file)
        if end is None:
            return time.time() + NO_DEADLINE_WAIT_S, f"{NO_DEADLINE_WAIT_S:.0f} s (the job's end time is unknown)"
        return end - STOP_MARGIN_S, f"{STOP_MARGIN_S:.0f} s before the job's end"

    def _preempted(self) -> int:
        assert self.child is not None
        before = Tracker.read(self.ckpt_dir)
        deadline, why = self._deadline()
        _log(f"preemption: waiting up to {max(deadline - time.time(), 0):.0f} s ({why}) for verl's next checkpoint "
             f"in {self.ckpt_dir} (latest now: {before.describe()})")
        while time.time() < deadline:
            rc = self.child.poll()
            if rc is not None:
                _log(f"verl exited with status {rc} during the wait")
                return rc
            now = Tracker.read(self.ckpt_dir)
            if now != before and now.step:
                _log(f"verl saved {now.describe()}: stopping it for the requeue")
                return self._stop_for_requeue()
            if self.signalled is not None:
                _log(f"got signal {self.signalled} during the wait: stopping verl")
                self._stop_child()
                return 128 + self.signalled
            time.sleep(POLL_S)
        _log("no new checkpoint in time: stopping verl for the requeue")
        return self._stop_for_requeue()

    def _stop_for_requeue(self) -> int:
        self._stop_child()
        # verl's actors may finish one more save while the driver goes: the tracker says which is complete
        _log(f"verl stopped; the requeued run resumes from {Tracker.read(self.ckpt_dir).describe()}")
        return REQUEUE_EXIT_CODE

    def _stop_child(self) -> None:
        """TERM verl's process group, KILL it after the grace (its Ray actors die with the driver)."""
        assert self.child is not None
        for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.child.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.child.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m hpc_verl.verl_upstream.supervise -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    return Supervisor(args).run()


if __name__ == "__main__":
    sys.exit(main())
