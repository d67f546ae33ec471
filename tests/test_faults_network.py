"""A port blocked between two nodes: the readiness barrier ends within its bound naming the node and
the port, and ``hpc-verl doctor --job-id`` on that node reports the same port closed.

Real network, real Ray: node2 lives in a network namespace of its own, joined to this host (node1)
by a veth pair on addresses of this test only (10.213.K.0/30), and an nftables rule in node2's
namespace drops TCP to the head's GCS port, as a site firewall between two nodes does. The head
(``python -m hpc_verl.bootstrap head``), the worker (the same, run in node2's namespace) and the
barrier (``wait``) are what the job script runs on each node; no SLURM is needed to cut a link.
Needs root, iproute2 and nft; skipped, saying so, where they are missing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slurm_bed import _listening_ports
from test_bootstrap_retry import _free_base

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
BARRIER_S = 30.0
#: how long a stopped job's processes may take to exit
LEFT_GRACE_S = 30


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = ["ip", "netns", "exec", ns, *cmd] if ns else list(cmd)
    res = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(full)}: {res.stderr.strip()}")
    return res


@pytest.fixture
def split_nodes():
    """(namespace, interface, host address, node2 address): node2's namespace joined to this host."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("nft")):
        pytest.skip("needs root, iproute2 and nft to build node2's network namespace")
    used = _sh("ip", "-4", "-o", "addr").stdout
    k = next((k for k in range(40, 250) if f"10.213.{k}." not in used), None)
    if k is None:
        pytest.skip("no free 10.213.K.0/30 test network")
    tag = f"{os.getpid() % 100000}"
    ns, ifname = f"hpcv-bp-{tag}", f"hpcvbp{tag}"
    if _sh("ip", "netns", "add", ns, check=False).returncode != 0:
        pytest.skip("cannot create a network namespace here")
    try:
        _sh("ip", "link", "add", ifname, "type", "veth", "peer", "name", f"{ifname}p", "netns", ns)
        _sh("ip", "addr", "add", f"10.213.{k}.1/30", "dev", ifname)
        _sh("ip", "link", "set", ifname, "up")
        # the same interface name on both "nodes": the profile names one network.interface
        _sh("ip", "link", "set", f"{ifname}p", "name", ifname, ns=ns)
        _sh("ip", "addr", "add", f"10.213.{k}.2/30", "dev", ifname, ns=ns)
        _sh("ip", "link", "set", ifname, "up", ns=ns)
        _sh("ip", "link", "set", "lo", "up", ns=ns)
        yield ns, ifname, f"10.213.{k}.1", f"10.213.{k}.2"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)          # takes the veth pair along
        subprocess.run(["ip", "link", "del", ifname], capture_output=True)


