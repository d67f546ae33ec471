"""Ray Jobs backend against a real local Ray head with token authentication.

One head per module (starting one costs seconds); each test submits its own
jobs. Only the "old cluster" case uses a fake: a tiny HTTP server that answers
/api/version like a Ray 2.30 dashboard, because two Ray versions cannot be
installed side by side here.
"""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from hpc_verl.launch import rayjobs
from rayhead import free_ports, start_ray_head


@pytest.fixture(scope="module")
def head():
    h = start_ray_head(token_auth=True)
    try:
        yield h
    finally:
        h.stop()


@pytest.fixture(scope="module")
def cluster(head):
    return rayjobs.connect(head.address, head.token_file, env={})


DRIVER = """\
import os, sys
import ray
import hpc_verl
ray.init()
@ray.remote
def square(x):
    return x * x
print("NCCL_IB_HCA=" + os.environ["NCCL_IB_HCA"])
print("SQUARES", sum(ray.get([square.remote(i) for i in range(4)])))
print("HPC_VERL_FROM", os.path.dirname(hpc_verl.__file__))
print("ARGS", sys.argv[1:])
"""


def test_submit_status_logs_success(cluster, head, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "driver.py").write_text(DRIVER)
    driver = rayjobs.DriverSpec.for_command(["python3", "driver.py"],
                                            ["trainer.total_epochs=1", "x=a b"])
    runtime_env = rayjobs.build_runtime_env(
        {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "TOKENIZERS_PARALLELISM": "false"},
        working_dir=str(work), py_modules=[rayjobs.hpc_verl_package_dir()],
        excludes=["__pycache__"])
    sid = cluster.submit(driver.entrypoint(), runtime_env,
                         submission_id=rayjobs.new_submission_id("ok job"))
    assert sid.startswith("hpcverl-ok-job-")
    assert cluster.state(sid) in {"PENDING", "RUNNING", "COMPLETED"}
    handle = rayjobs.RayJobHandle(head.address, sid, str(head.token_file))  # fresh connection
    assert handle.wait(timeout_s=90) == "COMPLETED", handle.logs()
    logs = handle.logs()
    assert "NCCL_IB_HCA=mlx5_0,mlx5_1" in logs
    assert "SQUARES 14" in logs  # the driver joined the token-protected cluster
    # hpc_verl reached the cluster through py_modules (the head has no PYTHONPATH to it)
    assert "HPC_VERL_FROM" in logs and "/work/wt" not in logs.split("HPC_VERL_FROM")[1].split("\n")[0]
    assert "ARGS ['trainer.total_epochs=1', 'x=a b']" in logs
    # the token never travels in the job's visible runtime_env
    info = cluster.info(sid)
    assert head.token_file.read_text().strip() not in json.dumps(info.runtime_env or {})


def test_failing_driver_reports_last_lines(cluster):
    driver = rayjobs.DriverSpec.for_command([
        "python3", "-c", "import sys; [print('line', i) for i in range(40)]; sys.exit(3)"])
    sid = cluster.submit(driver.entrypoint(), {}, submission_id=rayjobs.new_submission_id("bad"))
    handle = rayjobs.RayJobHandle(cluster.address, sid, cluster=cluster)
    with pytest.raises(rayjobs.RayJobFailedError) as err:
        handle.wait(timeout_s=60)
    msg = str(err.value)
    first = msg.splitlines()[0]
    assert "failed (exit code 3)" in first and f"hpc-verl logs {sid}" in first
    assert "line 39" in msg and "line 5\n" not in msg  # only the last lines
    assert handle.state == "FAILED"


def test_follow_streams_until_end(cluster):
    driver = rayjobs.DriverSpec.for_command([
        "python3", "-u", "-c", "import time\nfor i in range(3):\n print('tick', i); time.sleep(0.3)"])
    sid = cluster.submit(driver.entrypoint(), {}, submission_id=rayjobs.new_submission_id("follow"))
    chunks: list[str] = []
    state = cluster.follow(sid, chunks.append)
    assert state == "COMPLETED"
    text = "".join(chunks)
    assert "tick 0" in text and "tick 2" in text


