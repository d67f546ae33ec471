"""The one entry wrapper (hpc_verl.errors.report_errors): every failure is one line and an exit status.

The real faults (a read-only and a full tmpfs, signals, a closed pipe) are in tests/test_faults.py;
these are the wrapper's rules one by one, in this process.
"""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from hpc_verl.errors import ConfigError, Stopped, os_error_line, record_failure, report_errors


@pytest.fixture(autouse=True)
def _own_signal_handlers():
    """report_errors installs the stop-signal policy in this (pytest's) process: put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    hook = sys.unraisablehook
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)
    sys.unraisablehook = hook


def test_each_kind_of_failure_is_one_line_and_its_exit_status(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HPCV_FAILURE_FILE", str(tmp_path / "failure.txt"))

    def config() -> int:
        raise ConfigError("bad key\n  on two lines")

    assert report_errors(config) == 2
    assert capsys.readouterr().err == "hpc-verl: error: bad key on two lines\n"
    assert (tmp_path / "failure.txt").read_text() == "bad key on two lines\n"

    def read_only() -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "out"))

    assert report_errors(read_only) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'out'}: Read-only file system (EROFS); " in err
    assert (tmp_path / "failure.txt").read_text() == "bad key on two lines\n"   # the first cause stays

    def stopped() -> int:
        raise Stopped(signal.SIGHUP)

    assert report_errors(stopped) == 128 + signal.SIGHUP
    assert capsys.readouterr().err == "hpc-verl: stopped by SIGHUP\n"


def test_a_full_disk_line_says_how_much_is_free():
    line = os_error_line(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/"), "save")
    assert line.startswith("save: /: No space left on device (ENOSPC), ") and " free there; free space" in line


def test_a_failure_line_that_cannot_be_written_leaves_no_empty_file(tmp_path, monkeypatch):
    """A full disk accepts the create but not the bytes; faked here by a write that fails with ENOSPC."""
    path = tmp_path / "failure.txt"
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, fd: int, *a, **kw) -> None:
            self.fh = real_fdopen(fd, *a, **kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.fh.close()

        def write(self, _text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fdopen", Full)
    record_failure("disk full", path)
    assert not path.exists()
    monkeypatch.setattr(os, "fdopen", real_fdopen)
    record_failure("first\nsecond", path)
    record_failure("later", path)
    assert path.read_text() == "first\n"


def test_a_closed_stdout_pipe_is_silent(capsys, monkeypatch):
    import hpc_verl.errors as errors_mod

    monkeypatch.setattr(errors_mod, "_quiet_stdout", lambda: None)   # (pytest owns this process's stdout)

    def func() -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    assert report_errors(func) == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == ""


_SWALLOWED_STOP = textwrap.dedent("""
    import os, signal, sys, time, weakref
    from hpc_verl.errors import report_errors

    class Obj:
        pass

    def callback(_ref):
        # the signal is handled here, inside a weakref callback, where Python swallows exceptions
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100000):
            pass

    def main():
        obj = Obj()
        ref = weakref.ref(obj, callback)
        del obj
        time.sleep(10)       # the stop must end this, not its end
        print("main ran to its end", flush=True)
        return 0

    sys.exit(report_errors(main))
""")


def test_a_stop_signal_handled_inside_a_weakref_callback_still_stops_the_program():
    """CPython prints an exception raised in a weakref callback (or __del__) and runs on: a
    SIGTERM that lands there must still stop the program, with no traceback."""
    proc = subprocess.run([sys.executable, "-c", _SWALLOWED_STOP], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert proc.stdout == ""          # not "main ran to its end"
    assert proc.stderr == "hpc-verl: stopped by SIGTERM\n"
