"""Fault injection: every fault ends cleanly, with one line that names the cause (issue 14).

Each test injects one real fault into a real run, ``hpc-verl submit --profile local`` (the
rendered script, the bootstrap, Ray and the built-in trainer) or ``hpc-verl train``, and checks:

- the exit status, and the one line that names the cause;
- the state ``hpc-verl list`` / ``status`` show;
- that nothing is left: no live process in any process group or session the run had (sampled
  every 0.2 s while it ran, so Ray's daemons and agents are in it), no port of its Ray block
  listening, no Ray temp dir, no ``.tmp_*`` checkpoint directory (checked by listing the dirs).

Faults: SIGHUP and SIGTERM to a foreground submit, cancel, SIGUSR2 (preemption) and a rerun,
a SIGKILLed raylet, a read-only and a full file system (tmpfs in a private mount namespace,
``unshare -m``; skipped where that is not allowed), a SIGKILL during a checkpoint save, a
truncated or overwritten checkpoint, a parquet without ``reward_model``, two jobs on one port
block, and a closed stdout pipe. Nothing is simulated: the signals, mounts and damage are real.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("torch")

from slurm_bed import _listen_inodes  # noqa: E402
from trainer_fixtures import digit_overrides, digits_data, tiny_model  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[1]
RAY_TEMP_ROOT = Path("/tmp/hpcv-ray")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


# ---------------------------------------------------------------------------- what a run leaves behind
def _stat(pid: int) -> tuple[str, int, int, str] | None:
    """(state, process group, session, start time) of a live pid."""
    try:
        rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return rest[0], int(rest[2]), int(rest[3]), rest[19]


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(Path(d, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            out.setdefault(ppid, []).append(int(d.name))
    return out


class Tree:
    """Every pid (with its start time), process group and session seen under the roots of a run,
    sampled in a thread while it runs; :meth:`left` lists what of them still lives."""

    def __init__(self, *roots: int) -> None:
        self.roots = list(roots)
        self.pids: dict[int, str] = {}
        self.groups: set[int] = set()
        self.sessions: set[int] = set()
        self._ours = {os.getpgrp(), os.getsid(0)}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def add(self, pid: int) -> None:
        if pid not in self.roots:
            self.roots.append(pid)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(0.2)

    def sample(self) -> None:
        kids = _children()
        todo = list(self.roots)
        while todo:
            pid = todo.pop()
            st = _stat(pid)
            if st is None or st[0] == "Z":
                continue
            self.pids[pid] = st[3]
            self.groups.add(st[1])
            self.sessions.add(st[2])
            todo.extend(kids.get(pid, []))

    def holds(self, pid: int, st: tuple[str, int, int, str] | None = None) -> bool:
        """Whether ``pid`` (alive now; ``st``: its :func:`_stat`, read here if not given) is a process of the
        run: seen under its roots with the same start time, or in one of its process groups or sessions."""
        st = st or _stat(pid)
        if st is None:
            return False
        return self.pids.get(pid) == st[3] or st[1] in self.groups - self._ours or st[2] in self.sessions - self._ours

    def left(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=5)
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            st = _stat(int(d.name))
            if st is None or st[0] == "Z":
                continue
            if self.holds(int(d.name), st):
                try:
                    cmd = Path(d, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
                except OSError:
                    cmd = "?"
                out.append(f"{d.name} (pgid {st[1]}, sid {st[2]}): {cmd}")
        return out


def _socket_holders() -> dict[str, int]:
    """Socket inode -> a pid holding it open (every process here, containers' included, as root)."""
    holders: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for fd in (d / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    holders.setdefault(link[8:-1], int(d.name))
        except OSError:  # the process ended, or its fds are not ours to read
            continue
    return holders


def _held_by_the_job(tree: Tree, ports: range) -> list[str]:
    """Listening ports of ``ports`` that a process of the job holds, or that no live process can be
    found for. Ports freed by the job may be taken at once by another job of the suite (its port
    block is drawn from the same range): a listener that is a live process outside the job's tree
    is that other job, not a leftover."""
    holders = _socket_holders()
    found = []
    for inode, port in _listen_inodes().items():
        if port in ports:
            pid = holders.get(inode)
            if pid is None or tree.holds(pid):
                found.append(f"{port} (pid {pid if pid is not None else 'unknown'})")
    return sorted(found)


def _leftover_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".*") if p.name.startswith((".tmp_", ".old_"))) if root.exists() else []