def _env(home: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "RAY_USAGE_STATS_ENABLED": "0", "HPC_VERL_HOME": str(home)}
    for k in ("RAY_ADDRESS", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_GPUS_ON_NODE", "HPC_VERL_FAULT", "HPCV_RUN_DIR"):
        env.pop(k, None)
    return env


def _doctor(env: dict, job_id: int, ns: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "hpc_verl", "doctor", "--profile", "local", "--job-id", str(job_id), "--json"]
    res = subprocess.run((["ip", "netns", "exec", ns] if ns else []) + cmd, env=env, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return {c["name"]: c for c in json.loads(res.stdout)["checks"]}


def test_a_port_blocked_between_nodes_is_named_by_the_barrier_and_by_doctor(split_nodes, tmp_path):
    from hpc_verl.launch import registry

    ns, ifname, head_ip, node2_ip = split_nodes
    env = _env(tmp_path / "home")
    job, base, job_id = tmp_path / "job", _free_base(), 4242
    temp_root = tempfile.mkdtemp(prefix="hpcvn", dir="/tmp")
    rec = registry.JobRecord(name="blocked", job_dir=str(tmp_path / "home" / "jobs" / "blocked-1"), profile="local",
                             job_id=job_id, run_dir=str(job), scheduler="slurm")
    os.makedirs(rec.job_dir)
    rec.save()       # (the record doctor finds by job id, in HPC_VERL_HOME)
    plan = subprocess.run([sys.executable, "-m", "hpc_verl.bootstrap", "plan", "--job-dir", str(job), "--job-id",
                           str(job_id), "--nodelist", "node1,node2", "--node-hosts", "node1=hostA,node2=hostB",
                           "--gpus-per-node", "0", "--num-cpus", "1", "--port-base", str(base), "--port-stride",
                           "100", "--port-slots", "3", "--interface", ifname, "--temp-dir-root", temp_root,
                           "--timeout-s", str(BARRIER_S)], env=env, capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    started: list[subprocess.Popen] = []

    def start(verb: str, node: str | None, log: str, in_ns: bool = False) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "hpc_verl.bootstrap", verb, "--job-dir", str(job)] \
            + (["--node", node] if node else [])
        with open(tmp_path / log, "w") as out:
            p = subprocess.Popen((["ip", "netns", "exec", ns] if in_ns else []) + cmd, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        started.append(p)
        return p

    head_file = job / "ray" / "head.json"
    try:
        head = start("head", "node1", "head.log")
        deadline = time.monotonic() + 120
        while not head_file.exists():
            assert head.poll() is None and time.monotonic() < deadline, (tmp_path / "head.log").read_text()
            time.sleep(0.2)
        published = json.loads(head_file.read_text())
        gcs = int(published["gcs_port"])
        assert published["ip"] == head_ip
        # the site firewall: node2 may not reach the head's GCS port (dropped, as most firewalls do)
        _sh("nft", "add", "table", "inet", "hpcvbp", ns=ns)
        _sh("nft", "add", "chain", "inet", "hpcvbp", "out", "{ type filter hook output priority 0 ; }", ns=ns)
        _sh("nft", "add", "rule", "inet", "hpcvbp", "out", "ip", "daddr", head_ip, "tcp", "dport", str(gcs), "drop",
            ns=ns)
        t0 = time.monotonic()
        start("worker", "node2", "worker.log", in_ns=True)
        barrier = start("wait", None, "barrier.log")

        # while the barrier waits: node2 reports the port, and doctor there finds it closed; from node1 it answers
        state = job / "ray" / "nodes" / "node2.json"
        while "unreachable" not in (json.loads(state.read_text()) if state.exists() else {}):
            assert time.monotonic() - t0 < 20, (tmp_path / "worker.log").read_text()
            time.sleep(0.2)
        there = _doctor(env, job_id, ns)["head-ports"]
        assert there["status"] == "FAIL" and f"GCS {head_ip}:{gcs}" in there["detail"], there
        assert "no answer" in there["detail"] and str(gcs) in there["fix"]
        here = _doctor(env, job_id)["head-ports"]
        assert here["status"] == "OK" and f"GCS {head_ip}:{gcs}" in here["detail"], here

        assert barrier.wait(timeout=BARRIER_S + 30) != 0
        took = time.monotonic() - t0
        text = (tmp_path / "barrier.log").read_text()
        assert took <= BARRIER_S + 10, f"the barrier took {took:.1f}s"
        error = next(ln for ln in text.splitlines() if "ERROR:" in ln)
        print(f"barrier after {took:.1f}s: {error}")
        assert "missing node(s): node2" in error and f"{head_ip}:{gcs}" in error and "no answer" in error
        assert f"cannot reach the head's GCS at {head_ip}:{gcs} on node1" in (tmp_path / "worker.log").read_text()
    finally:
        (job / "ray").mkdir(parents=True, exist_ok=True)
        (job / "ray" / "stop").write_text("")
        for p in started:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
    # nothing of the job is left: no process in its sessions, no port of its blocks listening (a daemon
    # told to stop may take a few seconds to exit on a loaded machine: what stays past the grace is a leak)
    deadline = time.monotonic() + LEFT_GRACE_S
    while True:
        left = subprocess.run(["ps", "-o", "pid=,args=", "-s", ",".join(str(p.pid) for p in started)],
                              capture_output=True, text=True).stdout.strip()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"still running in the job's sessions {LEFT_GRACE_S} s after it ended:\n{left}"
    assert not set(range(base, base + 300)) & _listening_ports()
    shutil.rmtree(temp_root, ignore_errors=True)
