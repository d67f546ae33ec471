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
from pathlib import Path

import pytest

from hpc_verl.launch.backends import rayjobs, rayjobs_api
from rayhead import free_ports, start_ray_head


@pytest.fixture(scope="module")
def head():
    h = start_ray_head(token_auth=True)
    try:
        yield h
    finally:
        h.stop()
    time.sleep(0.5)
    assert not h.leftovers(), f"Ray head processes left behind: {h.leftovers()}"


@pytest.fixture(scope="module")
def cluster(head):
    return rayjobs_api.connect(head.address, head.token_file, env={})


DRIVER = """\
import os, sys
import ray
import hpc_verl
ray.init()
@ray.remote
def square(x):
    return x * x
print("ENV", os.environ["NCCL_IB_HCA"], os.environ["NCCL_SOCKET_IFNAME"], os.environ["EXTRA"])
print("SQUARES", sum(ray.get([square.remote(i) for i in range(4)])))
print("HPC_VERL_FROM", os.path.dirname(hpc_verl.__file__))
import hpc_verl.data.preprocess  # the upload's /data/ default must not cut the shipped package
print("SAMPLE", os.path.exists(os.path.join(os.path.dirname(hpc_verl.__file__), "data/samples/gsm8k_sample.jsonl")))
print("ARGS", sys.argv[1:])
"""


def test_python_api_submit_with_profile_and_job_config(head, tmp_path, monkeypatch):
    """hpc_verl.submit(..., ray_address=...) -> handle; runtime_env from profile + job config."""
    import hpc_verl
    from hpc_verl.launch import registry

    monkeypatch.setenv("HPC_VERL_HOME", str(tmp_path / "home"))
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "driver.py").write_text(DRIVER)
    config = tmp_path / "job.yaml"
    config.write_text(
        "name: api-job\n"
        "trainer:\n  module: driver\n  overrides: {trainer.total_epochs: 1}\n"
        "ray_job:\n  working_dir: work\n  env_vars: {EXTRA: 'x y'}\n  ship_hpc_verl: true\n")
    handle = hpc_verl.submit("ib-a100", str(config), ["algorithm.gamma=0.9"], ray_address=head.address,
                             ray_token_file=str(head.token_file))
    assert isinstance(handle, hpc_verl.RayJobHandle)
    assert handle.state in {"PENDING", "RUNNING", "COMPLETED"}
    assert handle.wait(timeout_s=90) == "COMPLETED", handle.logs()
    logs = handle.logs()
    # the profile's NCCL block (launcher's env computation) and the job's own variable arrived
    assert "ENV mlx5_0,mlx5_1,mlx5_2,mlx5_3 ib0 x y" in logs
    assert "SQUARES 14" in logs  # the driver joined the token-protected cluster
    # hpc_verl reached the cluster as a py_module (the head has no PYTHONPATH to this checkout)
    shipped = logs.split("HPC_VERL_FROM ")[1].splitlines()[0]
    assert "runtime_resources" in shipped, shipped
    assert "SAMPLE True" in logs  # ... whole, its data/ package included
    args = logs.split("ARGS ")[1].splitlines()[0]
    # job overrides, command-line overrides, then the launcher's derived ones with concrete values
    assert "'trainer.total_epochs=1', 'algorithm.gamma=0.9', 'trainer.nnodes=2', " \
           "'trainer.n_gpus_per_node=8'" in args
    rec = registry.find(handle.submission_id)
    assert rec.scheduler == "rayjob" and rec.ray_address == head.address
    assert rec.token_file == str(head.token_file)
    # the token never travels in the job's visible runtime_env, nor in the job directory
    token = head.token_file.read_text().strip()
    assert token not in json.dumps(handle.cluster.info(handle.submission_id).runtime_env or {})
    assert not any(token in p.read_text() for p in Path(rec.job_dir).rglob("*.json"))


def test_failing_driver_reports_last_lines(cluster):
    driver = rayjobs.DriverSpec.for_command([
        "python3", "-c", "import sys; [print('line', i) for i in range(40)]; sys.exit(3)"])
    sid = cluster.submit(driver.entrypoint(), {}, submission_id=rayjobs.new_submission_id("bad"))
    handle = rayjobs_api.RayJobHandle(cluster.address, sid, cluster=cluster)
    with pytest.raises(rayjobs_api.RayJobFailedError) as err:
        handle.wait(timeout_s=60)
    msg = str(err.value)
    first = msg.splitlines()[0]
    assert "failed (exit code 3)" in first and f"hpc-verl logs {sid}" in first
    assert "line 39" in msg and "line 5\n" not in msg  # only the last lines
    assert handle.state == "FAILED"