def assert_job_left_nothing(tree: Tree, rec: dict) -> None:
    """No process, port, Ray temp dir or partial checkpoint of the local job ``rec``."""
    assert not tree.left(), "processes of the job were left behind:\n" + "\n".join(tree.left())
    run = Path(rec["run_dir"])
    for state in (run / "ray" / "nodes").glob("*.json"):
        ports = json.loads(state.read_text()).get("ports") or {}
        if ports:
            block = range(ports["block_start"], ports["max_worker"] + 1)
            held = _held_by_the_job(tree, block)
            if held:  # a listener seen as its holder exits: look once more
                time.sleep(1)
                held = _held_by_the_job(tree, block)
            assert not held, f"ports of the job's block still listen: {held}"
    assert not (RAY_TEMP_ROOT / str(rec["job_id"])).exists(), "the job's Ray temp dir was left behind"
    assert not _leftover_dirs(run / "checkpoints"), _leftover_dirs(run / "checkpoints")


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               HPC_VERL_HOME=str(home), **extra)
    env.pop("RAY_ADDRESS", None)
    return env


def _cli(home: Path, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpc_verl", *args], env=_env(home), capture_output=True,
                          text=True, timeout=timeout, **kw)


def _wait(cond, timeout_s: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc is not None and proc.poll() is not None and not cond():
            pytest.fail(f"{what}: the run exited early ({proc.returncode}):\n"
                        f"{log.read_text()[-3000:] if log and log.exists() else ''}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}:\n{log.read_text()[-3000:] if log and log.exists() else ''}")


def _hpcv_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("hpc-verl:")]


# ---------------------------------------------------------------------------- local jobs
class LocalJob:
    """``hpc-verl submit --profile local`` in a session of its own, its output in files."""

    def __init__(self, tmp: Path, model: Path, *args: str, detach: bool = False, home: Path | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.home = home or tmp / "home"
        self.wd = tmp / "work"
        if not self.wd.exists():
            (self.wd / "models").mkdir(parents=True)
            (self.wd / "models" / "tiny").symlink_to(model)
        self.out, self.err = tmp / f"submit-{time.monotonic_ns()}.out", tmp / f"submit-{time.monotonic_ns()}.err"
        cmd = [sys.executable, "-m", "hpc_verl", "submit", *(["--detach"] if detach else []), *args]
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=self.wd, env=_env(self.home, **(env or {})), stdout=out,
                                         stderr=err, start_new_session=True)
        self.tree = Tree(self.proc.pid)
        self._dir: Path | None = None

    @property
    def job_dir(self) -> Path:
        if self._dir is None:
            jobs = self.home / "jobs"
            self._dir = _wait(lambda: next((d for d in sorted(jobs.glob("*")) if (d / "job.json").exists()), None)
                              if jobs.exists() else None, 120, "the job's record", self.proc, self.err)
        return self._dir

    def rec(self) -> dict:
        return json.loads((self.job_dir / "job.json").read_text())

    def log(self) -> Path:
        return self.job_dir / "job.log"

    def started(self, timeout_s: float = 120) -> dict:
        """The record once the supervisor runs the script (its tree is then watched too)."""
        rec = _wait(lambda: (lambda r: r if r.get("supervisor_pid") and r.get("pid") else None)(self.rec()),
                    timeout_s, "the job to start", self.proc, self.err)
        self.tree.add(rec["supervisor_pid"])
        self.tree.sample()
        return rec

    def training(self, rows: int = 1, timeout_s: float = 300) -> None:
        metrics = Path(self.rec()["run_dir"]) / "checkpoints" / "metrics.jsonl"
        _wait(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= rows, timeout_s,
              f"{rows} training step(s)", None, self.log())

    def ended(self, timeout_s: float) -> dict:
        """The record once the end is recorded and the supervisor is gone."""
        def done() -> dict | None:
            r = self.rec()
            return r if r.get("exit_code") is not None and _stat(r["supervisor_pid"]) in (None,) else None
        return _wait(done, timeout_s, "the job's end", None, self.log())

    def status(self) -> dict:
        res = _cli(self.home, "status", str(self.rec()["job_id"]), "--json")
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    def listed_state(self) -> str:
        res = _cli(self.home, "list")
        row = next(ln for ln in res.stdout.splitlines() if str(self.rec()["job_id"]) in ln)
        return row.split("│")[4].strip()


