"""The per-node supervisor: start this node's Ray, keep it, stop exactly it.

Run under ``srun`` (one task per node) as ``python3 -m hpc_verl.bootstrap node``.
It picks the node's ports, starts ``ray start`` (head or worker) with the job's
token, publishes ``head.json`` as soon as the head's GCS answers (workers wait
for it, so they start in parallel right after the head), then stays in the
foreground until SIGTERM/SIGINT (teardown) or until its raylet dies (failure:
``nodes/<node>.json`` gets the error, the raylet's exit status and a log tail, exit code 1;
the job's ``bootstrap watch`` sees it and ends the job within a second or two).

Fault injection for tests (real processes, fake fault): ``HPC_VERL_FAULT_NODE=<node>``
with ``HPC_VERL_FAULT=hang`` (the node never joins but its step stays alive) or
``HPC_VERL_FAULT=crash`` (its Ray start fails at once), ``HPC_VERL_FAULT=slow-registration`` (its first
``ray start`` ends as one whose raylet missed Ray's registration bound) or ``HPC_VERL_FAULT=port-race`` (the
supervisor itself listens on the node's GCS/node-manager port right after probing it, as another
process would; ``ray start`` fails there and is retried on the next free block, at most
``RAY_START_TRIES`` times, each retry logged). A raylet that misses Ray's own fixed 30 s bound to
register with the GCS (a loaded node, a cold multi-GB image) is retried the same way.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from hpc_verl.util import procs
from hpc_verl.bootstrap.netif import select_ip, tcp_open, tcp_probe
from hpc_verl.bootstrap.ports import block_shift, busy_ports, pick_node_ports
from hpc_verl.bootstrap.raydir import ray_dir, ray_env, read_json, read_plan, write_node_state
from hpc_verl.bootstrap.timing import (RAYLET_REAP_S, REACH_EVERY_S, REACH_GRACE_S, REACH_PROBE_S,
                                      SUPERVISOR_POLL_S)
from hpc_verl.util.cpus import vllm_cpu_bind
from hpc_verl.util.rayready import RAYLET_ENV, SLOW_REGISTRATION, worker_env
from hpc_verl.errors import FAILURE_FILE_NAME, BootstrapError, record_failure
from hpc_verl.util.fs import atomic_write_json

NODE_RESOURCE_PREFIX = "hpcv_node_"
#: ``ray start`` attempts when another process takes one of the probed ports before Ray binds it.
RAY_START_TRIES = 3


#: after Ray died under a running job: how long the node waits for the job to stop it (the job stops
#: its trainer first, so Ray's remaining daemons do not shout into the trainer's log as they go)
LOST_WAIT_S = 10.0


class _RayLost(BootstrapError):
    """This node's Ray died while the job ran (not during the start)."""


class _PortTaken(Exception):
    """This attempt's ports were taken by another process between the probe and the bind."""


class _SlowRegistration(_PortTaken):
    """Ray's own fixed bound (30 s) for the raylet to register with the GCS passed: a loaded node or a
    cold image, not a broken one; the next attempt (with warm caches) runs within the readiness bound."""


def _squat(port: int) -> socket.socket:
    """Fault injection (``HPC_VERL_FAULT=port-race``): listen on ``port`` as another process would."""
    s = socket.socket()
    s.bind(("", port))
    s.listen()
    return s


def this_node() -> str:
    return os.environ.get("SLURMD_NODENAME") or os.environ.get("HPC_VERL_NODE") or socket.gethostname()


def node_temp_dir(plan: dict[str, Any], node: str) -> str:
    """Per-job, per-node Ray temp dir on node-local storage (short: Unix socket paths are limited)."""
    return os.path.join(plan["temp_dir_root"], str(plan["job_id"]), node)


#: Ray's session directory is ``session_<%Y-%m-%d_%H-%M-%S_%f>_<pid>`` (ray/_private/node.py)
RAY_SESSION_STAMP = "2000-01-01_00-00-00_000000"
#: the longest Unix socket name Ray makes under ``<session>/sockets/`` (the object store's)
RAY_LONGEST_SOCKET = "plasma_store"
#: what Ray (validate_socket_filepath) and the kernel allow in an AF_UNIX path on Linux
AF_UNIX_PATH_MAX = 107


def longest_socket_path(temp_dir: str, pid_digits: int) -> str:
    """The longest socket path Ray will create under ``temp_dir`` (pid of ``pid_digits`` digits)."""
    return os.path.join(temp_dir, f"session_{RAY_SESSION_STAMP}_{'9' * pid_digits}", "sockets", RAY_LONGEST_SOCKET)