def test_unreachable_address_is_one_line():
    (port,) = free_ports(1)
    with pytest.raises(rayjobs_api.RayUnreachableError) as err:
        rayjobs_api.connect(f"127.0.0.1:{port}", None, env={}, timeout_s=3)
    msg = str(err.value)
    assert "\n" not in msg and f"http://127.0.0.1:{port}" in msg and "connection refused" in msg


def test_gcs_port_is_not_the_jobs_api(head):
    with pytest.raises(rayjobs_api.RayUnreachableError, match="does not speak HTTP|not a Ray"):
        rayjobs_api.connect(head.gcs_address, head.token_file, env={}, timeout_s=5)


def test_missing_and_wrong_token(head, tmp_path):
    with pytest.raises(rayjobs_api.RayAuthError, match="requires an auth token and none was sent"):
        rayjobs_api.connect(head.address, None, env={"HOME": str(tmp_path)})
    bad = tmp_path / "bad_token"
    bad.write_text("not-the-token\n")
    with pytest.raises(rayjobs_api.RayAuthError) as err:
        rayjobs_api.connect(head.address, bad, env={})
    assert "rejected the auth token from " + str(bad) in str(err.value)
    assert "not-the-token" not in str(err.value)
    with pytest.raises(rayjobs_api.RayAuthError, match="does not exist"):
        rayjobs_api.connect(head.address, tmp_path / "nope", env={})
    # Ray's own variable works too
    assert rayjobs_api.connect(head.address, None,
                           env={"RAY_AUTH_TOKEN_PATH": str(head.token_file)}).cluster_version