@pytest.fixture
def kill_leftovers():
    """Whatever a failed test leaves running is killed by process group and session, then its dirs go."""
    trees: list[Tree] = []
    yield trees.append
    for tree in trees:
        for line in tree.left():
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def _local(tmp_path, tiny_model, kill_leftovers, *args, **kw) -> LocalJob:
    job = LocalJob(tmp_path, tiny_model, "--profile", "local", *args, **kw)
    kill_leftovers(job.tree)
    return job


LONG = ("trainer.total_training_steps=2000", "trainer.save_freq=0")


@pytest.mark.parametrize("sig,phase", [(signal.SIGHUP, "training"), (signal.SIGTERM, "ray-up")],
                         ids=["SIGHUP-while-training", "SIGTERM-during-ray-up"])
def test_stop_signal_to_a_foreground_submit_cancels_the_job(tmp_path, tiny_model, kill_leftovers, sig, phase):
    """Fault 1: a closed ssh session (SIGHUP) or a CI timeout (SIGTERM) stops the job in seconds."""
    job = _local(tmp_path, tiny_model, kill_leftovers, *LONG)
    job.started()
    if phase == "training":
        job.training()
    else:
        _wait(lambda: "ray-up: head" in job.log().read_text(), 120, "Ray's bring-up", job.proc, job.log())
    t0 = time.monotonic()
    os.kill(job.proc.pid, sig)
    rc = job.proc.wait(timeout=60)
    took = time.monotonic() - t0
    name = signal.Signals(sig).name
    assert took < 15, f"the job took {took:.1f}s to stop"
    assert rc == 128 + sig, job.err.read_text()
    lines = _hpcv_lines(job.err.read_text())
    assert len(lines) == 1 and f"got {name}: stopping local job {job.rec()['job_id']}" in lines[0], lines
    assert "Traceback" not in job.err.read_text() + job.out.read_text()
    st = job.status()
    assert (st["state"], st["exit_code"], st["reason"]) == ("CANCELLED", str(128 + sig), f"{name} to hpc-verl submit")
    assert job.listed_state() == "CANCELLED"
    assert_job_left_nothing(job.tree, job.rec())


