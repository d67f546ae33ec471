"""The readiness barrier: bounded wait for every node and GPU of the job to join Ray.

Each poll (every 0.25 s) asks the head's GCS for alive nodes (one RPC on one kept connection, whatever
the node count: the cost does not grow with nodes beyond the size of the reply),
checks that the background ``srun`` steps are still alive, and reads the nodes'
state files. It returns as soon as the counts are met; it fails fast when a step
died or a node reported a failure; and on timeout it prints diagnostics (which
node is missing, ``ray status``, the head's raylet/GCS log tails) and exits
non-zero before the timeout ends.
"""
from __future__ import annotations

import importlib
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from hpc_verl.util import procs
from hpc_verl.bootstrap.netif import split_address, tcp_open
from hpc_verl.bootstrap.node import NODE_RESOURCE_PREFIX, log_tail, node_temp_dir
from hpc_verl.bootstrap.raydir import node_states, ray_dir, ray_env, read_json, read_plan
from hpc_verl.errors import BootstrapError
from hpc_verl.util.fs import atomic_write_text
from hpc_verl.util.rayready import READY_FILE_NAME, WORKER_ENV_MARK, write_ready

DIAG_RESERVE_S = 8.0


@dataclass
class ClusterView:
    """What one poll saw."""

    alive_nodes: list[str] = field(default_factory=list)   # SLURM node names that joined
    gpus: float = 0.0
    error: str | None = None


_CLIENTS: dict[str, Any] = {}  # one GCS client per address for the life of the process


def gcs_call(address: str, timeout_s: float, call: Callable[[Any], Any]) -> tuple[Any, str | None]:
    """(``call(client)``, None) on a GCS client kept per ``address``, or (None, why not). Never
    blocks on a dead address (Ray's GcsClient would, ~40 s); a failed call drops the client, so
    the next one connects afresh."""
    from ray._raylet import GcsClient  # heavy import: only here

    client = _CLIENTS.get(address)
    if client is None:
        if not tcp_open(*split_address(address), timeout_s=min(timeout_s, 0.5)):
            return None, f"nothing answers at {address}"
        try:
            client = _CLIENTS[address] = GcsClient(address=address)
        except Exception as exc:  # the GCS may not be up yet: report and ask again
            return None, _one_line(exc)
    try:
        return call(client), None
    except Exception as exc:
        _CLIENTS.pop(address, None)
        return None, _one_line(exc)


def gcs_node_infos(address: str, timeout_s: float) -> tuple[dict[Any, Any] | None, str | None]:
    """(node id -> GcsNodeInfo, None) from the GCS at ``address``, or (None, why not): one RPC."""
    return gcs_call(address, timeout_s, lambda c: c.get_all_node_info(timeout=max(timeout_s, 0.2)))


def gcs_view(address: str, timeout_s: float) -> ClusterView:
    """Alive nodes (by their hpcv_node_<name> resource) and total GPUs, from the GCS."""
    infos, error = gcs_node_infos(address, timeout_s)
    if infos is None:
        return ClusterView(error=error)
    view = ClusterView()
    for info in infos.values():
        if info.state != 0:  # 0 = ALIVE
            continue
        res = dict(info.resources_total)
        view.gpus += res.get("GPU", 0.0)
        names = [k[len(NODE_RESOURCE_PREFIX):] for k in res if k.startswith(NODE_RESOURCE_PREFIX)]
        view.alive_nodes.extend(names or [info.node_manager_address])
    return view


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


