"""A port taken between the probe and Ray's bind: the node's ``ray start`` is retried on the next
free block (bounded, logged), and the head publishes only an address its own GCS listens on.

Real Ray head (``python -m hpc_verl.bootstrap head`` as srun would run it, no SLURM needed); the
"other process" is the supervisor itself binding the probed GCS port (HPC_VERL_FAULT=port-race),
which is what another job's Ray does on a shared node.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hpc_verl.util import procs
from hpc_verl.bootstrap.node import RAY_START_TRIES
from hpc_verl.bootstrap.ports import busy_ports, ephemeral_range
from slurm_bed import _listening_ports

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def _free_base(width: int = 300) -> int:
    lo, _ = ephemeral_range()
    # From the top down: the SLURM tests beside this one carve their jobs' blocks from 20000 up (job id x 100).
    # Each xdist worker starts its own 1500 ports lower: this module's tests run side by side on two workers,
    # and two heads planned on the same free window take each other's next block.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)
    for base in range(min(lo, 32000) - width - 200 - 1500 * (worker % 4), 21000, -500):
        if not busy_ports(list(range(base, base + width))):
            return base
    pytest.skip("no free port window below the ephemeral range")


def _bootstrap(*args: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hpc_verl.bootstrap", *args], env=env, **kw)


def _start_head(tmp_path: Path, base: int, temp_root: str, *plan_args: str,
                fault: str | None = None) -> tuple[Path, subprocess.Popen, Path]:
    """Plan a one-node job on the port block at ``base`` and start its head as srun would."""
    job = tmp_path / "job"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "RAY_USAGE_STATS_ENABLED": "0"}
    for k in ("RAY_ADDRESS", "SLURMD_NODENAME", "SLURM_GPUS_ON_NODE", "HPC_VERL_FAULT"):
        env.pop(k, None)
    if fault:
        env.update({"HPC_VERL_FAULT": fault, "HPC_VERL_FAULT_NODE": "solo"})
    plan = _bootstrap("plan", "--job-dir", str(job), "--job-id", "0", "--nodelist", "solo", "--node-hosts",
                      "solo=here", "--gpus-per-node", "0", "--num-cpus", "1", "--port-base", str(base),
                      "--port-stride", "100", "--port-slots", "3", "--allow-loopback", "true", "--temp-dir-root",
                      temp_root, "--timeout-s", "150", *plan_args, env=env, stdout=subprocess.PIPE, text=True)
    assert plan.wait(timeout=60) == 0
    log = tmp_path / "head.log"
    with open(log, "w") as out:
        head = _bootstrap("head", "--job-dir", str(job), "--node", "solo", env=env, stdout=out,
                          stderr=subprocess.STDOUT, start_new_session=True)
    return job, head, log


def _settled_state(job: Path, head: subprocess.Popen) -> dict:
    """The head's state once it is running or failed (or its process ended), bounded."""
    state_file = job / "ray" / "nodes" / "solo.json"
    deadline = time.monotonic() + 170
    state: dict = {}
    while time.monotonic() < deadline:
        state = json.loads(state_file.read_text()) if state_file.exists() else {}
        if state.get("state") in ("running", "failed") or head.poll() is not None:
            break
        time.sleep(0.3)
    return state


def _stop_head(job: Path, head: subprocess.Popen) -> None:
    (job / "ray" / "stop").write_text("")
    try:
        head.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, 9)
        head.wait()