def test_cancel_a_detached_job_then_its_status_in_a_closed_pipe(tmp_path, tiny_model, kill_leftovers):
    """Fault 2: ``cancel`` ends everything of the job (Ray's agents too) and says so in one line;
    small: ``status`` into a pipe whose reader is gone prints no traceback."""
    job = _local(tmp_path, tiny_model, kill_leftovers, *LONG, detach=True)
    assert job.proc.wait(timeout=120) == 0, job.err.read_text()
    rec = job.started()
    job.training()
    assert job.status()["state"] == "RUNNING"
    t0 = time.monotonic()
    res = _cli(job.home, "cancel", str(rec["job_id"]))
    took = time.monotonic() - t0
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert res.stdout.strip() == f"cancelled job {rec['job_id']}: CANCELLED, exit status 143", res.stdout
    assert took < 15, f"cancel took {took:.1f}s"
    st = job.status()
    assert (st["state"], st["reason"]) == ("CANCELLED", "hpc-verl cancel")
    assert job.listed_state() == "CANCELLED"
    assert "cleanup" in _cli(job.home, "logs", str(rec["job_id"]), "--follow", timeout=30).stdout  # --follow ends
    assert_job_left_nothing(job.tree, job.rec())
    # `hpc-verl status JOB | head`: the reader is gone before we write
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as w:
        res = subprocess.run([sys.executable, "-m", "hpc_verl", "status", str(rec["job_id"])], env=_env(job.home),
                             stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    assert res.returncode == 128 + signal.SIGPIPE and res.stderr == "", res.stderr


def test_a_preempted_local_job_is_preempted_and_a_rerun_continues_at_its_checkpoint(tmp_path, tiny_model,
                                                                                     kill_leftovers):
    """Fault 3: SIGUSR2 (the preemption signal) checkpoints and ends PREEMPTED; ``submit --resume``
    runs the job again in the same run directory from that step, skipping finished stages."""
    job = _local(tmp_path, tiny_model, kill_leftovers, "trainer.total_training_steps=16", "trainer.save_freq=0",
                 detach=True)
    assert job.proc.wait(timeout=120) == 0, job.err.read_text()
    rec = job.started()
    job.training(rows=2)
    os.kill(rec["pid"], signal.SIGUSR2)
    end = job.ended(90)
    ckpt = Path(rec["run_dir"]) / "checkpoints"
    step = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    assert end["exit_code"] == 99 and 2 <= step < 16, job.log().read_text()[-2000:]
    st = job.status()
    assert st["state"] == "PREEMPTED" and f"checkpointed at step {step}" in st["reason"], st
    assert f"--resume {rec['job_id']}" in st["reason"]
    assert job.listed_state() == "PREEMPTED"
    assert_job_left_nothing(job.tree, job.rec())

    again = LocalJob(tmp_path, tiny_model, "--resume", str(rec["job_id"]), home=job.home)
    again._dir = job.job_dir
    kill_leftovers(again.tree)
    assert again.proc.wait(timeout=400) == 0, again.err.read_text()[-2000:] + again.out.read_text()[-3000:]
    out = again.out.read_text()
    assert "stage preprocess: done in an earlier run of this job, skipping" in out
    assert f"local job {rec['job_id']} (local-demo): COMPLETED, exit status 0" in out
    rows = [json.loads(x) for x in (ckpt / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r["run/start_step"] == step]
    assert resumed and resumed[0]["step"] == step + 1, "the rerun did not continue at the checkpoint's step"
    assert [r["step"] for r in rows] == list(range(1, 17))
    assert again.rec()["run_dir"] == rec["run_dir"] and again.status()["state"] == "COMPLETED"
    assert_job_left_nothing(again.tree, again.rec())


def test_a_killed_raylet_ends_the_job_with_its_diagnosis(tmp_path, tiny_model, kill_leftovers):
    """Fault 4: the bootstrap's diagnosis, within seconds, not Ray's minute of GCS retries."""
    job = _local(tmp_path, tiny_model, kill_leftovers, *LONG, detach=True)
    assert job.proc.wait(timeout=120) == 0, job.err.read_text()
    rec = job.started()
    job.training()
    node = json.loads(next((Path(rec["run_dir"]) / "ray" / "nodes").glob("*.json")).read_text())
    t0 = time.monotonic()
    os.kill(node["raylet_pid"], signal.SIGKILL)
    end = job.ended(60)
    took = time.monotonic() - t0
    assert took < 15, f"the job took {took:.1f}s to end after its raylet was killed"
    assert end["exit_code"] not in (0, None) and not end["cancelled"]
    st = job.status()
    why = f"raylet (pid {node['raylet_pid']}) killed by SIGKILL while the job ran"
    assert st["state"] == "FAILED" and why in st["reason"], st
    log = job.log().read_text()
    errors = [ln for ln in log.splitlines() if "error:" in ln and "raylet" in ln]
    assert len(errors) == 1 and "Ray failed under the trainer" in errors[0] and why in errors[0], errors
    assert "Failed to connect to GCS" not in log and "Traceback" not in log
    assert job.listed_state() == "FAILED"
    assert_job_left_nothing(job.tree, job.rec())


def test_a_killed_supervisor_takes_the_whole_local_job_with_it(tmp_path, tiny_model, kill_leftovers):
    """Fault 1b: ``kill -9`` of a local job's supervisor (what the OOM killer does to it). Its
    watchdog ends every process of the job within 5 s, Ray's agents included (they used to run on
    under init, retrying a GCS that was gone), frees the job's ports, removes its Ray temp dir and
    records why the job ended."""
    job = _local(tmp_path, tiny_model, kill_leftovers, *LONG, detach=True)
    assert job.proc.wait(timeout=120) == 0, job.err.read_text()
    rec = job.started()
    job.training()
    job.tree.sample()
    names = []
    for pid in job.tree.pids:
        try:
            names.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    names = " | ".join(names)
    assert "raylet" in names and "RuntimeEnvAgent" in names and "supervisor watch" in names, names
    t0 = time.monotonic()
    os.kill(rec["supervisor_pid"], signal.SIGKILL)
    while job.tree.left() and time.monotonic() - t0 < 5.0:
        time.sleep(0.05)
    took = time.monotonic() - t0
    assert not job.tree.left(), f"{took:.1f}s after the kill:\n" + "\n".join(job.tree.left())
    assert_job_left_nothing(job.tree, job.rec())
    end = job.rec()
    assert end["exit_code"] == 137 and not end["cancelled"], end
    st = job.status()
    assert st["state"] == "FAILED" and f"its supervisor (pid {rec['supervisor_pid']}) died" in st["reason"], st
    assert "died; its watchdog killed the job's" in job.log().read_text()
    print(f"nothing of the job left {took:.2f}s after SIGKILL to its supervisor")


def test_two_jobs_on_one_port_block_both_run(tmp_path, tiny_model, kill_leftovers):
    """Fault 9: two jobs whose ids give the same port block start at once; the second moves to the
    next free block (no InvalidAuthToken from the first one's GCS) and both complete."""
    base = 22000 + 200 * random.randrange(45)
    first_id = random.randrange(100_000, 4_000_000) * 2
    jobs = []
    for i in range(2):      # at once: both reach Ray's bring-up at about the same moment
        tmp = tmp_path / f"job{i}"
        tmp.mkdir()
        jobs.append(_local(tmp, tiny_model, kill_leftovers, "--set", f"ray.port_base={base}",
                           "--set", "ray.port_slots=2", detach=True, home=tmp_path / "home",
                           env={"HPC_VERL_LOCAL_JOB_ID": str(first_id + 2 * i)}))
    recs = []
    for j, job_id in zip(jobs, (first_id, first_id + 2)):
        assert j.proc.wait(timeout=120) == 0, j.err.read_text()
        j._dir = next(d for d in (tmp_path / "home" / "jobs").iterdir()
                      if json.loads((d / "job.json").read_text())["job_id"] == job_id)
        recs.append(j.started())
    ends = [j.ended(400) for j in jobs]
    failed = "\n".join(j.log().read_text()[-3000:] for j, e in zip(jobs, ends) if e["exit_code"] != 0)
    assert [e["exit_code"] for e in ends] == [0, 0], failed   # (the log of the job that failed)
    assert [j.status()["state"] for j in jobs] == ["COMPLETED", "COMPLETED"]
    blocks = [json.loads(next((Path(r["run_dir"]) / "ray" / "nodes").glob("*.json")).read_text())["ports"]
              ["block_start"] for r in recs]
    assert len(set(blocks)) == 2 and set(blocks) == {base, base + 100}, blocks
    node_logs = "\n".join(p.read_text() for r in recs for p in (Path(r["run_dir"]) / "logs").glob("node-*.log"))
    assert "InvalidAuthToken" not in node_logs
    assert "using the next free block" in node_logs or "retrying on the next free port block" in node_logs
    for j in jobs:
        assert_job_left_nothing(j.tree, j.rec())


# ---------------------------------------------------------------------------- hpc-verl train
class Train:
    """``hpc-verl train`` in a session of its own (optionally inside ``unshare -m`` with a mount)."""

    def __init__(self, tmp: Path, args: list[str], mount: str | None = None, name: str = "train") -> None:
        self.log = tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "hpc_verl", "train", "--no-progress", *args]
        if mount:
            cmd = ["unshare", "-m", "bash", "-c", f"{mount} && exec \"$@\"", "bash", *cmd]
        with open(self.log, "w") as fh:
            # (wide: rich's log lines are not wrapped, so that a warning is one line to look for)
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp / "home", COLUMNS="400"), stdout=fh,
                                         stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.tree = Tree(self.proc.pid)
        self.started = time.time()

    def wait(self, timeout: float = 300) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        self.err = err
        return self.proc.returncode, err

    def private_ray(self) -> Path | None:
        text = self.log.read_text() + self.err
        for word in text.split():
            if "/hpcv-train-" in word:
                return Path(word)
        return None

    def assert_left_nothing(self, run_dir: Path) -> None:
        assert not self.tree.left(), "processes of the run were left behind:\n" + "\n".join(self.tree.left())
        ray_dir = self.private_ray()
        assert ray_dir is not None, "the trainer did not say where its private Ray lived"
        assert not ray_dir.exists(), f"the private Ray's temp dir {ray_dir} was left behind"
        # (this run's: a pid can be reused, and an older run's session of that pid is not this one's)
        ours = [p for p in Path("/tmp/ray").glob(f"session_*_{self.proc.pid}") if p.stat().st_mtime >= self.started - 1]
        assert not ours, f"a /tmp/ray session was left: {ours}"
        assert not _leftover_dirs(run_dir), _leftover_dirs(run_dir)