def test_ray_address_env_does_not_override_explicit_address(head, monkeypatch):
    (port,) = free_ports(1)
    monkeypatch.setenv("RAY_ADDRESS", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", f"http://127.0.0.1:{port}")
    c = rayjobs_api.connect(head.address, head.token_file, env={})
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
        with pytest.raises(rayjobs_api.RayVersionError) as err:
            rayjobs_api.connect(f"127.0.0.1:{server.server_address[1]}", None, env={})
    finally:
        server.shutdown()
    msg = str(err.value)
    import ray
    assert f"client {ray.__version__}, cluster 2.30.0" in msg and ">= 2.40" in msg


def test_address_and_driver_validation():
    assert rayjobs_api.normalize_address("head:8265/") == "http://head:8265"
    with pytest.raises(rayjobs_api.RayJobsError, match="ray://"):
        rayjobs_api.normalize_address("ray://head:10001")
    assert rayjobs.DriverSpec.for_trainer("verl", ["trainer.nnodes=2"]).argv == [
        "python3", "-m", "verl.trainer.main_ppo", "trainer.nnodes=2"]
    with pytest.raises(rayjobs_api.RayJobsError, match="unknown trainer 'verll'"):
        rayjobs.DriverSpec.for_trainer("verll")
    assert rayjobs.DriverSpec.for_command(["bash", "-c", "echo $HOME; rm -rf /"]).entrypoint() == \
        "bash -c 'echo $HOME; rm -rf /'"
    assert rayjobs_api.state_of("STOPPED") == "CANCELLED"
    with pytest.raises(rayjobs_api.RayJobsError, match="does not exist"):
        rayjobs.build_runtime_env(working_dir="no/such/dir")


# --------------------------------------------------------------------------- registry-level glue

def test_backend_dry_run_and_options_validation(tmp_path, monkeypatch):
    """A dry run checks and writes what would be sent (ray_job.json), and connects to nothing."""
    from hpc_verl.errors import ConfigError
    from hpc_verl.launch import backends
    from hpc_verl.launch.spec.jobconfig import RayJobOptions

    monkeypatch.setenv("HPC_VERL_HOME", str(tmp_path / "home"))
    (port,) = free_ports(1)  # nothing listens: a dry run must not connect
    request = backends.SubmitRequest(ray_address=f"127.0.0.1:{port}", name="dry",
                                     overrides=("trainer.total_epochs=1",))
    backend = backends.for_request(request)
    assert backend.scheduler == "rayjob"
    dry = backend.dryrun(request)
    saved = json.loads((Path(dry.record.job_dir) / "ray_job.json").read_text())
    assert saved["entrypoint"].startswith("python3 -m hpc_verl.trainer.main trainer.total_epochs=1 ")
    assert saved["runtime_env"]["py_modules"] == [rayjobs.hpc_verl_package_dir()]  # built-in ships itself
    assert dry.record.dry_run and backend.list_state(dry.record) == "DRY-RUN"
    assert f"request: {dry.record.job_dir}/ray_job.json" in str(dry)
    with pytest.raises(ConfigError, match="unknown key 'working_dri'.*did you mean 'working_dir'"):
        RayJobOptions.from_mapping({"working_dri": "."})
    with pytest.raises(ConfigError, match="ray_job.pip must be a list"):
        RayJobOptions.from_mapping({"pip": "numpy"})


# --------------------------------------------------------------------------- the CLI, as a user runs it

@pytest.fixture
def cli_env(tmp_path):
    """Own registry; HOME without ~/.ray/auth_token (another tool may have made one on this machine)."""
    (tmp_path / "home").mkdir()
    return {"HPC_VERL_HOME": str(tmp_path / "registry"), "HOME": str(tmp_path / "home")}


def _submit(cli, head, env, tmp_path, name, code, *extra):
    config = tmp_path / f"{name}.yaml"
    config.write_text(json.dumps({"name": name, "trainer": {"module": "x", "derive_overrides": False},
                                  "ray_job": {"command": ["python3", "-u", "-c", code]}}))
    res = cli("submit", "--ray-address", head.address, "--ray-token-file", str(head.token_file),
              "--config", str(config), *extra, env=env)
    assert res.returncode == 0, res.stderr
    return res.stdout.split("submitted Ray job ")[1].split()[0]


def test_cli_submit_status_logs_list_success(cli, head, cli_env, tmp_path):
    sid = _submit(cli, head, cli_env, tmp_path, "cli-ok",
                  "import sys; print('hello from the driver', sys.argv[1:])", "trainer.total_epochs=3")
    rayjobs_api.RayJobHandle(head.address, sid, str(head.token_file)).wait(timeout_s=90)
    res = cli("status", sid, "--json", env=cli_env)
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert st["state"] == "COMPLETED" and st["kind"] == "rayjob" and st["ray_address"] == head.address
    res = cli("logs", sid, env=cli_env)
    assert res.returncode == 0 and "hello from the driver ['trainer.total_epochs=3']" in res.stdout
    res = cli("list", env=cli_env)
    assert res.returncode == 0 and sid[:20] in res.stdout and "COMPLETED" in res.stdout


def test_cli_failed_job_shows_last_lines(cli, head, cli_env, tmp_path):
    sid = _submit(cli, head, cli_env, tmp_path, "cli-bad",
                  "[print('step', i) for i in range(30)]; raise SystemExit(5)")
    res = cli("logs", sid, "--follow", env=cli_env)
    assert res.returncode == 1 and "step 29" in res.stdout
    assert f"job {sid} FAILED" in res.stderr
    res = cli("status", sid, env=cli_env)
    assert res.returncode == 0
    assert "FAILED" in res.stdout and "step 29" in res.stdout and "driver_exit_code 5" in res.stdout


def test_cli_cancel(cli, head, cli_env, tmp_path, monkeypatch):
    from hpc_verl.launch import backends, registry

    monkeypatch.setenv("HPC_VERL_HOME", cli_env["HPC_VERL_HOME"])  # the registry the CLI reads
    cluster = rayjobs_api.connect(head.address, head.token_file, env={})
    driver = rayjobs.DriverSpec.for_command(["python3", "-u", "-c",
                                             "import time; print('started'); time.sleep(300)"])
    sid = cluster.submit(driver.entrypoint(), {}, submission_id=rayjobs.new_submission_id("cli-long"))
    handle = rayjobs_api.RayJobHandle(head.address, sid, cluster=cluster)
    job_dir = registry.new_job_dir("cli-long")
    registry.JobRecord(name="cli-long", job_dir=str(job_dir), profile="-", scheduler="rayjob",
                       submission_id=sid, ray_address=head.address, token_file=str(head.token_file)).save()
    deadline = time.monotonic() + 60
    while "started" not in handle.logs():
        assert time.monotonic() < deadline, handle.logs()
        time.sleep(0.3)
    res = cli("cancel", sid, env=cli_env)
    assert res.returncode == 0 and "stop requested" in res.stdout, res.stderr
    assert handle.wait(timeout_s=60, check=False) == "CANCELLED"
    rec = registry.find(sid)
    assert backends.for_record(rec).describe(rec).state is backends.JobState.CANCELLED
    res = cli("cancel", sid, env=cli_env)
    assert res.returncode == 0 and "already ended (CANCELLED)" in res.stdout


def _one_line_exit_2(res):
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def test_cli_wrong_token_and_unreachable_are_one_line(cli, head, cli_env, tmp_path):
    bad = tmp_path / "bad.token"
    bad.write_text("0" * 64)
    line = _one_line_exit_2(cli("submit", "--ray-address", head.address, "--ray-token-file", str(bad),
                                env=cli_env))
    assert "rejected the auth token" in line and str(bad) in line and "--ray-token-file" in line
    (port,) = free_ports(1)
    line = _one_line_exit_2(cli("submit", "--ray-address", f"http://127.0.0.1:{port}",
                                "--ray-token-file", str(head.token_file), env=cli_env))
    assert "cannot reach the Ray Jobs API" in line and str(port) in line
    # failed submissions leave nothing in the registry
    assert not list((tmp_path / "registry").glob("jobs/*"))


# --------------------------------------------------------------------------- the upload guard (issue 13, item 4)

LIST_FILES = ("import os; print('FILES', sorted(os.path.relpath(os.path.join(d, f)) "
              "for d, _, fs in os.walk('.') for f in fs))")


def _work_dir(tmp_path, name, big: str) -> tuple[Path, Path]:
    """A working_dir with the driver and one 200 MiB sparse file at ``big``; its job config."""
    work = tmp_path / name
    (work / big).parent.mkdir(parents=True, exist_ok=True)
    (work / "main.py").write_text(LIST_FILES + "\n")
    with open(work / big, "wb") as fh:
        fh.truncate(200 * 1024 * 1024)  # sparse: 200 MiB to Ray's zip, nothing on disk
    config = tmp_path / f"{name}.yaml"
    config.write_text(json.dumps({"name": name, "trainer": {"module": "x", "derive_overrides": False},
                                  "ray_job": {"command": ["python3", "main.py"], "working_dir": str(work)}}))
    return work, config


def _package_uri(work: Path) -> str:
    """The GCS package Ray would make of ``work`` (its URI is a hash of what it holds)."""
    from ray._private.runtime_env.packaging import get_uri_for_directory

    from hpc_verl.launch.backends import upload
    return get_uri_for_directory(str(work), True, excludes=upload.excludes_for([], []))


def test_cli_working_dir_with_weights_submits_after_exclusion(cli, head, cli_env, tmp_path, cluster):
    work, config = _work_dir(tmp_path, "weights", "model.safetensors")
    args = ("submit", "--ray-address", head.address, "--ray-token-file", str(head.token_file), "--config", str(config))
    res = cli(*args, "--dry-run", env=cli_env)
    assert res.returncode == 0 and "upload    working_dir 0.0 MiB (1 file)" in res.stdout, res.stderr
    res = cli(*args, env=cli_env)
    assert res.returncode == 0, res.stderr
    sid = res.stdout.split("submitted Ray job ")[1].split()[0]
    assert rayjobs_api.RayJobHandle(head.address, sid, str(head.token_file)).wait(timeout_s=90) == "COMPLETED"
    logs = cli("logs", sid, env=cli_env).stdout
    assert "FILES ['main.py']" in logs  # the driver's working_dir: the weights stayed home
    assert cluster.client._package_exists(_package_uri(work))


def test_cli_oversize_working_dir_is_one_line_and_nothing_is_uploaded(cli, head, cli_env, tmp_path, cluster):
    work, config = _work_dir(tmp_path, "corpus", "corpus/shard.txt")
    jobs_before = len(cluster.client.list_jobs())
    line = _one_line_exit_2(cli("submit", "--ray-address", head.address, "--ray-token-file", str(head.token_file),
                                "--config", str(config), env=cli_env))
    assert f"ray_job.working_dir {work} would upload 200.0 MiB (2 files), over Ray's 100.0 MiB upload limit" in line
    assert "biggest: corpus/ 200.0 MiB" in line and "ray_job.excludes" in line and "['/corpus/']" in line
    assert len(cluster.client.list_jobs()) == jobs_before
    assert not cluster.client._package_exists(_package_uri(work))  # no package of it reached the cluster
    assert not list((tmp_path / "registry").glob("jobs/*"))


def test_hold_stage_renders_in_place_of_train(tmp_path):
    """cluster up renders the launcher's sbatch template with the hold stage: no trainer, the
    dashboard reachable from login nodes, and no new bash -n / shellcheck findings."""
    import shutil
    import subprocess

    from hpc_verl.launch.spec.render import render_sbatch
    from hpc_verl.profiles import load_profile

    profile = load_profile("ib-a100", ["ray.dashboard=true", "slurm.requeue=false"])
    held, normal = render_sbatch(profile, hold=True), render_sbatch(profile)
    assert "hpc_verl.launch.hold --job-dir" in held and "hpcv_stage train" not in held
    assert "\nhpcv_hold\n" in held and "hold -> collect" in held
    assert "--dashboard-host 0.0.0.0" in held and "--dashboard-host" not in normal
    assert "hpcv_stage train hpcv_train" in normal and "hpc_verl.launch.hold" not in normal

    def findings(text: str) -> set[str]:
        path = tmp_path / "s.sh"
        path.write_text(text)
        assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
        if not shutil.which("shellcheck"):
            pytest.skip("shellcheck not installed (scripts/setup.sh installs it)")
        out = subprocess.run(["shellcheck", "-f", "gcc", "--shell=bash", str(path)],
                             capture_output=True, text=True).stdout
        return {line.split(": ", 1)[1] for line in out.splitlines() if ": " in line}

    assert findings(held) <= findings(normal)
