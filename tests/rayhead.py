"""A real local Ray head for tests, with token authentication, that cleans up after itself.

Other people's Ray clusters run on the same machine, so this never uses Ray's
default ports and never runs ``ray stop``: every port is a free one picked here,
the head has its own ``--temp-dir``, and teardown ends exactly the processes it
started: the ``ray start --block`` process (which stops its daemons), then any
survivor in its session, then any process that still carries this head's tag in
its environment (job drivers run in sessions of their own).
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_verl.testbed.ports import free_ports

RAY_BIN = Path(sys.executable).with_name("ray")
TAG_VAR = "HPC_VERL_TEST_RAY_HEAD"


@dataclass
class RayHead:
    root: Path
    address: str  # Jobs API: http://127.0.0.1:PORT
    gcs_address: str
    token_file: Path
    proc: subprocess.Popen
    tag: str

    def stop(self, report: bool = True) -> None:
        """End exactly this head's processes, then remove its directory (``report``: print the log of a
        head that had already exited; off where the caller's error carries it)."""
        sid = self.proc.pid  # started with start_new_session: pid == sid == pgid
        if self.proc.poll() is not None:  # `ray start --block` ends when one of its daemons died: say which
            if report:
                print(f"the Ray head had already exited ({self.proc.returncode}); its log ends:\n"
                      + (self.root / "start.log").read_text(errors="replace")[-3000:])
        else:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while True:
            left = _our_processes(sid, self.tag)
            if not left or time.monotonic() > deadline:
                break
            for pid in left:
                _kill(pid, signal.SIGTERM if time.monotonic() < deadline - 5 else signal.SIGKILL)
            time.sleep(0.5)
        for pid in _our_processes(sid, self.tag):
            _kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)

    def leftovers(self) -> list[int]:
        """Pids of this head still alive after stop() (should be none)."""
        return _our_processes(self.proc.pid, self.tag)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _our_processes(sid: int, tag: str) -> list[int]:
    """Pids in our session, or whose environment carries our tag (never our own pid)."""
    found = []
    needle = f"{TAG_VAR}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        try:
            if os.getsid(pid) == sid:
                found.append(pid)
                continue
            if needle in (entry / "environ").read_bytes():
                found.append(pid)
        except (OSError, ProcessLookupError):
            continue
    return found


def start_ray_head(token_auth: bool = True, num_cpus: int = 2, timeout_s: float = 90,
                   attempts: int = 2, num_gpus: int = 0) -> RayHead:
    """``ray start --head --block`` on free ports with its own temp dir (and a token).

    A port picked as free can be taken by someone else before Ray binds it: one retry
    with fresh ports."""
    for attempt in range(attempts):
        try:
            return _start_once(token_auth, num_cpus, timeout_s, num_gpus)
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start_once(token_auth: bool, num_cpus: int, timeout_s: float, num_gpus: int = 0) -> RayHead:
    root = Path(tempfile.mkdtemp(prefix="hvray"))  # short: Ray's unix socket paths have a limit
    (root / "cwd").mkdir()
    token_file = root / "token"
    token_file.write_text(secrets.token_hex(32) + "\n")
    token_file.chmod(0o600)
    gcs, dash, client, nm, om, ag_http, ag_grpc, rt_env, metrics = free_ports(9)
    tag = secrets.token_hex(8)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("RAY_") and k not in ("PYTHONPATH",)}
    env.update({
        "PATH": f"{RAY_BIN.parent}{os.pathsep}{env.get('PATH', '')}",
        "RAY_USAGE_STATS_ENABLED": "0",
        TAG_VAR: tag,
    })
    if token_auth:
        env.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)})
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    cmd = [str(RAY_BIN), "start", "--head", "--block", "--disable-usage-stats",
           "--node-ip-address=127.0.0.1", f"--port={gcs}",
           "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}",
           f"--ray-client-server-port={client}", f"--node-manager-port={nm}",
           f"--object-manager-port={om}", f"--dashboard-agent-listen-port={ag_http}",
           f"--dashboard-agent-grpc-port={ag_grpc}", f"--runtime-env-agent-port={rt_env}",
           f"--metrics-export-port={metrics}", "--min-worker-port=0", "--max-worker-port=0",
           f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}", "--object-store-memory=100000000",
           f"--temp-dir={root / 'r'}"]
    log = open(root / "start.log", "wb")
    proc = subprocess.Popen(cmd, cwd=root / "cwd", env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    head = RayHead(root=root, address=f"http://127.0.0.1:{dash}", gcs_address=f"127.0.0.1:{gcs}",
                   token_file=token_file, proc=proc, tag=tag)
    try:
        _wait_ready(head, timeout_s)
    except BaseException:
        head.stop(report=False)   # (the error carries the log)
        raise
    return head


def _wait_ready(head: RayHead, timeout_s: float) -> None:
    """Ready when the dashboard lists the head's node ALIVE: its raylet registered, past the bound in which
    a raylet whose agents did not start ends (and with it ``ray start --block``, the dashboard included)."""
    import requests

    headers = {"Authorization": f"Bearer {head.token_file.read_text().strip()}"}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.proc.poll() is not None:
            raise RuntimeError("ray start exited early:\n"
                               + (head.root / "start.log").read_text(errors="replace")[-3000:])
        try:
            r = requests.get(head.address + "/api/v0/nodes", params={"detail": "1"}, headers=headers, timeout=5)
            if r.ok and any(n.get("state") == "ALIVE" for n in r.json()["data"]["result"]["result"]):
                return
        except (requests.RequestException, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Ray head did not come up in {timeout_s}s:\n"
                       + (head.root / "start.log").read_text(errors="replace")[-3000:])