def _unshare_works() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    res = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "tmpfs", "/mnt"], capture_output=True)
    return res.returncode == 0


needs_mounts = pytest.mark.skipif(not _unshare_works(), reason="needs root and 'unshare -m' (a private mount "
                                  "namespace) to mount a read-only or a tiny tmpfs")


@needs_mounts
def test_read_only_and_full_disks_fail_in_one_line_and_leave_nothing(tiny_model, digits_data, tmp_path):
    """Fault 5 (and 10: Ray's agents after an error exit): one line with the path and errno text."""
    disk = tmp_path / "disk"
    disk.mkdir()
    run = disk / "run"
    args = digit_overrides(tiny_model, digits_data, run, 3, ("trainer.save_freq=1",))
    # a run dir that cannot be made, and one that exists but takes no file: refused before Ray starts
    for name, mount in (("ro", f"mount -t tmpfs -o ro tmpfs {disk}"),
                        ("ro-existing", f"mount -t tmpfs tmpfs {disk} && mkdir {run} && mount -o remount,ro {disk}")):
        ro = Train(tmp_path, args, mount=mount, name=name)
        rc, err = ro.wait()
        lines = _hpcv_lines(err)
        assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert f"{run}: Read-only file system (EROFS)" in lines[0] and "read-only" in lines[0].split(";", 1)[1]
        assert ro.private_ray() is None, "Ray was started for a run that could not write its run dir"
        assert not ro.tree.left()

    full = Train(tmp_path, args, mount=f"mount -t tmpfs -o size=160k tmpfs {disk}", name="full")
    rc, err = full.wait()
    lines = _hpcv_lines(err)
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:] + full.log.read_text()[-3000:]
    assert f"{run}: No space left on device while writing checkpoint global_step_1 (ENOSPC)" in lines[0], lines
    assert "free there" in lines[0]
    full.assert_left_nothing(run)   # a full run dir: checked from outside the namespace it is gone with
    assert not list(disk.iterdir())  # (the tmpfs is gone with its namespace; nothing was written here)


