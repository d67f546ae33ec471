"""A trainer's private Ray, started by a process that shares the trainer's fate.

``hpc-verl train`` without a Ray address runs a single-node Ray of its own. Its head (GCS,
raylet, and under the raylet Ray's agents and the trainer's ranks) is not started by the
driver itself but by a small head process, ``python -m hpc_verl.trainer.driver.private_ray``, in a
session of its own, a child subreaper (orphans of the raylet, Ray's agents among them, stay
under it). The driver holds the write end of a pipe whose read end only the head process
has:

- the driver ends normally: it writes ``q`` (``PrivateRay.stop``); the head TERMs its tree,
  KILLs what is left after a grace period, and exits;
- the driver dies (``kill -9``, the OOM killer): the pipe reads EOF at once, and the head
  SIGKILLs every process of its session and every process that names the private Ray's
  temp dir, keeps Ray's logs in the run directory, removes the temp dir and exits. Nothing
  of the run outlives its driver by more than a second or two; without this, Ray's agents
  held their ports for a minute or two, retrying a GCS that was gone.

The head also polls its parent pid (a pipe end inherited by a forked child of the driver
would hide the EOF). Linux only (``/proc``, ``PR_SET_CHILD_SUBREAPER``).

Fault injection for tests (real processes, fake fault): ``HPC_VERL_FAULT=slow-registration`` makes
the first head process end as one whose raylet missed Ray's registration bound.
"""
from __future__ import annotations

import argparse
import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hpc_verl.errors import BootstrapError
from hpc_verl.util import procs
from hpc_verl.util.rayready import SLOW_REGISTRATION
from hpc_verl.util.fs import atomic_write_text

MODULE = "hpc_verl.trainer.driver.private_ray"
ADDRESS_FILE = "hpcv-gcs-address"   # in the temp dir, written once the head node is up
HEAD_LOG = "hpcv-head.log"          # the head process's own output (Ray's start-up errors)
TOKEN_FILE = "token"
STOP = b"q"
PARENT_POLL_S = 0.2
STOP_GRACE_S = 5.0


class SlowRegistration(BootstrapError):
    """The head's raylet missed Ray's fixed 30 s bound to register with its GCS: a loaded machine
    (seen at load ~18 on 2 cores), not a broken one; worth one more start."""