def log_tail(temp_dir: str, names: tuple[str, ...] = ("raylet.out", "raylet.err", "gcs_server.out",
                                                     "gcs_server.err"), lines: int = 15) -> str:
    """The last lines of this node's Ray daemon logs (for diagnostics)."""
    logs = Path(temp_dir) / "session_latest" / "logs"
    chunks = []
    for name in names:
        p = logs / name
        if p.exists():
            text = p.read_text(errors="replace").splitlines()[-lines:]
            chunks.append(f"--- {p}\n" + "\n".join(text))
    return "\n".join(chunks) if chunks else f"(no Ray logs under {logs})"


class NodeSupervisor:
    """Owns this node's Ray processes for the life of the job step."""

    def __init__(self, job_dir: str, node: str | None = None, role: str | None = None) -> None:
        self.job_dir = job_dir
        self.plan = read_plan(job_dir)
        self.node = node or this_node()
        if self.node not in self.plan["nodes"]:
            raise BootstrapError(f"node '{self.node}' is not in this job's node list {self.plan['nodes']}")
        self.is_head = self.node == self.plan["head"]
        if role and (role == "head") != self.is_head:
            raise BootstrapError(f"'{role}' asked on node {self.node}, but the head is {self.plan['head']}")
        self.temp_dir = node_temp_dir(self.plan, self.node)
        self.stopping = False
        self._squatter: socket.socket | None = None
        # the workers the raylet starts inherit worker_env() (the barrier says so: WORKER_ENV_MARK)
        self.env = {**os.environ, **ray_env(job_dir), **worker_env(), **RAYLET_ENV, "HPC_VERL_RAY_NODE": self.node}
        # a loaded node starts Ray's agents slowly; the readiness barrier bounds the wait instead
        self.env.setdefault("RAY_agent_register_timeout_ms", "120000")
        # ray start would otherwise pick up ~/.ray/auth_token of whoever runs it
        self.env.pop("RAY_AUTH_TOKEN", None)
        self.env.pop("RAY_ADDRESS", None)
        bind = vllm_cpu_bind(self.env)
        if bind:  # several engine ranks on a CPU node: one CPU set each (the raylet's workers inherit it)
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = bind

    def state(self, **kw: Any) -> None:
        write_node_state(self.job_dir, self.node, node=self.node, role="head" if self.is_head else "worker",
                         supervisor_pid=os.getpid(), temp_dir=self.temp_dir,
                         in_container=os.path.exists("/run/.containerenv") or os.path.exists("/.dockerenv"), **kw)

    def _num_gpus(self) -> int:
        env_gpus = os.environ.get("SLURM_GPUS_ON_NODE")
        if env_gpus and env_gpus.isdigit():
            return int(env_gpus)
        return int(self.plan["gpus_per_node"])

    def ray_start_args(self, ip: str, ports: Any) -> list[str]:
        """Arguments of ``ray start`` for this node; a worker's head address is the placeholder
        ``@ADDRESS@``, which raystart fills in once the head is up."""
        resources = json.dumps({f"{NODE_RESOURCE_PREFIX}{self.node}": 1})
        args = [f"--node-ip-address={ip}", f"--num-gpus={self._num_gpus()}", f"--temp-dir={self.temp_dir}",
                f"--resources={resources}", "--disable-usage-stats", *ports.ray_start_args(self.is_head)]
        if self.plan.get("num_cpus"):
            args.append(f"--num-cpus={self.plan['num_cpus']}")
        if self.is_head:
            args += ["--head", f"--include-dashboard={'true' if self.plan['dashboard'] else 'false'}",
                     f"--dashboard-host={self.plan['dashboard_host']}"]
        else:
            args.append("--address=@ADDRESS@")
        return args

    def run(self) -> int:
        """Start Ray on this node and supervise it; returns the exit code for the step."""
        procs.become_subreaper()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        timeout_s = float(self.plan["timeout_s"])
        deadline = time.monotonic() + timeout_s
        self.state(state="starting", started=time.time())
        try:
            return self._run(deadline)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the barrier
            if not isinstance(exc, BootstrapError):
                exc = BootstrapError(f"node {self.node}: {type(exc).__name__}: {exc}")
            self.state(state="failed", error=str(exc), log_tail=log_tail(self.temp_dir))
            record_failure(str(exc), Path(self.job_dir) / FAILURE_FILE_NAME)
            print(f"hpc_verl.bootstrap[{self.node}]: error: {exc}", file=sys.stderr, flush=True)
            if isinstance(exc, _RayLost):
                deadline = time.monotonic() + LOST_WAIT_S
                while not self._stop_requested() and time.monotonic() < deadline:
                    time.sleep(0.1)
            return 1
        finally:
            self.stop()

    def _run(self, deadline: float) -> int:
        fault = os.environ.get("HPC_VERL_FAULT") if os.environ.get("HPC_VERL_FAULT_NODE") == self.node else None
        ip = select_ip(self.plan.get("interface"), bool(self.plan.get("allow_loopback")))
        layout = dict(self.plan["layout"], node_slot=self.plan["node_slots"][self.node],
                      nodes_per_host=self.plan["nodes_per_host"])
        job_id = int(self.plan["job_id"])
        ports = pick_node_ports(job_id, head=self.is_head, **layout)
        if block_shift(job_id, ports, **layout):
            print(f"hpc_verl.bootstrap[{self.node}]: ports: the job's own block has ports in use on this node "
                  f"(another job?); using the next free block, {ports.block_start}+", flush=True)
        self.state(state="starting", ip=ip, ports=ports.to_dict())
        if fault == "hang":
            print(f"hpc_verl.bootstrap[{self.node}]: fault injected: not starting Ray", flush=True)
            while not self._stop_requested():
                time.sleep(0.2)
            return 1
        if fault == "port-race":  # another process binds one of our ports right after the probe
            self._squatter = _squat(ports.gcs if self.is_head else ports.node_manager)
        for attempt in range(1, RAY_START_TRIES + 1):
            try:
                child = self._start_ray(ip, ports, deadline, crash=fault == "crash",
                                        slow=fault == "slow-registration" and attempt == 1)
                break
            except _PortTaken as exc:
                if (attempt == RAY_START_TRIES or time.monotonic() > deadline) and isinstance(exc, _SlowRegistration):
                    raise BootstrapError(str(exc)) from None
                if attempt == RAY_START_TRIES or time.monotonic() > deadline:
                    raise BootstrapError(f"node {self.node}: ray start failed {attempt} times on ports taken by "
                                         f"other processes (last: {exc}); find them with 'ss -ltnp' or change "
                                         "ray.port_base") from None
                shift = block_shift(job_id, ports, **layout) + 1
                ports = pick_node_ports(job_id, head=self.is_head, start_shift=shift, **layout)
                print(f"hpc_verl.bootstrap[{self.node}]: ray start attempt {attempt} of {RAY_START_TRIES} failed: "
                      f"{exc}; retrying on the next free port block, {ports.block_start}+", flush=True)
                self.state(state="starting", ip=ip, ports=ports.to_dict(), retries=attempt)
        if child is None:  # stop requested during the start
            return 0
        raylet = self._find("raylet")
        self.state(state="running", raylet_pid=raylet, ray_pids=procs.descendants(os.getpid()))
        print(f"hpc_verl.bootstrap[{self.node}]: Ray {'head' if self.is_head else 'worker'} up at {ip} "
              f"(ports {ports.block_start}+, temp {self.temp_dir})", flush=True)
        if raylet is None:
            raise BootstrapError(f"node {self.node}: ray start returned but no raylet runs; see "
                                 f"{self._kept_logs()}/raylet.out")
        exited: dict[int, int] = {}
        while not self._stop_requested():
            exited.update(procs.reap())   # the raylet is our child once ray start has exited (subreaper)
            if not procs.alive(raylet):
                # a multi-threaded process shows as a zombie before its last threads are gone; only
                # then can it be reaped (its wait status says how it ended)
                until = time.monotonic() + RAYLET_REAP_S
                while raylet not in exited and time.monotonic() < until:
                    exited.update(procs.reap())
                    time.sleep(0.02)
                how = procs.describe_status(exited[raylet]) if raylet in exited else "exited"
                raise _RayLost(f"node {self.node}: raylet (pid {raylet}) {how} while the job ran; Ray on "
                                     f"this node is gone (its log: {self._kept_logs()}/raylet.out)")
            time.sleep(SUPERVISOR_POLL_S)
        return 0

    def _kept_logs(self) -> Path:
        """Where this node's Ray logs are kept once its temp dir is removed."""
        return Path(self.job_dir) / "logs" / "ray" / self.node

    def _start_ray(self, ip: str, ports: Any, deadline: float, crash: bool = False,
                   slow: bool = False) -> subprocess.Popen | None:
        """One ``ray start`` on ``ports``; returns once it succeeded (None: the job is stopping).

        The head publishes ``head.json`` as soon as *its own* GCS listens (a port another process took
        between the probe and the bind answers too, so an open port proves nothing). A failure whose
        ports are now held by other processes raises :class:`_PortTaken` (the caller moves on to the
        next block); any other failure is a BootstrapError.
        """
        # workers start Ray's CLI now and let it wait for the head's address (import off the critical path)
        rdir = ray_dir(self.job_dir)
        cmd = [sys.executable, "-m", "hpc_verl.bootstrap.raystart", "--stop-file", str(rdir / "stop"),
               "--timeout-s", str(max(deadline - time.monotonic(), 1.0))] \
            + ([] if self.is_head else ["--head-file", str(rdir / "head.json")]) \
            + (["--no-client-server"] if self.is_head and not self.plan.get("client_server") else []) \
            + ["--", *self.ray_start_args(ip, ports)]
        if crash:
            cmd = [sys.executable, "-c", "import sys; sys.exit('injected fault: ray start failed')"]
        if slow:  # what ray start ends with when its raylet missed Ray's registration bound
            cmd = [sys.executable, "-c", f"import sys; sys.exit('injected fault: Exception: {SLOW_REGISTRATION}.')"]
        os.makedirs(self.temp_dir, exist_ok=True)
        log_path = os.path.join(self.temp_dir, "ray-start.log")
        with open(log_path, "ab") as log:
            lo, hi = ports.dist_ports   # the trainer's ranks on this node open their stores there
            env = {**self.env, "HPC_VERL_DIST_PORTS": f"{lo}-{hi}"}
            child = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        if self.is_head:
            if not self._wait_own_gcs(ip, ports.gcs, child, deadline):
                self._failed_start(child, log_path, ports, "GCS did not answer")
            atomic_write_json(ray_dir(self.job_dir) / "head.json",
                              {"node": self.node, "ip": ip, "address": f"{ip}:{ports.gcs}", "temp_dir": self.temp_dir,
                               "gcs_port": ports.gcs, "dashboard_port": ports.dashboard,
                               "client_port": ports.client if self.plan.get("client_server") else None,
                               "dashboard_host": self.plan["dashboard_host"]})
        reach = _HeadReach(self) if not self.is_head else None
        while child.poll() is None and not self._stop_requested():
            if time.monotonic() > deadline:
                raise BootstrapError(self._start_failure(child, log_path, "ray start did not return"))
            if reach is not None:
                reach.check()
            time.sleep(0.1)
        if reach is not None:
            reach.clear()
        if self._stop_requested():
            return None
        if child.returncode != 0:
            self._failed_start(child, log_path, ports, f"ray start exited {child.returncode}")
        return child

    def _wait_own_gcs(self, host: str, port: int, child: subprocess.Popen, deadline: float) -> bool:
        """Until this head's own GCS listens on ``port``; False when ray start or its gcs_server died
        (ray start itself would keep retrying a GCS that crashed on a taken port for ~40 s)."""
        gcs_seen = False
        while time.monotonic() < deadline:
            if tcp_open(host, port) and procs.listens_in_tree(os.getpid(), port) is not False:
                return True
            if child.poll() is not None and child.returncode != 0:
                return False
            gcs_alive = any(procs.comm(p) == "gcs_server" for p in procs.descendants(os.getpid()))
            if gcs_seen and not gcs_alive:
                return False
            gcs_seen = gcs_seen or gcs_alive
            time.sleep(0.1)
        return False

    def _failed_start(self, child: subprocess.Popen, log_path: str, ports: Any, what: str) -> NoReturn:
        """Stop what this attempt left running; raise _PortTaken when others now hold its ports."""
        procs.reap_tree(os.getpid(), grace_s=5.0)
        taken = [p for p in busy_ports(ports.all_ports(self.is_head))
                 if procs.listens_in_tree(os.getpid(), p) is not True]
        if taken:
            shown = ", ".join(map(str, taken[:6])) + (" ..." if len(taken) > 6 else "")
            raise _PortTaken(f"{what}; port(s) {shown} of block {ports.block_start} are held by another process")
        failure = self._start_failure(child, log_path, what)
        if SLOW_REGISTRATION in failure:
            raise _SlowRegistration(failure)
        raise BootstrapError(failure)

    def _find(self, name: str) -> int | None:
        for pid in procs.descendants(os.getpid()):
            if procs.comm(pid) == name:
                return pid
        return None

    def _start_failure(self, child: subprocess.Popen, log_path: str, what: str) -> str:
        try:
            tail = Path(log_path).read_text(errors="replace").strip().splitlines()[-5:]
        except OSError:
            tail = []
        return f"node {self.node}: {what}; last output: {' | '.join(tail) or '(none)'} (log {log_path})"

    def _stop_requested(self) -> bool:
        return self.stopping or (ray_dir(self.job_dir) / "stop").exists()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = True

    def stop(self) -> None:
        """Stop every process this supervisor started (its descendants), nothing else.

        In the order Ray's daemons let go of each other (``procs.end_ray_tree``)."""
        killed = procs.end_ray_tree(os.getpid())
        # a Ray daemon forked while its `ray start` was being stopped can miss the tree (it was
        # reparented past us): whatever still names this node's temp dir is this node's Ray too
        stray = procs.pids_using(self.temp_dir) if os.path.isdir(self.temp_dir) else []
        if stray:
            print(f"hpc_verl.bootstrap[{self.node}]: stopping Ray processes outside the supervisor's tree: "
                  f"{', '.join(f'{p} ({procs.comm(p)})' for p in stray)}", flush=True)
            procs.end_pids(stray, grace_s=3.0)
        killed = sorted(set(killed) | set(stray))
        if self._squatter is not None:
            self._squatter.close()
        st = read_json(ray_dir(self.job_dir) / "nodes" / f"{self.node}.json") or {}
        removed = remove_node_temp_dir(self.job_dir, self.node, self.temp_dir)
        self.state(state="failed" if st.get("state") == "failed" else "stopped", stopped_pids=killed,
                   temp_dir_removed=removed)