def test_stop_cancels_running_job(cluster):
    driver = rayjobs.DriverSpec.for_command([
        "python3", "-u", "-c", "import time; print('started', flush=True); time.sleep(300)"])
    sid = cluster.submit(driver.entrypoint(), {}, submission_id=rayjobs.new_submission_id("long"))
    deadline = time.monotonic() + 60
    while "started" not in cluster.logs(sid):
        assert time.monotonic() < deadline, cluster.logs(sid)
        time.sleep(0.3)
    assert cluster.stop(sid) is True
    assert cluster.wait(sid, timeout_s=60) == "CANCELLED"


def test_unreachable_address_is_one_line():
    (port,) = free_ports(1)
    with pytest.raises(rayjobs.RayUnreachableError) as err:
        rayjobs.connect(f"127.0.0.1:{port}", None, env={}, timeout_s=3)
    msg = str(err.value)
    assert "\n" not in msg and f"http://127.0.0.1:{port}" in msg and "connection refused" in msg


def test_gcs_port_is_not_the_jobs_api(head):
    with pytest.raises(rayjobs.RayUnreachableError, match="does not speak HTTP|not a Ray"):
        rayjobs.connect(head.gcs_address, head.token_file, env={}, timeout_s=5)


def test_missing_and_wrong_token(head, tmp_path):
    with pytest.raises(rayjobs.RayAuthError, match="requires an auth token and none was sent"):
        rayjobs.connect(head.address, None, env={"HOME": str(tmp_path)})
    bad = tmp_path / "bad_token"
    bad.write_text("not-the-token\n")
    with pytest.raises(rayjobs.RayAuthError) as err:
        rayjobs.connect(head.address, bad, env={})
    assert "rejected the auth token from " + str(bad) in str(err.value)
    assert "not-the-token" not in str(err.value)
    with pytest.raises(rayjobs.RayAuthError, match="does not exist"):
        rayjobs.connect(head.address, tmp_path / "nope", env={})
    # Ray's own variable works too
    assert rayjobs.connect(head.address, None,
                           env={"RAY_AUTH_TOKEN_PATH": str(head.token_file)}).cluster_version


def test_ray_address_env_does_not_override_explicit_address(head, monkeypatch):
    (port,) = free_ports(1)
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", f"http://127.0.0.1:{port}")
    c = rayjobs.connect(head.address, head.token_file, env={})
    assert c.client.list_jobs() is not None
    assert c.client._address == head.address