def test_head_retries_on_the_next_block_when_its_port_is_taken(tmp_path):
    base = _free_base()
    temp_root = tempfile.mkdtemp(prefix="hpcvr", dir="/tmp")
    job, head, log = _start_head(tmp_path, base, temp_root, fault="port-race")
    state_file = job / "ray" / "nodes" / "solo.json"
    try:
        state = _settled_state(job, head)
        text = log.read_text()
        assert state.get("state") == "running", f"{state}\n{text}"
        assert state["retries"] == 1 and state["ports"]["block_start"] == base + 100  # the next block
        assert f"ray start attempt 1 of {RAY_START_TRIES} failed" in text and "held by another process" in text
        assert f"retrying on the next free port block, {base + 100}+" in text
        published = json.loads((job / "ray" / "head.json").read_text())
        assert published["gcs_port"] == base + 100  # never the taken port, which also "answers"
        assert procs.listens_in_tree(head.pid, base + 100) is True  # the GCS there is this head's own
        # the first block's GCS port is still held, by the "other process" (not one of the head's Ray daemons)
        assert busy_ports([base]) == [base] and procs.listens_in_tree(head.pid, base) is False
    finally:
        _stop_head(job, head)
    assert head.returncode == 0, log.read_text()
    final = json.loads(state_file.read_text())
    assert final["state"] == "stopped" and final["temp_dir_removed"]
    # nothing listens on either block any more (closed connections may linger in TIME_WAIT)
    assert not set(range(base, base + 300)) & _listening_ports()
    os.rmdir(temp_root) if os.path.isdir(temp_root) and not os.listdir(temp_root) else None


def test_a_raylet_that_missed_rays_registration_bound_is_retried(tmp_path):
    """Ray's own fixed 30 s for a raylet to register (a loaded node, a cold multi-GB image) is not a broken
    node: the start is retried within the readiness bound and the head comes up."""
    base = _free_base()
    temp_root = tempfile.mkdtemp(prefix="hpcvr", dir="/tmp")
    job, head, log = _start_head(tmp_path, base, temp_root, fault="slow-registration")
    try:
        state = _settled_state(job, head)
        text = log.read_text()
        # (attempt 1 is the injected one; on a loaded machine a real attempt can miss the bound too)
        assert state.get("state") == "running" and state["retries"] >= 1, f"{state}\n{text}"
        assert f"ray start attempt 1 of {RAY_START_TRIES} failed" in text
        assert "The current node timed out during startup" in text
        published = json.loads((job / "ray" / "head.json").read_text())
        assert procs.listens_in_tree(head.pid, published["gcs_port"]) is True
    finally:
        _stop_head(job, head)
    assert head.returncode == 0, log.read_text()
    os.rmdir(temp_root) if os.path.isdir(temp_root) and not os.listdir(temp_root) else None


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return out


@pytest.mark.parametrize("client_server", [False, True])
def test_head_runs_ray_client_server_only_when_the_profile_asks(tmp_path, client_server):
    # ray.client_server: false (the default) leaves Ray's Client server out of the head's start-up;
    # true starts it on the job's own client port, never Ray's fixed 10001
    base = _free_base()
    temp_root = tempfile.mkdtemp(prefix="hpcvc", dir="/tmp")
    job, head, log = _start_head(tmp_path, base, temp_root, "--client-server", str(client_server).lower())
    try:
        state = _settled_state(job, head)
        assert state.get("state") == "running", f"{state}\n{log.read_text()}"
        client_port = state["ports"]["client"]
        # the raylet starts its workers at niceness 0 (Ray's default is 15): it has the setting
        environ = Path(f"/proc/{state['raylet_pid']}/environ").read_bytes().split(b"\0")
        assert b"RAY_worker_niceness=0" in environ
        published = json.loads((job / "ray" / "head.json").read_text())
        servers = [c for c in _cmdlines(procs.descendants(head.pid)) if "ray.util.client.server" in c]
        if client_server:
            assert published["client_port"] == client_port
            assert len(servers) == 1 and f"--port={client_port}" in servers[0], servers
            until = time.monotonic() + 60   # it binds once its Python has booted
            while procs.listens_in_tree(head.pid, client_port) is False and time.monotonic() < until:
                time.sleep(0.2)
            assert procs.listens_in_tree(head.pid, client_port) is not False
        else:
            assert published["client_port"] is None
            assert servers == []
            assert busy_ports([client_port]) == []
    finally:
        _stop_head(job, head)
    assert head.returncode == 0, log.read_text()