class _HeadReach:
    """A worker waiting to join: can this node reach the head's GCS port? The head publishes its
    address only once its GCS listens, so a port that does not answer from here is the network
    between the nodes (a firewall, a route). Said once on the node's log and kept in its state, where
    the readiness barrier names it; cleared when the port answers."""

    def __init__(self, node: "NodeSupervisor") -> None:
        self.node = node
        self.next_probe = 0.0
        self.failing_since: float | None = None
        self.reported: str | None = None

    def check(self) -> None:
        now = time.monotonic()
        if now < self.next_probe:
            return
        self.next_probe = now + REACH_EVERY_S
        head = read_json(ray_dir(self.node.job_dir) / "head.json")
        if not head or not head.get("gcs_port"):
            return
        where = f"{head['ip']}:{head['gcs_port']}"
        why = tcp_probe(str(head["ip"]), int(head["gcs_port"]), REACH_PROBE_S)
        if why is None:
            self.failing_since = None
            if self.reported:
                print(f"hpc_verl.bootstrap[{self.node.node}]: the head's GCS at {where} answers again", flush=True)
                self.clear()
            return
        self.failing_since = self.failing_since or now
        if now - self.failing_since >= REACH_GRACE_S and self.reported is None:
            self.reported = f"cannot reach the head's GCS at {where} on {head.get('node', 'the head')}: {why}"
            print(f"hpc_verl.bootstrap[{self.node.node}]: {self.reported}", flush=True)
            self.node.state(unreachable=self.reported)

    def clear(self) -> None:
        if self.reported is not None:
            self.reported = None
            self.node.state(unreachable=None)