class _OldRay(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = json.dumps({"version": "3", "ray_version": "2.30.0", "ray_commit": "x"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_old_cluster_version_reports_both():
    server = http.server.HTTPServer(("127.0.0.1", 0), _OldRay)  # fake: a Ray 2.30 dashboard
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(rayjobs.RayVersionError) as err:
            rayjobs.connect(f"127.0.0.1:{server.server_address[1]}", None, env={})
    finally:
        server.shutdown()
    msg = str(err.value)
    import ray
    assert f"client {ray.__version__}, cluster 2.30.0" in msg and ">= 2.40" in msg


def test_address_and_driver_validation():
    assert rayjobs.normalize_address("head:8265/") == "http://head:8265"
    with pytest.raises(rayjobs.RayJobsError, match="ray://"):
        rayjobs.normalize_address("ray://head:10001")
    assert rayjobs.DriverSpec.for_trainer("verl", ["trainer.nnodes=2"]).argv == [
        "python3", "-m", "verl.trainer.main_ppo", "trainer.nnodes=2"]
    with pytest.raises(rayjobs.RayJobsError, match="unknown trainer 'verll'"):
        rayjobs.DriverSpec.for_trainer("verll")
    assert rayjobs.DriverSpec.for_command(["bash", "-c", "echo $HOME; rm -rf /"]).entrypoint() == \
        "bash -c 'echo $HOME; rm -rf /'"
    assert rayjobs.state_of("STOPPED") == "CANCELLED"
    with pytest.raises(rayjobs.RayJobsError, match="does not exist"):
        rayjobs.build_runtime_env(working_dir="no/such/dir")


# --------------------------------------------------------------------------- registry-level glue

def test_ops_submit_record_describe_cancel(head, tmp_path):
    from hpc_verl.launch import rayjobs_ops

    opts = rayjobs_ops.RayJobOptions.from_mapping({"env_vars": {"EXTRA": "1"}})
    driver = rayjobs.DriverSpec.for_command([
        "python3", "-u", "-c",
        "import os, time; print('env', os.environ['NCCL_DEBUG'], os.environ['EXTRA'], flush=True);"
        " time.sleep(300)"])
    job_dir = tmp_path / "job"
    h, rec = rayjobs_ops.submit(address=head.address, driver=driver, name="ops", options=opts,
                                profile_env={"NCCL_DEBUG": "WARN"}, token_file=head.token_file,
                                job_dir=job_dir, profile_name="local")
    assert rec["kind"] == "rayjob" and rec["submission_id"] == h.submission_id == rec["id"]
    assert rec["token_file"] == str(head.token_file) and "token" not in json.dumps(
        json.loads((job_dir / "ray_job.json").read_text())["runtime_env"]).lower()
    saved = json.loads((job_dir / "ray_job.json").read_text())
    assert saved["runtime_env"]["env_vars"] == {"NCCL_DEBUG": "WARN", "EXTRA": "1"}
    deadline = time.monotonic() + 60
    while "env WARN 1" not in h.logs():
        assert time.monotonic() < deadline, h.logs()
        time.sleep(0.3)
    assert rayjobs_ops.describe(rec)["state"] == "RUNNING"
    assert "stop requested" in rayjobs_ops.cancel(rec)
    assert h.wait(timeout_s=60, check=False) == "CANCELLED"
    assert "already ended (CANCELLED)" in rayjobs_ops.cancel(rec)


def test_ops_describe_failed_job_and_follow_exit_code(head, capsys):
    from hpc_verl.launch import rayjobs_ops

    driver = rayjobs.DriverSpec.for_command([
        "python3", "-c", "print('about to fail'); raise SystemExit(7)"])
    h, rec = rayjobs_ops.submit(address=head.address, driver=driver, name="fails",
                                token_file=head.token_file)
    assert rayjobs_ops.logs(rec, follow=True) == 1
    assert "about to fail" in capsys.readouterr().out
    d = rayjobs_ops.describe(rec)
    assert d["state"] == "FAILED" and d["driver_exit_code"] == 7
    assert "about to fail" in d["last_log_lines"]


def test_ops_dry_run_and_options_validation(tmp_path):
    from hpc_verl.errors import ConfigError
    from hpc_verl.launch import rayjobs_ops

    (port,) = free_ports(1)  # nothing listens: a dry run must not connect
    h, rec = rayjobs_ops.submit(address=f"127.0.0.1:{port}", name="dry", dry_run=True,
                                driver=rayjobs.DriverSpec.for_trainer("builtin", ["trainer.total_epochs=1"]),
                                job_dir=tmp_path)
    assert h is None
    saved = json.loads((tmp_path / "ray_job.json").read_text())
    assert saved["entrypoint"] == "python3 -m hpc_verl.trainer.main trainer.total_epochs=1"
    assert saved["runtime_env"]["py_modules"] == [rayjobs.hpc_verl_package_dir()]  # built-in ships itself
    with pytest.raises(ConfigError, match="unknown key 'working_dri'.*did you mean 'working_dir'"):
        rayjobs_ops.RayJobOptions.from_mapping({"working_dri": "."})
    with pytest.raises(ConfigError, match="pip: expected a list"):
        rayjobs_ops.RayJobOptions.from_mapping({"pip": "numpy"})