def auth_env(temp_dir: str) -> dict[str, str]:
    """Token authentication with the private Ray's own token (head and driver both use it)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(temp_dir) / TOKEN_FILE)}


@dataclass
class PrivateRay:
    """The running head process of a private Ray (``start``)."""

    proc: subprocess.Popen
    temp_dir: str
    address: str = ""
    _pipe: int | None = field(default=None, repr=False)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Ask the head to stop its Ray (TERM, then KILL after ``grace_s``) and wait for it, bounded."""
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            try:
                os.write(pipe, STOP)
            except OSError:
                pass
            os.close(pipe)
        try:
            self.proc.wait(timeout=grace_s + procs.KILL_WAIT_S + 5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def launch(temp_dir: str, num_cpus: int, logs_to: str | None, attempt: int = 1) -> PrivateRay:
    """Start the head process (``wait_ready`` waits for its GCS address); sets the token variables
    in this process's environment first, for ``ray.init(address=...)`` (import Ray after this)."""
    atomic_write_text(Path(temp_dir) / TOKEN_FILE, secrets.token_hex(32), mode=0o600)
    os.environ.update(auth_env(temp_dir))
    read, write = os.pipe()
    cmd = [sys.executable, "-m", MODULE, "--fd", str(read), "--parent", str(os.getpid()),
           "--temp-dir", temp_dir, "--num-cpus", str(num_cpus), "--attempt", str(attempt)]
    if logs_to:
        cmd += ["--logs-to", logs_to]
    try:
        with open(Path(temp_dir) / HEAD_LOG, "ab") as log:
            proc = subprocess.Popen(cmd, pass_fds=(read,), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)
    except BaseException:
        os.close(write)
        raise
    finally:
        os.close(read)
    return PrivateRay(proc, temp_dir, _pipe=write)


def wait_ready(head: PrivateRay, timeout_s: float, abort: threading.Event | None = None) -> bool:
    """Poll (bounded by ``timeout_s``) for the head's GCS address; False when ``abort`` was set first
    (the head is then stopped). Raises BootstrapError (one line) when the head ended or timed out,
    SlowRegistration when it ended because its raylet missed Ray's registration bound."""
    address_file = Path(head.temp_dir) / ADDRESS_FILE
    deadline = time.monotonic() + timeout_s
    while True:
        if address_file.exists():
            head.address = address_file.read_text().strip()
            if head.address:
                return True
        rc = head.proc.poll()
        if abort is not None and abort.is_set():
            head.stop(grace_s=1.0)
            return False
        if rc is not None or time.monotonic() > deadline:
            head.stop(grace_s=1.0)
            why = (f"not up within {timeout_s:g}s" if rc is None else "its head process ended ("
                   + (f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}") + ")")
            head_log = Path(head.temp_dir) / HEAD_LOG
            text = _text(head_log)
            tail = _last_line(text)
            slow = rc is not None and SLOW_REGISTRATION in text
            raise (SlowRegistration if slow else BootstrapError)(f"the trainer's private Ray did not start: {why}"
                                 + (f"; its last words: {tail}" if tail else "")
                                 + f" (see {head_log} and the Ray logs there)")
        time.sleep(0.05)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# ---------------------------------------------------------------------------- the head process
def _watch(fd: int, parent: int) -> bool:
    """Block until the driver stops us (True: it wrote STOP) or is gone (False: EOF, or our parent
    changed: the driver died and a forked child of it may hold the pipe open)."""
    while True:
        ready, _, _ = select.select([fd], [], [], PARENT_POLL_S)
        if ready:
            try:
                data = os.read(fd, 64)
            except OSError:
                return False
            if not data:
                return False
            if STOP in data:
                return True
        if os.getppid() != parent:
            return False


def _keep_logs(temp_dir: str, logs_to: str | None) -> None:
    logs = Path(temp_dir) / "session_latest" / "logs"
    if logs_to and logs.is_dir():
        try:
            shutil.copytree(logs, Path(logs_to), symlinks=True, dirs_exist_ok=True)
        except (OSError, shutil.Error):
            pass


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--parent", type=int, required=True)
    p.add_argument("--temp-dir", required=True)
    p.add_argument("--num-cpus", type=int, required=True)
    p.add_argument("--logs-to")
    p.add_argument("--attempt", type=int, default=1)
    a = p.parse_args(argv)
    if os.environ.get("HPC_VERL_FAULT") == "slow-registration" and a.attempt == 1:
        print(f"injected fault: Exception: {SLOW_REGISTRATION}.", file=sys.stderr)
        return 1
    procs.become_subreaper()
    sid = os.getsid(0)
    stopped = threading.Event()
    orderly: list[bool] = []

    def watch() -> None:
        orderly.append(_watch(a.fd, a.parent))
        if not orderly[0]:   # the driver is gone: nothing of its Ray may outlive it
            procs.kill_everything(sid, (a.temp_dir,))
            _keep_logs(a.temp_dir, a.logs_to)
            shutil.rmtree(a.temp_dir, ignore_errors=True)
            os._exit(137)
        stopped.set()
    threading.Thread(target=watch, name="hpcv-driver-watch", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())

    import ray._private.node
    import ray._private.parameter

    params = ray._private.parameter.RayParams(num_cpus=a.num_cpus, include_dashboard=False, temp_dir=a.temp_dir)
    try:
        node = ray._private.node.Node(ray_params=params, head=True, shutdown_at_exit=False, spawn_reaper=False)
    except Exception:   # noqa: BLE001 - the driver reads the last words from our log; what started is stopped below
        traceback.print_exc()
        rc = 1
    else:
        atomic_write_text(Path(a.temp_dir) / ADDRESS_FILE, str(node.gcs_address))
        stopped.wait()
        rc = 0
    procs.end_ray_tree(os.getpid(), grace_s=STOP_GRACE_S)
    procs.kill_everything(sid)
    return rc


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
