"""Unit tests of the node bootstrap: hostlist, port block, IP selection, barrier failure modes."""
from __future__ import annotations

import io
import socket
import subprocess

import pytest

from hpc_verl.bootstrap.barrier import Barrier, ClusterView, parse_pids
from hpc_verl.bootstrap.hostlist import expand_hostlist
from hpc_verl.bootstrap.netif import select_ip
from hpc_verl.bootstrap.raydir import node_slots, parse_node_hosts, write_node_state, write_plan
from hpc_verl.bootstrap.ports import HEAD_FIXED, busy_ports, pick_node_ports, port_block
from hpc_verl.errors import BootstrapError
from hpc_verl.util.fs import atomic_write_json


# ----------------------------------------------------------------------------- hostlist
@pytest.mark.parametrize("text,expected", [
    ("node1", ["node1"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("gpu[01-03,7]", ["gpu01", "gpu02", "gpu03", "gpu7"]),
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("x[1-2],x2,x3", ["x1", "x2", "x3"]),
])
def test_expand_hostlist(text, expected):
    assert expand_hostlist(text) == expected


@pytest.mark.parametrize("text,needle", [("node[1-", "unbalanced"), ("node1]", "unbalanced"),
                                         ("node[3-1]", "backwards"), ("node[a-b]", "bad range")])
def test_expand_hostlist_errors(text, needle):
    with pytest.raises(BootstrapError, match=needle):
        expand_hostlist(text)


# ----------------------------------------------------------------------------- ports
def test_port_block_layout_is_disjoint_and_job_derived():
    a = port_block(7, port_base=20000, port_stride=100, port_slots=120)
    b = port_block(8, port_base=20000, port_stride=100, port_slots=120)
    assert a.block_start == 20700 and b.block_start == 20800
    assert not set(a.all_ports(head=True)) & set(b.all_ports(head=True))
    # every port of the block is inside the job's stride
    assert all(a.block_start <= p < a.block_start + 100 for p in a.all_ports(head=True))
    assert a.gcs == 20700 and a.node_manager == 20700 + HEAD_FIXED


def test_two_nodes_of_one_job_on_one_host_do_not_share_ports():
    n0 = port_block(3, node_slot=0, nodes_per_host=2)
    n1 = port_block(3, node_slot=1, nodes_per_host=2)
    assert not set(n0.all_ports(head=True)) & set(n1.all_ports(head=False))
    assert n1.max_worker < n0.block_start + 100


def test_ray_start_args_pin_every_port():
    args = " ".join(port_block(5).ray_start_args(head=True))
    for flag in ("--port=", "--dashboard-port=", "--ray-client-server-port=", "--node-manager-port=",
                 "--object-manager-port=", "--dashboard-agent-listen-port=", "--dashboard-agent-grpc-port=",
                 "--runtime-env-agent-port=", "--metrics-export-port=", "--min-worker-port=", "--max-worker-port="):
        assert flag in args
    assert "--port=" not in " ".join(port_block(5).ray_start_args(head=False))


def test_port_defaults_are_the_profile_schemas():
    """A job without a profile value (bootstrap CLI defaults, port_block's) uses the schema's defaults."""
    from hpc_verl.bootstrap.__main__ import _parser as build_parser
    from hpc_verl.profiles.schema import RaySection

    ray = RaySection()
    assert port_block(7) == port_block(7, port_base=ray.port_base, port_stride=ray.port_stride,
                                       port_slots=ray.port_slots)
    for verb in (["plan", "--job-dir", "d"], ["ports", "--job-id", "7"]):
        args = build_parser().parse_args(verb)
        assert (args.port_base, args.port_stride, args.port_slots) == (ray.port_base, ray.port_stride,
                                                                       ray.port_slots)
    args = build_parser().parse_args(["plan", "--job-dir", "d"])
    assert (args.temp_dir_root, args.timeout_s) == (ray.temp_dir_root, ray.readiness_timeout_s)


def test_port_layout_errors():
    with pytest.raises(BootstrapError, match="port_stride"):
        port_block(1, port_stride=20, nodes_per_host=4)
    with pytest.raises(BootstrapError, match="65535"):
        port_block(1, port_base=65000, port_stride=1000, port_slots=10)


def test_pick_node_ports_moves_off_a_taken_block():
    layout = {"port_base": 24000, "port_stride": 100, "port_slots": 50}
    # the SLURM tests beside this one start Rays in this range: take the first job whose
    # node-manager port is free now (a fixed one was once held by one of them)
    for job in range(11, 50):
        want = port_block(job, **layout)
        with socket.socket() as s:
            try:
                s.bind(("", want.node_manager))
            except OSError:
                continue
            s.listen()
            assert busy_ports([want.node_manager]) == [want.node_manager]
            got = pick_node_ports(job, head=True, **layout)
        assert got.block_start != want.block_start
        assert want.node_manager not in got.all_ports(head=True)
        return
    pytest.fail("no free node-manager port in 24000-28999 to take")



def _leave_time_wait(port: int) -> None:
    """Close a served connection on ``port`` from the server side, as a Ray that just ended does."""
    with socket.socket() as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("", port))
        srv.listen()
        with socket.create_connection(("127.0.0.1", port)) as client:
            conn, _ = srv.accept()
            conn.close()        # the server closes first: its side (``port``) goes to TIME_WAIT
            client.recv(1)      # the peer sees the close before it closes too


def test_a_port_left_in_time_wait_is_free_to_the_next_job():
    """CI failure of fault 9: a block whose ports an earlier job left in TIME_WAIT was "taken"."""
    want = port_block(13, port_base=24000, port_stride=100, port_slots=50)
    _leave_time_wait(want.gcs)
    with socket.socket() as plain:   # the TIME_WAIT is there: a bind without SO_REUSEADDR fails
        with pytest.raises(OSError):
            plain.bind(("", want.gcs))
    assert busy_ports([want.gcs]) == []
    assert pick_node_ports(13, head=True, port_base=24000, port_stride=100, port_slots=50) == want

# ----------------------------------------------------------------------------- IP selection
IFACES = {"lo": "127.0.0.1", "docker0": "172.17.0.1", "eth0": "10.1.2.3", "ib0": "10.9.0.5"}


def test_select_ip_named_interface():
    assert select_ip("ib0", available=IFACES, default_iface="eth0") == "10.9.0.5"


def test_select_ip_auto_prefers_default_route_and_skips_bridges():
    assert select_ip(None, available=IFACES, default_iface="eth0") == "10.1.2.3"
    assert select_ip("auto", available={"lo": "127.0.0.1", "docker0": "172.17.0.1", "ib0": "10.9.0.5"},
                     default_iface="docker0") == "10.9.0.5"


def test_select_ip_refuses_loopback_and_bridges():
    with pytest.raises(BootstrapError, match="loopback"):
        select_ip("lo", available=IFACES)
    with pytest.raises(BootstrapError, match="bridge"):
        select_ip("docker0", available=IFACES)
    with pytest.raises(BootstrapError, match="no IPv4 address.*interfaces here: docker0="):
        select_ip("eth7", available=IFACES)
    with pytest.raises(BootstrapError, match="no usable IPv4"):
        select_ip(None, available={"lo": "127.0.0.1", "docker0": "172.17.0.1"})


def test_select_ip_loopback_only_when_the_profile_allows_it():
    only_lo = {"lo": "127.0.0.1"}
    assert select_ip("lo", allow_loopback=True, available=only_lo) == "127.0.0.1"
    assert select_ip(None, allow_loopback=True, available=only_lo) == "127.0.0.1"
    # allowed, but a routable address still wins
    assert select_ip(None, allow_loopback=True, available={**only_lo, "eth0": "10.1.2.3"}) == "10.1.2.3"


def test_select_ip_on_this_machine_finds_something():
    assert select_ip(None, allow_loopback=True)


# ----------------------------------------------------------------------------- node slots
def test_node_slots_from_hosts():
    hosts = parse_node_hosts("node1=vm,node2=vm,node3=other,")
    slots, per_host = node_slots(["node1", "node2", "node3"], hosts)
    assert slots == {"node1": 0, "node2": 1, "node3": 0} and per_host == 2


# ----------------------------------------------------------------------------- barrier
def _plan(tmp_path, nodes="n[1-3]", timeout_s=5.0):
    return write_plan(str(tmp_path), 42, nodes, gpus_per_node=2, num_cpus=1, port_base=20000, port_stride=100,
                      port_slots=120, interface=None, allow_loopback=True, temp_dir_root=str(tmp_path / "t"),
                      dashboard=False, dashboard_host="127.0.0.1", timeout_s=timeout_s, python="python3",
                      node_hosts="n1=a,n2=b,n3=c")


def _head(tmp_path):
    atomic_write_json(tmp_path / "ray" / "head.json", {"address": "127.0.0.1:1", "dashboard_host": "127.0.0.1",
                                                       "dashboard_port": 2, "node": "n1"})


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_plan_writes_private_token(tmp_path):
    plan = _plan(tmp_path)
    assert plan["nodes"] == ["n1", "n2", "n3"] and plan["head"] == "n1"
    token = tmp_path / "ray" / "token"
    assert oct(token.stat().st_mode & 0o777) == "0o600" and len(token.read_text()) == 64
    assert oct((tmp_path / "ray").stat().st_mode & 0o777) == "0o700"


def test_barrier_ready_writes_env(tmp_path, sleeper):
    _plan(tmp_path)
    _head(tmp_path)
    views = iter([ClusterView(error="not yet"), ClusterView(["n1", "n2"], 4), ClusterView(["n1", "n2", "n3"], 6)])
    out = io.StringIO()
    res = Barrier(str(tmp_path), {sleeper.pid: "head"}, view=lambda a, t: next(views), poll_s=0.01, out=out).wait()
    assert res["gpus"] == 6 and sorted(res["nodes"]) == ["n1", "n2", "n3"]
    env = (tmp_path / "ray" / "env.sh").read_text()
    assert "export RAY_ADDRESS=127.0.0.1:1" in env and "RAY_AUTH_MODE=token" in env
    assert "RAY_AUTH_TOKEN_PATH=" in env and "Ray ready: 3 nodes, 6 GPUs" in out.getvalue()


def test_barrier_follows_a_head_that_published_a_new_address(tmp_path, sleeper):
    # the head's first ray start published head.json, then failed (raylet registration bound) and
    # came up on its next port block: the barrier must ask the new address, not the first one
    _plan(tmp_path)
    _head(tmp_path)
    asked: list[str] = []

    def view(address: str, _timeout: float) -> ClusterView:
        asked.append(address)
        if len(asked) == 2:
            atomic_write_json(tmp_path / "ray" / "head.json", {"address": "127.0.0.1:9", "dashboard_host":
                                                               "127.0.0.1", "dashboard_port": 2, "node": "n1"})
        if address.endswith(":9"):
            return ClusterView(["n1", "n2", "n3"], 6)
        return ClusterView(error="connection refused")

    res = Barrier(str(tmp_path), {sleeper.pid: "head"}, view=view, poll_s=0.01, out=io.StringIO()).wait()
    assert res["address"] == "127.0.0.1:9" and asked[0] == "127.0.0.1:1"
    assert "export RAY_ADDRESS=127.0.0.1:9" in (tmp_path / "ray" / "env.sh").read_text()


def test_barrier_times_out_naming_the_missing_node(tmp_path, sleeper):
    _plan(tmp_path, timeout_s=1.5)
    _head(tmp_path)
    write_node_state(str(tmp_path), "n3", state="starting", node="n3")
    out = io.StringIO()
    with pytest.raises(BootstrapError, match=r"2/3 nodes, 4/6 GPUs; missing node\(s\): n3"):
        Barrier(str(tmp_path), {sleeper.pid: "workers"}, view=lambda a, t: ClusterView(["n1", "n2"], 4),
                poll_s=0.05, out=out).wait()
    text = out.getvalue()
    assert "node n3: NOT joined; state=starting" in text and "srun step workers" in text


@pytest.mark.timeout(120)  # the barrier's own bound is 300 s: waiting for it would fail here
def test_barrier_fails_fast_when_an_srun_step_dies(tmp_path):
    _plan(tmp_path, timeout_s=300)
    _head(tmp_path)
    dead = subprocess.Popen(["true"])
    dead.wait()
    with pytest.raises(BootstrapError, match=r"srun step for workers .* exited; node\(s\) not running: n2, n3"):
        Barrier(str(tmp_path), {dead.pid: "workers"}, view=lambda a, t: ClusterView(["n1"], 2), poll_s=0.05,
                out=io.StringIO()).wait()


@pytest.mark.timeout(120)
def test_barrier_fails_fast_on_a_node_report(tmp_path, sleeper):
    _plan(tmp_path, timeout_s=300)
    write_node_state(str(tmp_path), "n2", state="failed", error="ray start exited 1", node="n2")
    with pytest.raises(BootstrapError, match="failed on node n2: ray start exited 1"):
        Barrier(str(tmp_path), {sleeper.pid: "workers"}, view=lambda a, t: ClusterView(), poll_s=0.05,
                out=io.StringIO()).wait()


def test_barrier_gpu_shortfall_is_reported(tmp_path, sleeper):
    _plan(tmp_path, timeout_s=1.0)
    _head(tmp_path)
    with pytest.raises(BootstrapError, match="3/3 nodes, 3/6 GPUs"):
        Barrier(str(tmp_path), {sleeper.pid: "head"}, view=lambda a, t: ClusterView(["n1", "n2", "n3"], 3),
                poll_s=0.05, out=io.StringIO()).wait()


def test_parse_pids():
    assert parse_pids("12:head 13:workers") == {12: "head", 13: "workers"}
    with pytest.raises(BootstrapError):
        parse_pids("x:head")


def test_the_top_of_the_worker_range_is_kept_for_the_trainers_rendezvous(monkeypatch):
    from hpc_verl.bootstrap.ports import DIST_PORTS
    from hpc_verl.dataflow import distgroup

    b = port_block(7)
    lo, hi = b.dist_ports
    assert hi == b.max_worker and hi - lo + 1 == DIST_PORTS and lo > b.min_worker
    assert f"--max-worker-port={lo - 1}" in b.ray_start_args(head=False)   # Ray's workers stay below
    # a rank 0 takes its store's port from that range (the bootstrap exports it to the node's Ray)
    monkeypatch.setenv("HPC_VERL_DIST_PORTS", f"{lo}-{hi}")
    store, port = distgroup.open_store("127.0.0.1", 1, 5)
    assert lo <= port <= hi
    del store
    monkeypatch.setenv("HPC_VERL_DIST_PORTS", "20090-x")
    with pytest.raises(RuntimeError, match="is not a port range like"):
        distgroup.open_store("127.0.0.1", 1, 5)


# ----------------------------------------------------------------------------- node stop
def test_stop_ends_a_ray_daemon_that_left_the_supervisors_tree(tmp_path):
    """A daemon forked while its `ray start` was being stopped can be reparented past the
    supervisor (a real CI leak: a head's gcs_server under PPID 1). stop() also ends what names the
    node's temp dir. The stray here is a real detached process (double fork, PPID 1), not a fake."""
    import os
    import sys
    import time

    from hpc_verl.bootstrap.node import NodeSupervisor
    from hpc_verl.util import procs

    _plan(tmp_path)
    sup = NodeSupervisor(str(tmp_path), node="n2")
    os.makedirs(sup.temp_dir)
    other = tmp_path / "elsewhere"
    other.mkdir()
    pidfile = tmp_path / "pids"
    # two detached sleepers: one names the node's temp dir (like gcs_server's --log_dir), one does not
    sleeper = f"{sys.executable} -c 'import time; time.sleep(300)'"
    script = (f'{sleeper} --log_dir={sup.temp_dir}/session_x/logs & echo $! >> {pidfile}; '
              f'{sleeper} --log_dir={other} & echo $! >> {pidfile}')
    subprocess.run(["setsid", "bash", "-c", f"exec 0</dev/null 1>/dev/null 2>&1; {script}"], check=True)
    deadline = time.monotonic() + 10
    while (not pidfile.exists() or len(pidfile.read_text().split()) < 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    stray, bystander = map(int, pidfile.read_text().split())
    try:
        assert procs.alive(stray) and stray not in procs.descendants(os.getpid())
        sup.stop()
        assert not procs.alive(stray)          # the node's own daemon is gone
        assert procs.alive(bystander)          # what does not name the temp dir is left alone
        assert not os.path.exists(sup.temp_dir)
    finally:
        for pid in (stray, bystander):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
