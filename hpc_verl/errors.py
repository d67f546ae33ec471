"""The project's small error hierarchy, and the one wrapper every entry point runs in.

Every user-facing failure is an ``HpcVerlError``: the CLI prints its message as
one line and exits 2. Use ``assert`` only for internal invariants. Errors of the
machine rather than of the input (a full or read-only disk, a missing permission)
reach :func:`report_errors` as ``OSError`` and become one line with the path and
the errno text (exit 1). Stop signals follow one policy (:func:`install_stop_signals`):
SIGTERM and SIGHUP unwind the program like Ctrl-C does, so ``finally`` blocks stop
what it started, and the exit status is 128 + the signal number.
"""
from __future__ import annotations

import errno as _errno
import os
import shutil
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Optional

#: exported by the job script: the first failure line of a job lands here (``hpc-verl status`` shows it)
FAILURE_FILE_ENV = "HPCV_FAILURE_FILE"
FAILURE_FILE_NAME = "failure.txt"   # in the job's run directory (rendered into the script)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
OS_ERROR_EXIT = 1
#: the variable a job sets to change the requeue exit code (the script exports the value it tests)
REQUEUE_EXIT_VAR = "HPC_VERL_REQUEUE_EXIT_CODE"
#: "checkpointed on the preemption signal, requeue me": the trainer's exit, the launcher's cue to requeue
REQUEUE_EXIT_CODE = int(os.environ.get(REQUEUE_EXIT_VAR, "99"))


class HpcVerlError(Exception):
    """A user error: one clear line (what, where, how to fix)."""

    exit_code = 2


class ProfileError(HpcVerlError):
    """A cluster profile is missing, malformed or inconsistent."""


class ConfigError(HpcVerlError):
    """A job or trainer config (file or override) is invalid."""


class RenderError(HpcVerlError):
    """A template could not be rendered or the result failed its checks."""


class SubmitError(HpcVerlError):
    """Submission to a scheduler (SLURM, Ray Jobs, local) failed."""


class JobNotFoundError(HpcVerlError):
    """A job id or name is not in the registry."""


class BootstrapError(HpcVerlError):
    """Bringing up Ray (or a node) inside a job failed."""


class DataError(HpcVerlError):
    """An input data file is missing or malformed."""


class DataflowError(HpcVerlError):
    """A dataflow graph is invalid or cannot be placed on the cluster."""


class CheckpointError(HpcVerlError):
    """A checkpoint is missing, damaged or unreadable."""