def test_a_kill_during_a_checkpoint_save_leaves_nothing_after_the_resume(tiny_model, digits_data, tmp_path):
    """Fault 6: SIGKILL while a checkpoint is being written (its partial temp dir on disk); the
    next run removes it, says so, and resumes from the newest complete checkpoint."""
    run = tmp_path / "run"
    args = digit_overrides(tiny_model, digits_data, run, 400, ("trainer.save_freq=1",))
    partial: list[Path] = []
    for attempt in range(4):
        t = Train(tmp_path, args, name=f"killed{attempt}")
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and t.proc.poll() is None:
                # a save in progress, with an earlier complete one to fall back to
                found = list(run.glob(".tmp_global_step_*")) if run.exists() else []
                if found and list(run.glob("global_step_*/manifest.json")):
                    os.killpg(t.proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.002)
            t.proc.wait(timeout=60)
        finally:
            for line in t.tree.left():   # SIGKILL: nothing of the run could clean up after itself
                os.kill(int(line.split()[0]), signal.SIGKILL)
        partial = list(run.glob(".tmp_global_step_*"))
        if partial:
            break
    assert partial, "no save was caught in the act"
    from hpc_verl.trainer.driver.checkpoint import latest_checkpoint
    intact = int(latest_checkpoint(run, verify=True).name.rsplit("_", 1)[1])
    resume = Train(tmp_path, digit_overrides(tiny_model, digits_data, run, intact + 2, ("trainer.save_freq=1",)),
                   name="resume")
    rc, err = resume.wait()
    out = resume.log.read_text() + err
    assert rc == 0, out[-3000:]
    assert f"removed {len(partial)} partial checkpoint(s)" in out and partial[0].name in out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["run/start_step"] == intact][:1] == [intact + 1]
    resume.assert_left_nothing(run)


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model, digits_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("ckpts") / "run"
    t = Train(run.parent, digit_overrides(tiny_model, digits_data, run, 4, ("trainer.save_freq=2",
                                                                              "trainer.max_actor_ckpt_to_keep=3")))
    rc, err = t.wait()
    assert rc == 0, err[-3000:]
    t.assert_left_nothing(run)    # (fault 10: no /tmp/ray session, no private Ray dir after a clean run)
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_2", "global_step_4"]
    return run