class Barrier:
    """Wait for ``len(plan.nodes)`` nodes and ``nodes * gpus_per_node`` GPUs, bounded."""

    def __init__(self, job_dir: str, srun_pids: dict[int, str], timeout_s: float | None = None,
                 poll_s: float = 0.25, view: Callable[[str, float], ClusterView] = gcs_view,
                 out: Any = None) -> None:
        self.job_dir = job_dir
        self.plan = read_plan(job_dir)
        self.srun_pids = srun_pids
        self.timeout_s = float(timeout_s if timeout_s is not None else self.plan["timeout_s"])
        self.poll_s = poll_s
        self.view = view
        self.out = out or sys.stderr
        self.expected_nodes = list(self.plan["nodes"])
        self.expected_gpus = len(self.expected_nodes) * int(self.plan["gpus_per_node"])

    def _say(self, msg: str) -> None:
        print(f"hpc_verl.bootstrap[barrier]: {msg}", file=self.out, flush=True)

    def wait(self) -> dict[str, Any]:
        """Block until ready; raise BootstrapError (after diagnostics) otherwise."""
        for k, v in ray_env(self.job_dir).items():
            os.environ[k] = v
        t0 = time.monotonic()
        if self.view is gcs_view:
            importlib.import_module("ray._raylet")  # the heavy import while the head starts, not after
        deadline = t0 + max(self.timeout_s - min(DIAG_RESERVE_S, self.timeout_s * 0.2), 0.5)
        last = ClusterView(error="head not started yet")
        head: dict[str, Any] | None = None
        while True:
            failure = self._failure()
            if failure:
                self._diagnose(head, last, failure)
                raise BootstrapError(failure)
            # read on every round: a head whose first ray start failed after publishing (its raylet
            # missed Ray's registration bound) publishes the address of its next attempt
            head = read_json(ray_dir(self.job_dir) / "head.json") or head
            if head:
                last = self.view(head["address"], min(2.0, max(deadline - time.monotonic(), 0.2)))
                if not last.error and set(self.expected_nodes) <= set(last.alive_nodes) \
                        and last.gpus >= self.expected_gpus:
                    elapsed = time.monotonic() - t0
                    self._write_env(head)
                    self._say(f"Ray ready: {len(last.alive_nodes)} nodes, {last.gpus:g} GPUs, "
                              f"address {head['address']} ({elapsed:.1f}s)")
                    return {"address": head["address"], "nodes": last.alive_nodes, "gpus": last.gpus,
                            "elapsed_s": elapsed}
            if time.monotonic() >= deadline:
                msg = self._timeout_message(head, last)
                self._diagnose(head, last, msg)
                raise BootstrapError(msg)
            time.sleep(self.poll_s)

    def _failure(self) -> str | None:
        """A dead srun step or a node that reported failure: fail now, not at the timeout."""
        states = node_states(self.job_dir)
        for node, st in states.items():
            if st.get("state") == "failed":
                return f"Ray bring-up failed on node {node}: {st.get('error')}"
        for pid, what in self.srun_pids.items():
            if not procs.alive(pid):
                missing = [n for n in self._nodes_of(what) if states.get(n, {}).get("state") != "running"]
                if missing:
                    return (f"Ray bring-up failed: the srun step for {what} (pid {pid}) exited; "
                            f"node(s) not running: {', '.join(missing)}")
        return None

    def _nodes_of(self, what: str) -> list[str]:
        if what == "head":
            return [self.plan["head"]]
        if what == "workers":
            return [n for n in self.expected_nodes if n != self.plan["head"]]
        return [n for n in what.split(",") if n]

    def _timeout_message(self, head: dict[str, Any] | None, view: ClusterView) -> str:
        if head is None:
            return (f"Ray not ready after {self.timeout_s:g}s: the head ({self.plan['head']}) never "
                    "published its address")
        missing = [n for n in self.expected_nodes if n not in view.alive_nodes]
        got = f"{len(set(view.alive_nodes) & set(self.expected_nodes))}/{len(self.expected_nodes)} nodes, " \
              f"{view.gpus:g}/{self.expected_gpus} GPUs"
        if missing:
            states = node_states(self.job_dir)
            why = [states.get(n, {}).get("unreachable") for n in missing]
            named = ", ".join(f"{n} ({w})" if w else n for n, w in zip(missing, why))
            return f"Ray not ready after {self.timeout_s:g}s: {got}; missing node(s): {named}"
        return f"Ray not ready after {self.timeout_s:g}s: {got} (GPU count short{'; ' + view.error if view.error else ''})"

    def _diagnose(self, head: dict[str, Any] | None, view: ClusterView, msg: str) -> None:
        self._say(f"ERROR: {msg}")
        states = node_states(self.job_dir)
        for node in self.expected_nodes:
            st = states.get(node, {})
            joined = "joined" if node in view.alive_nodes else "NOT joined"
            self._say(f"  node {node}: {joined}; state={st.get('state', 'no report')} "
                      f"pid={st.get('supervisor_pid')} ip={st.get('ip')} error={st.get('error')}")
            if st.get("log_tail") and node not in view.alive_nodes:
                self._say(f"  {node} log tail:\n{st['log_tail']}")
        for pid, what in self.srun_pids.items():
            self._say(f"  srun step {what} (pid {pid}): {'alive' if procs.alive(pid) else 'exited'}")
        if head:
            try:
                status = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "status",
                                         f"--address={head['address']}"], capture_output=True, text=True,
                                        timeout=min(6.0, DIAG_RESERVE_S - 1), env={**os.environ,
                                                                               **ray_env(self.job_dir)})
                self._say("  ray status:\n" + (status.stdout + status.stderr).strip()[-3000:])
            except (subprocess.TimeoutExpired, OSError) as exc:
                self._say(f"  ray status: unavailable ({exc})")
            self._say("  head logs:\n" + log_tail(node_temp_dir(self.plan, self.plan["head"])))

    def _write_env(self, head: dict[str, Any]) -> None:
        env = ray_env(self.job_dir)
        env = {"RAY_ADDRESS": head["address"], **env,
               "HPC_VERL_RAY_DASHBOARD": f"{head['dashboard_host']}:{head['dashboard_port']}", WORKER_ENV_MARK: "1"}
        lines = [f"export {k}={shlex.quote(str(v))}" for k, v in env.items()]
        atomic_write_text(ray_dir(self.job_dir) / "env.sh", "\n".join(lines) + "\n")
        write_ready(ray_dir(self.job_dir) / READY_FILE_NAME, env)   # last: a waiting trainer connects now


def parse_pids(text: str) -> dict[int, str]:
    """``"123:head 456:workers"`` -> {123: 'head', 456: 'workers'}."""
    out: dict[int, str] = {}
    for item in text.split():
        pid, _, what = item.partition(":")
        if not pid.isdigit():
            raise BootstrapError(f"--srun-pids: {item!r} is not PID[:what]; e.g. '1234:head 1235:workers'")
        out[int(pid)] = what or "step"
    return out