class Stopped(BaseException):
    """A stop signal (SIGTERM, SIGHUP) arrived: unwind like KeyboardInterrupt, then exit 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


# ---------------------------------------------------------------------------- OS errors as one line
_HINTS = {
    _errno.ENOSPC: "free space there or write somewhere else",
    _errno.EDQUOT: "the disk quota is used up; free space or ask for more",
    _errno.EROFS: "that file system is mounted read-only; point the output at a writable directory",
    _errno.EACCES: "check the owner and mode of that path (ls -ld)",
    _errno.EPERM: "check the owner and mode of that path (ls -ld)",
    _errno.ENOENT: "check the path",
    _errno.EMFILE: "too many open files: raise 'ulimit -n'",
}


def free_bytes(path: str | os.PathLike[str]) -> Optional[int]:
    """Free bytes on the file system holding ``path`` (its nearest existing parent), None if unknown."""
    p = Path(path)
    for cand in (p, *p.parents):
        try:
            return shutil.disk_usage(cand).free
        except OSError:
            continue
    return None


def _size(n: int) -> str:
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} bytes"


def os_error_line(exc: OSError, what: str = "") -> str:
    """``OSError`` -> ``<what>: <path>: <errno text> (ENAME); <hint>``: the line a person can act on."""
    code = exc.errno
    text = exc.strerror or str(exc) or type(exc).__name__
    where = " -> ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
    parts = [p for p in (what, where) if p]
    line = f"{': '.join(parts)}: {text}" if parts else text
    if code in _errno.errorcode:
        line += f" ({_errno.errorcode[code]})"
    if code in (_errno.ENOSPC, _errno.EDQUOT) and exc.filename is not None:
        free = free_bytes(exc.filename)
        if free is not None:
            line += f", {_size(free)} free there"
    hint = _HINTS.get(code) if code is not None else None
    return f"{line}; {hint}" if hint else line


def record_failure(line: str, path: str | os.PathLike[str] | None = None) -> None:
    """Keep a job's first failure line in ``path`` (default ``$HPCV_FAILURE_FILE``): the cause,
    not the failures it caused later."""
    path = path or os.environ.get(FAILURE_FILE_ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:  # already there (an earlier, truer cause), or nowhere to write it
        return
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(line.strip().splitlines()[0] + "\n" if line.strip() else "failed\n")
    except OSError:  # a full disk: the line still reaches stderr; no empty file to stand for it
        try:
            os.unlink(path)
        except OSError:
            pass


# ---------------------------------------------------------------------------- the signal policy
def _on_stop_signal(signum: int, _frame: Any) -> None:
    for sig in STOP_SIGNALS:  # once: a second signal must not break the clean-up the first started
        signal.signal(sig, _ignore_repeat)
    raise Stopped(signum)


def _ignore_repeat(signum: int, _frame: Any) -> None:
    return None


#: how long after a swallowed stop the signal is sent again: the hook that saw it has returned by then
REDELIVER_S = 0.05
_next_unraisable_hook: Callable[[Any], Any] = sys.__unraisablehook__


def _on_unraisable(args: Any) -> None:
    """A stop signal handled inside a weakref callback, a ``__del__`` or a GC callback raises
    :class:`Stopped` where Python can only print it ("Exception ignored in ...") and run on, with
    the handler already spent: the program would ignore the stop. Re-arm the handler and send the
    signal again a moment later, from outside the callback; print nothing."""
    exc = args.exc_value
    if not isinstance(exc, Stopped):
        _next_unraisable_hook(args)
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)
    timer = threading.Timer(REDELIVER_S, os.kill, (os.getpid(), exc.signum))
    timer.daemon = True
    timer.start()


def install_stop_signals() -> bool:
    """SIGTERM and SIGHUP raise :class:`Stopped` in the main thread (a no-op elsewhere).

    Foreground entry points call this (``report_errors`` does, and again after a library such
    as Ray put its own SIGTERM handler in place), so a CI timeout or a closed ssh session
    stops the program through its ``finally`` blocks instead of orphaning what it started."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_stop_signal)
    global _next_unraisable_hook
    if sys.unraisablehook is not _on_unraisable:
        _next_unraisable_hook, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    return True


def _quiet_stdout() -> None:
    """stdout's reader went away (``| head``): send what is left nowhere, so exit does not complain."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # no terminal left (SIGHUP): the exit status still tells
        pass


def report_errors(func: Callable[[], int]) -> int:
    """Run an entry point: every failure becomes one line on stderr and an exit status, no traceback.

    ``HpcVerlError`` -> its message, exit 2; ``OSError`` -> path, errno text and a hint, exit 1;
    SIGTERM/SIGHUP -> ``stopped by SIGTERM``, 128 + N; Ctrl-C -> 130; a closed stdout pipe -> 141,
    silently. Inside a job the first failure line is also kept in ``$HPCV_FAILURE_FILE``.
    Shared by ``hpc-verl`` and ``python -m hpc_verl.trainer.main`` (which must not import the CLI).
    """
    install_stop_signals()
    try:
        rc = int(func() or 0)
        sys.stdout.flush()
        return rc
    except HpcVerlError as exc:
        line = "hpc-verl: error: " + " ".join(str(exc).split())   # one line, whatever the message held
        code = exc.exit_code
    except Stopped as exc:  # asked to stop: not a failure of the job
        _say(f"hpc-verl: stopped by {exc.name}")
        return 128 + exc.signum
    except KeyboardInterrupt:
        _say("hpc-verl: interrupted")
        return 130
    except BrokenPipeError:
        _quiet_stdout()
        return 128 + signal.SIGPIPE
    except OSError as exc:
        line = f"hpc-verl: error: {os_error_line(exc)}"
        code = OS_ERROR_EXIT
    record_failure(line[len("hpc-verl: error: "):])
    _say(line)
    return code
