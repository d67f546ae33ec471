"""A Docker daemon of the test bed's own, for jobs with ``container.runtime: docker``.

``DockerDaemon(directory).start()`` runs ``dockerd`` as root with everything under
``directory``: data root, exec root, pid file, its own containerd and the API socket
``unix://<directory>/docker.sock`` (clients point ``DOCKER_HOST`` at it). The system's
daemon, its socket and its configuration are never touched: the daemon reads an empty
config file of its own, changes no iptables rules, makes no bridge and no ``ip_forward``
setting (containers use ``--network host``). Storage drivers are tried in order
(``overlay2``, then ``vfs``, which works on any filesystem); the first one whose daemon
answers ``docker info`` and runs a container wins, and ``docker.json`` records it with
each refused driver's error. ``stop()`` ends exactly that daemon (by its pid file) and
unmounts what it left mounted below ``directory``.

No registry is reachable: :func:`load_image` copies the test bed's podman image into the
daemon (``podman save | docker load``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from hpc_verl.testbed.cluster import TestBedError, _pid_alive
from hpc_verl.util.fs import atomic_write_json, atomic_write_text

STORAGE_DRIVERS = ("overlay2", "vfs")
DAEMON_FLAGS = ("--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none")


class DockerDaemon:
    """One ``dockerd`` owning ``directory`` (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory).resolve()
        self.socket = self.dir / "docker.sock"
        self.pidfile = self.dir / "docker.pid"
        self.info_file = self.dir / "docker.json"

    @property
    def host(self) -> str:
        """The ``DOCKER_HOST`` value for clients of this daemon."""
        return f"unix://{self.socket}"

    def env(self) -> dict[str, str]:
        return {"DOCKER_HOST": self.host}

    def info(self) -> dict:
        try:
            return json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            return {}

    def pid(self) -> int | None:
        try:
            return int(self.pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def docker(self, *args: str, timeout_s: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run the docker client against this daemon (text output)."""
        return subprocess.run(["docker", *args], env={**os.environ, **self.env()}, capture_output=True,
                              text=True, timeout=timeout_s, **kw)

    def is_up(self) -> bool:
        if not _pid_alive(self.pid()) or not self.socket.exists():
            return False
        try:
            return self.docker("info", "--format", "{{.ServerVersion}}", timeout_s=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    # ---- up --------------------------------------------------------------
    def start(self, drivers: tuple[str, ...] = STORAGE_DRIVERS, timeout_s: float = 60) -> "DockerDaemon":
        """Start the daemon with the first storage driver that works; a no-op when it is up."""
        if self.is_up():
            return self
        for tool in ("dockerd", "docker"):
            if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
                raise TestBedError(f"test bed: '{tool}' not found; install it with 'bash scripts/setup.sh' "
                                   "(apt: docker.io)")
        if os.geteuid() != 0:
            raise TestBedError("test bed: dockerd runs as root here (a rootful daemon); run the tests as root "
                               "or set DOCKER_HOST to a daemon you may use")
        self.stop()
        refused: dict[str, str] = {}
        for driver in drivers:
            error = self._try(driver, timeout_s)
            if error is None:
                atomic_write_json(self.info_file, {"dir": str(self.dir), "host": self.host, "pid": self.pid(),
                                                   "storage_driver": driver, "flags": list(DAEMON_FLAGS),
                                                   "refused": refused})
                return self
            refused[driver] = error
            self.stop()
        raise TestBedError("test bed: dockerd did not start with any storage driver: "
                           + "; ".join(f"{d}: {e}" for d, e in refused.items()) + f" (logs in {self.dir})")

    def _try(self, driver: str, timeout_s: float) -> str | None:
        """Start dockerd with ``driver``; None when it answers and runs a container, else the error."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o711)  # the socket's own mode decides who may use the daemon
        config = self.dir / "daemon.json"
        atomic_write_text(config, "{}\n")
        log = self.dir / f"dockerd-{driver}.log"
        cmd = ["dockerd", "--config-file", str(config), "--data-root", str(self.dir / "root"),
               "--exec-root", str(self.dir / "exec"), "--pidfile", str(self.pidfile), "-H", self.host,
               "--storage-driver", driver, *DAEMON_FLAGS]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return _last_error(log) or f"dockerd exited {proc.returncode}"
            if self.is_up():
                return self._smoke(driver)
            time.sleep(0.2)
        return f"no answer on {self.socket} within {timeout_s:.0f}s"

    def _smoke(self, driver: str) -> str | None:
        """Does a container start with this driver? (A driver can load and still fail at the first mount.)"""
        rootfs = self.dir / "smoke-rootfs.tar"
        import tarfile

        with tarfile.open(rootfs, "w") as tar:
            info = tarfile.TarInfo("tmp")
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        ref = "hpcv-smoke:" + driver
        res = self.docker("import", str(rootfs), ref)
        rootfs.unlink(missing_ok=True)
        if res.returncode != 0:
            return f"docker import failed: {_tail(res)}"
        # create (not run): the layer is mounted, no binary is needed in the image
        res = self.docker("create", "--network", "host", ref, "/none")
        if res.returncode != 0:
            return f"docker create failed: {_tail(res)}"
        cid = res.stdout.strip()
        res = self.docker("start", cid)
        started_or_exec_error = res.returncode == 0 or "/none" in (res.stdout + res.stderr)
        self.docker("rm", "--force", cid)
        self.docker("rmi", ref)
        return None if started_or_exec_error else f"docker start failed: {_tail(res)}"

    # ---- down ------------------------------------------------------------
    def stop(self, timeout_s: float = 30) -> None:
        """Stop exactly this daemon (its containers go with it) and unmount what it left below the directory."""
        pid = self.pid()
        if _pid_alive(pid) and _is_dockerd(pid, self.dir):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for mount in reversed(_mounts_below(self.dir)):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        self.pidfile.unlink(missing_ok=True)

    def remove(self, background: bool = False) -> None:
        """Stop, then delete the directory (images and all). ``background``: the deletion (minutes for an
        image of some GB on a busy disk) runs on in an ``rm -rf`` of its own after this returns; the
        daemon is stopped and its mounts are gone before, so nothing else uses the directory."""
        self.stop()
        if background:
            subprocess.Popen(["rm", "-rf", "--one-file-system", str(self.dir)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            return
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- images ----------------------------------------------------------
    def has_image(self, ref: str) -> bool:
        return self.docker("image", "inspect", ref).returncode == 0

    def load_image(self, ref: str, podman_global: list[str] | tuple[str, ...] = ()) -> str:
        """Copy ``ref`` from podman's store into this daemon (``podman save | docker load``); returns ``ref``."""
        if self.has_image(ref):
            return ref
        save = subprocess.Popen(["podman", *podman_global, "save", ref], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        load = subprocess.run(["docker", "load"], stdin=save.stdout, env={**os.environ, **self.env()},
                              capture_output=True, text=True, timeout=600)
        save.stdout.close()
        save_err = save.stderr.read().decode(errors="replace")
        save.wait(timeout=60)
        if save.returncode != 0 or load.returncode != 0 or not self.has_image(ref):
            raise TestBedError(f"test bed: could not copy {ref} from podman to docker: "
                               f"{save_err.strip()[-200:]} {_tail(load)}")
        return ref


def _tail(res: subprocess.CompletedProcess) -> str:
    text = (res.stderr or res.stdout or "").strip()
    return text.splitlines()[-1][:300] if text else f"exit {res.returncode}"


def _last_error(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if "level=fatal" in line or "level=error" in line or line.startswith("failed to start daemon"):
            return line.split("msg=", 1)[-1][:300]
    return lines[-1][:300] if lines else ""


def _is_dockerd(pid: int | None, directory: Path) -> bool:
    """The pid is a dockerd of this directory (a reused pid never gets a signal from us)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(cmdline) and os.path.basename(cmdline[0]) == b"dockerd" and str(directory).encode() in b" ".join(
        cmdline)


def _mounts_below(directory: Path) -> list[str]:
    out = []
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            target = line.split()[1].replace("\\040", " ")
            if target == str(directory) or target.startswith(str(directory) + "/"):
                out.append(target)
    except OSError:
        pass
    return out
