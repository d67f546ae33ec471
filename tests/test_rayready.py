"""The Ray readiness record between the bootstrap's barrier (writer) and a trainer started before
Ray was up (reader): the reader sees the whole record or none, waits bounded, and stops when asked."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpc_verl.errors import BootstrapError
from hpc_verl.util.rayready import wait_ready, write_ready

REPO = Path(__file__).resolve().parents[1]


def test_a_waiting_reader_gets_the_record_once_it_is_written(tmp_path):
    path = tmp_path / "ray" / "ready.json"
    path.parent.mkdir()
    env = {"RAY_ADDRESS": "10.0.0.1:6380", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": "/x/token"}
    writer = threading.Timer(0.3, write_ready, args=(path, env))
    t0 = time.monotonic()
    writer.start()
    try:
        assert wait_ready(path, timeout_s=10, poll_s=0.02) == env
    finally:
        writer.join()
    assert 0.25 < time.monotonic() - t0 < 5
    assert [p.name for p in path.parent.iterdir()] == ["ready.json"]   # temp file + rename: nothing else left


def test_no_record_is_one_line_after_the_timeout(tmp_path):
    with pytest.raises(BootstrapError) as exc:
        wait_ready(tmp_path / "ready.json", timeout_s=0.2, poll_s=0.02)
    msg = str(exc.value)
    assert "\n" not in msg and "not ready within 0.2s" in msg and "ready.json never appeared" in msg


def test_a_stop_ends_the_wait_with_nothing(tmp_path):
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    assert wait_ready(tmp_path / "ready.json", timeout_s=30, poll_s=0.02, stop=stop) is None
    assert time.monotonic() - t0 < 5


def test_a_record_that_is_not_json_is_one_line(tmp_path):
    path = tmp_path / "ready.json"
    path.write_text("export RAY_ADDRESS=x\n")
    with pytest.raises(BootstrapError, match="cannot be read"):
        wait_ready(path, timeout_s=1)


def test_the_token_variables_are_one_rule_for_the_barrier_and_an_early_trainer(tmp_path):
    from hpc_verl.bootstrap.raydir import ray_dir, ray_env, token_path
    from hpc_verl.util.rayready import auth_env
    early = auth_env(ray_dir(tmp_path))
    assert early == {k: v for k, v in ray_env(tmp_path).items() if k in early}
    assert early["RAY_AUTH_TOKEN_PATH"] == str(token_path(tmp_path))


def _early_trainer(code: str, ready_file: Path, timeout_s: float) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, as a trainer the job script started before Ray was up."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({"HPC_VERL_RAY_READY_FILE": str(ready_file), "HPC_VERL_RAY_READY_TIMEOUT_S": str(timeout_s),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


EARLY = """
import os, sys
from hpc_verl.errors import BootstrapError
from hpc_verl.trainer.driver.ray_runner import DataflowRunner
assert "ray" not in sys.modules
try:
    DataflowRunner()._connect({"hpc_verl": {"ray_address": None}})
except BootstrapError as exc:
    print("error:", exc)
print("ray imported:", "ray" in sys.modules, os.environ["RAY_AUTH_TOKEN_PATH"])
"""


@pytest.mark.parametrize("record", [None, "other-token"])
def test_an_early_trainer_imports_ray_before_the_record_and_checks_its_token(tmp_path, record):
    # Ray reads RAY_AUTH_* when it is imported: the trainer sets them from the job's ray dir and
    # imports Ray while the cluster is still starting; a record naming another token is refused
    import json
    rdir = tmp_path / "ray"
    rdir.mkdir()
    if record:
        (rdir / "ready.json").write_text(json.dumps({"RAY_ADDRESS": "127.0.0.1:1", "RAY_AUTH_MODE": "token",
                                                     "RAY_AUTH_TOKEN_PATH": str(tmp_path / record)}))
    out = _early_trainer(EARLY, rdir / "ready.json", timeout_s=0.3)
    assert out.returncode == 0, out.stderr[-2000:]
    error, imported = out.stdout.strip().splitlines()
    assert imported == f"ray imported: True {rdir / 'token'}"
    if record:
        assert "names other token settings (RAY_AUTH_TOKEN_PATH)" in error and "\n" not in error
    else:
        assert "never appeared" in error


BEGIN = """
import sys, threading, time
from hpc_verl.trainer.driver.ray_runner import DataflowRunner
assert "ray" not in sys.modules
runner = DataflowRunner()
runner.begin({"hpc_verl": {"ray_address": None}})
waiting = [t.name for t in threading.enumerate() if t.name == "hpc-verl-ray-up"]
print("after begin:", "ray" in sys.modules, "hpc_verl.dataflow" in sys.modules, waiting)
t0 = time.monotonic()
runner.shutdown()
print("shutdown within 5 s:", time.monotonic() - t0 < 5)
"""


def test_begin_returns_once_ray_is_imported_and_the_connect_thread_waits_on(tmp_path):
    # the driver imports torch and transformers after begin(): two threads importing at once can
    # trip CPython's import deadlock detector (gh-83065), so Ray's import is done by then, while
    # the wait for the cluster goes on in the thread
    out = _early_trainer(BEGIN, tmp_path / "ready.json", timeout_s=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["after begin: True True ['hpc-verl-ray-up']", "shutdown within 5 s: True"]
