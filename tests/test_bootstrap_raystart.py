"""The worker-side wait before ``ray start``: head address, then the head's session name in its
GCS (the worker then starts beside the head, its head lookup answered from what the job knows),
or, where that does not apply, the head registered in its GCS.

Against a real token-authenticated Ray head (tests/rayhead.py). Ray's own worker
start-up looks the head up with 2 s sleeps; ours polls, so these tests pin the
behaviour the bring-up time depends on: the probe sees a registered head only with
the job's token, never blocks on a dead address, and the wait ends on the stop
file or the deadline with a message instead of hanging.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_verl.bootstrap import raystart
from rayhead import free_ports, start_ray_head

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def head():
    h = start_ray_head(token_auth=True, num_cpus=0)
    try:
        yield h
    finally:
        h.stop()


PROBE = """
import sys, time
from hpc_verl.bootstrap import raystart
probe = getattr(raystart, sys.argv[3] if len(sys.argv) > 3 else "head_alive")(sys.argv[1])
deadline = time.monotonic() + float(sys.argv[2])
while not probe() and time.monotonic() < deadline:
    time.sleep(0.05)
print(probe())
"""


def _probe(address: str, token_file, wait_s: float, guard_s: float = 90, probe: str = "head_alive") -> str:
    """The probe (a raystart function of the address) in a fresh process (Ray caches the token per
    process), polled up to wait_s; a hang (Ray's GCS client blocks ~40 s on a dead address) fails
    at guard_s."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file),
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", PROBE, address, str(wait_s), probe], env=env, capture_output=True,
                         text=True, timeout=guard_s)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_probe_sees_the_head_once_registered_and_only_with_the_job_token(head, tmp_path):
    # the head's dashboard answers before its raylet registers: the probe waits for the raylet
    assert _probe(head.gcs_address, head.token_file, wait_s=60) == "True"
    wrong = tmp_path / "token"
    wrong.write_text("0" * 64)
    assert _probe(head.gcs_address, wrong, wait_s=1) == "False"


def test_probe_does_not_block_where_nothing_listens(tmp_path):
    (port,) = free_ports(1)
    assert _probe(f"127.0.0.1:{port}", tmp_path / "none", wait_s=0, guard_s=20) == "False"


def test_wait_ends_on_the_stop_file(tmp_path, capsys):
    stop = tmp_path / "stop"
    stop.write_text("")
    rc = raystart.main(["--head-file", str(tmp_path / "head.json"), "--stop-file", str(stop),
                        "--timeout-s", "60", "--", "--address=@ADDRESS@"])
    assert rc == 3
    assert "the job is stopping" in capsys.readouterr().err


def test_wait_ends_at_the_deadline_when_the_head_never_registers(tmp_path, capsys):
    (port,) = free_ports(1)
    head_file = tmp_path / "head.json"
    head_file.write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
    rc = raystart.main(["--head-file", str(head_file), "--stop-file", str(tmp_path / "stop"),
                        "--timeout-s", "1", "--", "--address=@ADDRESS@"])
    err = capsys.readouterr().err
    assert rc == 3
    assert f"the head at 127.0.0.1:{port} never registered" in err
    assert not os.path.exists(tmp_path / "stop")


def test_ray_start_process_skips_the_cli_groups_it_does_not_use():
    # the head's `ray start` is on the job's critical path: without serve/job/state the CLI
    # import is ~0.4 s instead of ~1.4 s here; `start` (and `stop`, `status`) must still be there
    code = ("import sys; from hpc_verl.bootstrap import raystart; raystart.skip_optional_cli(); "
            "from ray.scripts import scripts; "
            "print(sorted(set(scripts.cli.commands) & {'start', 'stop', 'status', 'serve', 'job'})); "
            "print(sorted(m for m in ('ray.serve', 'pandas', 'fastapi') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    commands, heavy = out.stdout.strip().splitlines()
    assert commands == "['start', 'status', 'stop']"
    assert heavy == "[]"


def test_without_client_server_keeps_the_jobs_port_where_ray_has_no_hook():
    args = ["--head", "--port=1", "--ray-client-server-port=20602", "--num-cpus=1"]

    class NewRay:   # the CLI asks this function whether Ray's client extras are there
        @staticmethod
        def get_ray_client_dependency_error():
            return None

    cli = NewRay()
    assert raystart.without_client_server(cli, args) == ["--head", "--port=1", "--num-cpus=1"]
    assert cli.get_ray_client_dependency_error() is not None   # so `ray start` gives the server no port
    # a Ray without that check would start the server on 10001 if given no port: it keeps ours
    assert raystart.without_client_server(object(), args) == args


def test_session_name_probe_reads_the_heads_session_from_its_gcs(head, tmp_path):
    # what a worker needs to start before the head's raylet registers: written right after the GCS starts
    assert _probe(head.gcs_address, head.token_file, wait_s=30, probe="session_named").startswith("session_")
    (port,) = free_ports(1)   # and nothing (no hang) where nothing listens
    assert _probe(f"127.0.0.1:{port}", tmp_path / "none", wait_s=0, guard_s=20, probe="session_named") == "None"


def test_early_start_lookup_answers_from_the_gcs_or_from_what_the_job_knows(monkeypatch):
    from ray._private import node as ray_node

    monkeypatch.setattr(ray_node, "get_all_node_info_until_retrieved", lambda *a, **k: [])   # restored after
    assert raystart.start_before_head_registers("/tmp/hv/7/node1", "session_x_1")
    lookup = ray_node.get_all_node_info_until_retrieved

    class Unregistered:   # the GCS answers with no head yet (or not at all): the head as the job knows it
        def get_all_node_info(self, **kw):
            raise TimeoutError("no head")

    (info,) = lookup(Unregistered(), timeout_per_retry=1, node_selectors=["head"])
    assert (info.state, info.temp_dir, info.session_dir) == (0, "/tmp/hv/7/node1", "/tmp/hv/7/node1/session_x_1")

    class Registered:   # once the head is registered, Ray's own record of it
        def get_all_node_info(self, timeout=None, node_selectors=None):
            assert node_selectors == ["head"]
            return {"id": "the head's GcsNodeInfo"}

    assert lookup(Registered(), node_selectors=["head"]) == ["the head's GcsNodeInfo"]


def test_early_start_is_skipped_where_ray_does_not_look_the_head_up_that_way(monkeypatch):
    from ray._private import node as ray_node

    monkeypatch.delattr(ray_node, "get_all_node_info_until_retrieved")
    assert raystart.start_before_head_registers("/tmp/hv/7/node1", "session_x_1") is False


def test_wait_ends_at_the_deadline_when_the_head_never_writes_its_session(tmp_path, capsys):
    (port,) = free_ports(1)
    head_file = tmp_path / "head.json"
    head_file.write_text(json.dumps({"address": f"127.0.0.1:{port}", "temp_dir": str(tmp_path / "head")}))
    rc = raystart.main(["--head-file", str(head_file), "--stop-file", str(tmp_path / "stop"),
                        "--timeout-s", "1", "--", "--address=@ADDRESS@"])
    assert rc == 3
    assert f"the head at 127.0.0.1:{port} never wrote its session name" in capsys.readouterr().err
