"""A killed ``hpc-verl train`` driver takes its whole private Ray with it within seconds.

The driver of a run without a Ray address starts a private Ray through a head process
(hpc_verl.trainer.driver.private_ray) that holds a pipe from the driver. Here a real run of
examples/ppo_digits_tiny.yaml is SIGKILLed mid-training, and within 5 s nothing of it may
be left: no process in any session or process group the run had (sampled while it ran), none
whose environment or command line carries the run's unique marker or names its private Ray's
temp dir, and no TCP port its processes listened on before the kill. Ray's agents (which
used to outlive a killed driver by a minute, retrying a GCS that was gone) are checked to have
been there before the kill, so the test can fail.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from slurm_bed import _listen_inodes  # noqa: E402
from test_faults import Tree, _env, _stat  # noqa: E402
from trainer_fixtures import digits_data, tiny_model  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
MARK_ENV = "HPCV_TEST_RUN_MARK"
BOUND_S = 5.0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _carries(pid: int, needles: list[bytes]) -> bool:
    """Whether the process's command line or environment names one of ``needles``, or it holds a
    file under one of them open."""
    for name in ("cmdline", "environ"):
        try:
            data = Path(f"/proc/{pid}/{name}").read_bytes()
        except OSError:
            continue
        if any(n in data for n in needles):
            return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}").encode()
        except OSError:
            continue
        if any(target.startswith(n) for n in needles if n.startswith(b"/")):
            return True
    return False


def _marked(needles: list[bytes]) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            st = _stat(int(d.name))
            if st is not None and st[0] != "Z" and _carries(int(d.name), needles):
                out.append(int(d.name))
    return out


def _ports_of(pids: list[int]) -> set[int]:
    inodes = _listen_inodes()
    ports = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                ports.add(inodes[target[8:-1]])
    return ports


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_driver_leaves_no_process_and_no_port(tmp_path, tiny_model, digits_data):
    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    (work / "data").mkdir()
    (work / "models" / "tiny").symlink_to(tiny_model)
    (work / "data" / "digits").symlink_to(digits_data)
    run = tmp_path / "run"
    mark = f"hpcv-driver-death-{uuid.uuid4().hex}"
    log = tmp_path / "train.log"
    cmd = [sys.executable, "-m", "hpc_verl", "train", "--no-progress", "--config",
           str(REPO / "examples" / "ppo_digits_tiny.yaml"), "trainer.total_training_steps=2000",
           "trainer.save_freq=0", f"hpc_verl.run_dir={run}"]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=work, env=_env(tmp_path / "home", **{MARK_ENV: mark}), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    tree = Tree(proc.pid)
    needles = [mark.encode()]
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, f"the run ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no training step within 180 s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        temps = list(Path("/tmp").glob(f"hpcv-train-{proc.pid}-*"))
        assert len(temps) == 1, f"the run's private Ray temp dir: {temps}"
        needles.append(str(temps[0]).encode())
        tree.sample()
        before = sorted(set(tree.pids) | set(_marked(needles)))
        names = " | ".join(_cmdline(p) for p in before)
        assert "ray::DashboardAgent" in names and "raylet" in names, names   # what used to outlive the driver
        ports = _ports_of(before)
        assert ports, "the run's processes listened on no port"

        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=10)
        while True:
            tree._stop.set()   # (no sampling after the kill: the pids recorded are the run's)
            alive = [p for p in before if _stat(p) is not None and _stat(p)[0] != "Z"]
            left = sorted(set(alive) | set(_marked(needles)))
            listening = sorted(ports & set(_listen_inodes().values()))
            took = time.monotonic() - t0
            if (not left and not listening) or took > BOUND_S:
                break
            time.sleep(0.05)
        # every session and process group the run had, too (Tree.left scans them all)
        left_by_group = tree.left()
        assert not left and not left_by_group, (f"{took:.1f}s after the kill, processes of the run are left:\n"
                                                + "\n".join(f"{p}: {_cmdline(p)[:120]}" for p in left)
                                                + "\n" + "\n".join(left_by_group))
        assert not listening, f"{took:.1f}s after the kill, ports of the run still listen: {listening}"
        print(f"nothing of the run left {took:.2f}s after SIGKILL to its driver "
              f"({len(before)} processes, {len(ports)} listening ports)")
        assert not temps[0].exists(), "the private Ray's temp dir was left behind"
        assert list((run / "logs" / "ray").glob("raylet*")), "Ray's logs were not kept in the run dir"
    finally:
        for line in tree.left():
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        for pid in _marked(needles):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
