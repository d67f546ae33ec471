"""Bring a SLURM test bed of two (up to ``MAX_NODES``) nodes up and down in a directory of its own.

Layout of the test bed directory (``$HPC_VERL_TESTBED_DIR`` or a temp dir):
``slurm.conf``, ``gres.conf``, ``munge/`` (own key, socket, pid), ``state/``,
``spool-node*/``, ``fakegpu/`` (empty files standing in for GPU devices), logs,
and ``testbed.json`` (ports and pids). Clients talk to it through
``SLURM_CONF=<dir>/slurm.conf`` (see :meth:`TestBed.env`).

Accounting is off on purpose (as on many small sites): job state comes from
``squeue`` and ``scontrol show job``.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from hpc_verl.errors import HpcVerlError
from hpc_verl.testbed.ports import SLURM_BAND, free_ports
from hpc_verl.util.fs import atomic_write_json, atomic_write_text

NODES = ("node1", "node2")  # the default test bed
MAX_NODES = 4  # one slurmd each, all on this host: more only adds daemons that compete for its CPUs
GPUS_PER_NODE = 4
CPUS_PER_NODE = 2


def node_names(n: int) -> tuple[str, ...]:
    """``node1`` .. ``nodeN``; one clear line for a count the test bed does not offer."""
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_NODES:
        raise TestBedError(f"test bed: {n!r} nodes asked for; it runs 1..{MAX_NODES} slurmd on this host")
    return tuple(f"node{i}" for i in range(1, n + 1))


class TestBedError(HpcVerlError):
    """The local SLURM test bed could not be brought up or down."""

    __test__ = False  # not a pytest test class


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is not alive
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class TestBed:
    """A SLURM cluster of ``n_nodes`` slurmd on this host (default two), owning one directory.

    ``n_nodes=None`` takes the count of a test bed already set up in ``directory``
    (from its testbed.json), else two; ``up()`` on a running bed of another size
    restarts it with the asked size."""

    __test__ = False

    def __init__(self, directory: str | os.PathLike[str], n_nodes: int | None = None) -> None:
        self.dir = Path(directory).resolve()
        self.conf = self.dir / "slurm.conf"
        self.info_file = self.dir / "testbed.json"
        recorded = self.info().get("nodes")
        self.running_nodes = tuple(recorded) if recorded else NODES
        self.nodes = node_names(n_nodes) if n_nodes is not None else self.running_nodes

    # ---- state -----------------------------------------------------------
    def info(self) -> dict:
        try:
            return json.loads(self.info_file.read_text())
        except (OSError, ValueError):
            return {}

    def env(self) -> dict[str, str]:
        """Environment variables a SLURM client needs to talk to this test bed."""
        return {"SLURM_CONF": str(self.conf)}

    def daemon_pids(self) -> dict[str, int | None]:
        pids: dict[str, int | None] = {}
        for name in ("munged", "slurmctld", *[f"slurmd-{n}" for n in self.running_nodes]):
            path = self.dir / "run" / f"{name}.pid"
            try:
                pids[name] = int(path.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                pids[name] = None
        return pids

    def is_up(self) -> bool:
        """All daemons alive and every node (of the asked size) usable by the scheduler."""
        if self.running_nodes != self.nodes:
            return False
        if not self.conf.exists() or not all(_pid_alive(p) for p in self.daemon_pids().values()):
            return False
        return self._nodes_ready()

    def _run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        env = {**os.environ, **self.env()}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise TestBedError(f"test bed: '{' '.join(cmd)}' failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[:300]}; logs in {self.dir}")
        return proc

    def _nodes_ready(self) -> bool:
        try:
            proc = self._run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        except subprocess.TimeoutExpired:
            return False
        if proc.returncode != 0:
            return False
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return all(states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in self.nodes)

    # ---- up --------------------------------------------------------------
    def up(self, timeout_s: float = 60) -> "TestBed":
        """Start munge, slurmctld and one slurmd per node; a no-op when already up."""
        if self.is_up():
            return self
        for tool in ("munged", "slurmctld", "slurmd", "sbatch"):
            if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
                raise TestBedError(f"test bed: '{tool}' not found; install it with "
                                   "'bash scripts/setup.sh' (apt: slurm-wlm munge)")
        self.down()  # half-started leftovers from an earlier run (or a bed of another size)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self.running_nodes != self.nodes and (self.dir / "state").exists():
            shutil.rmtree(self.dir / "state")  # slurmctld would restore the node table of the old size
        for sub in ("run", "state", "munge", "fakegpu", "logs", *[f"spool-{n}" for n in self.nodes]):
            (self.dir / sub).mkdir(exist_ok=True)
        os.chmod(self.dir / "munge", 0o700)
        try:
            ctld_port, slurmd_port, *node_ports = free_ports(2 + len(self.nodes), SLURM_BAND)
        except OSError as exc:
            raise TestBedError(f"test bed: {exc}; stop other test beds or services there and retry") from None
        self._write_configs(ctld_port, slurmd_port, node_ports)
        atomic_write_json(self.info_file, {"dir": str(self.dir), "slurmctld_port": ctld_port,
                                           "slurmd_port": slurmd_port,
                                           "node_ports": dict(zip(self.nodes, node_ports)),
                                           "nodes": list(self.nodes), "gpus_per_node": GPUS_PER_NODE})
        self.running_nodes = self.nodes
        self._start_munge()
        sbin = "/usr/sbin"
        self._run(f"{sbin}/slurmctld", "-f", str(self.conf))
        for node in self.nodes:
            self._run(f"{sbin}/slurmd", "-N", node, "-f", str(self.conf))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._nodes_ready():
                return self
            # nodes come up "down"/"unknown" until slurmctld has heard from them
            self._run("scontrol", "update", f"nodename={','.join(self.nodes)}", "state=resume",
                      check=False, timeout=10)
            time.sleep(0.5)
        raise TestBedError(f"test bed: nodes not ready within {timeout_s:.0f}s; "
                           f"see {self.dir}/slurmctld.log and {self.dir}/slurmd-*.log")

    def _start_munge(self) -> None:
        mdir = self.dir / "munge"
        key = mdir / "munge.key"
        if not key.exists():
            atomic_write_text(key, os.urandom(512).hex(), mode=0o600)
        self._run("/usr/sbin/munged", "--force", f"--socket={mdir}/munge.socket",
                  f"--key-file={key}", f"--pid-file={self.dir}/run/munged.pid",
                  f"--log-file={mdir}/munged.log", f"--seed-file={mdir}/munged.seed")
        # munged forks; its pid file appears a moment later
        for _ in range(50):
            if (mdir / "munge.socket").exists():
                return
            time.sleep(0.1)
        raise TestBedError(f"test bed: munged did not start; see {mdir}/munged.log")

    def _write_configs(self, ctld_port: int, slurmd_port: int, node_ports: list[int]) -> None:
        d = self.dir
        host = socket.gethostname()
        lines = [
            "# SLURM test bed made by hpc_verl.testbed (fake GPUs, accounting off)",
            "ClusterName=hpcvtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d}/munge/munge.socket",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "SchedulerParameters=sched_interval=1",
            "KillWait=5",
            # job ids of their own: two test beds on one host (pytest-xdist workers) must never share a
            # container name (hpcv-<job>-<node>) or a job's port block
            f"FirstJobId={(ctld_port - SLURM_BAND[0]) * 1000 + 1}",
            "MinJobAge=300",
            "InactiveLimit=0",
            f"SlurmctldPidFile={d}/run/slurmctld.pid",
            f"SlurmdPidFile={d}/run/slurmd-%n.pid",
            f"SlurmdSpoolDir={d}/spool-%n",
            f"StateSaveLocation={d}/state",
            f"SlurmctldLogFile={d}/slurmctld.log",
            f"SlurmdLogFile={d}/slurmd-%n.log",
            "SlurmUser=root",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            "GresTypes=gpu",
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
                         f"CPUs={CPUS_PER_NODE} RealMemory=8000 Gres=gpu:{GPUS_PER_NODE}")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE "
                     "State=UP OverSubscribe=YES")
        atomic_write_text(self.conf, "\n".join(lines) + "\n")
        gres = ["AutoDetect=off"]
        for node in self.nodes:
            for i in range(GPUS_PER_NODE):
                (d / "fakegpu" / f"{node}-gpu{i}").touch()
            gres.append(f"NodeName={node} Name=gpu File={d}/fakegpu/{node}-gpu[0-{GPUS_PER_NODE - 1}]")
        atomic_write_text(d / "gres.conf", "\n".join(gres) + "\n")

    # ---- down ------------------------------------------------------------
    def down(self, timeout_s: float = 20) -> None:
        """Stop exactly this test bed's daemons (by their pid files) and its jobs."""
        if self.conf.exists() and _pid_alive(self.daemon_pids().get("slurmctld")):
            # cancel this test bed's jobs so their steps (and Ray) are cleaned up by slurmd
            jobs = self._run("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
            if jobs:
                self._run("scancel", *jobs, check=False, timeout=10)
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline and self._run(
                        "squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split():
                    time.sleep(0.5)
        pids = self.daemon_pids()
        order = [f"slurmd-{n}" for n in self.running_nodes] + ["slurmctld", "munged"]
        for name in order:
            pid = pids.get(name)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in order:
            pid = pids.get(name)
            while _pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for name in order:
            try:
                (self.dir / "run" / f"{name}.pid").unlink()
            except FileNotFoundError:
                pass

    def status(self) -> dict:
        """Daemon pids and node states, for people and for the CLI script."""
        info = self.info()
        pids = self.daemon_pids()
        nodes = ""
        if self.conf.exists() and _pid_alive(pids.get("slurmctld")):
            nodes = self._run("sinfo", "-h", "-N", "-o", "%N %t %G", check=False, timeout=10).stdout
        return {"dir": str(self.dir), "up": self.is_up(),
                "daemons": {k: (v if _pid_alive(v) else None) for k, v in pids.items()},
                "nodes": nodes.strip().splitlines(), "slurm_conf": str(self.conf),
                "ports": {k: info.get(k) for k in ("slurmctld_port", "slurmd_port", "node_ports")}}