@pytest.mark.parametrize("damage", ["truncated", "bytes changed"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(two_checkpoints, tiny_model, digits_data,
                                                                   tmp_path, damage):
    """Fault 7: resume names the damaged checkpoint in a warning and continues from the one before."""
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    shard = max((run / "global_step_4" / "actor").glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        shard.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + 4096]) + data[middle + 4096:])
    t = Train(tmp_path, digit_overrides(tiny_model, digits_data, run, 6, ("trainer.save_freq=2",)))
    rc, err = t.wait()
    out = t.log.read_text() + err
    assert rc == 0, out[-3000:]
    warned = [ln for ln in out.splitlines() if "is damaged" in ln]
    assert len(warned) == 1 and "global_step_4 is damaged" in warned[0] and "falling back" in warned[0], warned
    assert ("truncated" if damage == "truncated" else "SHA-256") in warned[0]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["run/start_step"] == 2] == [3, 4, 5, 6]
    from hpc_verl.trainer.driver.checkpoint import verify_checkpoint
    assert verify_checkpoint(run / "global_step_4") and verify_checkpoint(run / "global_step_6")  # re-saved
    t.assert_left_nothing(run)


def test_a_train_parquet_without_reward_model_is_refused_by_check(tiny_model, tmp_path, cli):
    """Fault 8: rule-based rewards need reward_model.ground_truth; without it: one line, before training."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"{i} + 1 = ?"}],
             "ability": "math", "extra_info": {"index": i}} for i in range(8)]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    res = cli("train", "--check", f"actor_rollout_ref.model.path={tiny_model}", f"data.train_files={data}",
              "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              f"hpc_verl.run_dir={tmp_path / 'run'}", "trainer.device=cpu", "trainer.n_gpus_per_node=1")
    lines = _hpcv_lines(res.stderr)
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"{data}: 8 of 8 rows have no reward_model.ground_truth (no reward_model column)" in lines[0]
    assert "score every response of them 0" in lines[0]