def remove_node_temp_dir(job_dir: str, node: str, temp_dir: str) -> bool:
    """Ray's per-node temp dir (sockets, session logs, spilled objects) goes with the job, so
    node-local disks do not fill up run after run; its logs are kept in the run directory
    first (the batch script's collect stage copies them while Ray runs; on an early exit,
    nobody did). A failed copy keeps the temp dir: logs are never lost for tidiness.
    Also used by a local job's supervisor for a node whose supervisor was killed."""
    temp = Path(temp_dir)
    if not temp.exists():
        return True
    dst = Path(job_dir) / "logs" / "ray" / node
    try:
        if not dst.exists():
            src = temp / "session_latest" / "logs"
            if src.is_dir():
                shutil.copytree(src, dst, symlinks=True)
        start_log = temp / "ray-start.log"
        if start_log.exists():
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copy2(start_log, dst / "ray-start.log")
    except (OSError, shutil.Error) as exc:
        print(f"hpc_verl.bootstrap[{node}]: keeping {temp}: its logs could not be saved ({exc})",
              file=sys.stderr, flush=True)
        return False
    shutil.rmtree(temp, ignore_errors=True)
    try:
        temp.parent.rmdir()  # <temp_dir_root>/<job id>, once its last node on this host is gone
    except OSError:
        pass
    return not temp.exists()
