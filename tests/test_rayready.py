"""The Ray readiness record between the bootstrap's barrier (writer) and a trainer started before
Ray was up (reader): the reader sees the whole record or none, waits bounded, and stops when asked."""
from __future__ import annotations

import threading
import time

import pytest

from hpc_verl.errors import BootstrapError
from hpc_verl.util.rayready import wait_ready, write_ready


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
