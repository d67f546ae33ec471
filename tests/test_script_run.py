"""Rendered scripts executed against FAKE srun/scontrol and FAKE container runtimes (see fakecluster.py).

These prove behaviour of the script itself: hostile values stay inert, stages run in order and skip
when finished, preemption checkpoints and requeues, a dead Ray node fails fast, containers are
stopped on every exit path, GPUs come from the allocation.
"""
from __future__ import annotations

import os

import shlex
import signal
import subprocess
import time

import pytest

from fakecluster import JOB_ID, FakeCluster

HOSTILE = "a b'c\"d $(touch {m}) `touch {m}`; touch {m} && echo $HOME \\ *"


@pytest.fixture
def fc(tmp_path):
    cluster = FakeCluster(tmp_path)
    yield cluster
    cluster.close()


def _order(stderr: str, words: list[str]) -> list[int]:
    return [stderr.index(w) for w in words]


def test_hostile_values_are_quoted_and_never_run(fc, tmp_path):
    marker = tmp_path / "MARKER"
    hostile = HOSTILE.format(m=marker)
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: hostile\n"
        "data:\n"
        f"  raw: 'raw data $(touch {marker})'\n"
        f"  dir: 'out dir `touch {marker}`; touch {marker}'\n"
        "trainer:\n"
        "  args: ['--flag=$(touch " + str(marker) + ")']\n"
        "  overrides: {'trainer.experiment_name': '$(touch " + str(marker) + ")'}\n"
    )
    (fc.submit_dir / f"raw data $(touch {marker})").mkdir(parents=True)
    sets = [f"env.vars.HOSTILE={hostile}",
            f"paths.cache_dir=cache $(touch {marker}) dir",
            f"container.mounts=['src $(touch {marker}):/mnt/x;touch {marker}']",
            f"container.run_flags=['--label=x;touch {marker}', '$(touch {marker})']"]
    script = fc.render("testbed-podman", sets, str(job), [f"trainer.project_name=`touch {marker}`"])
    res = fc.run(script, FAKE_PROBE="HOSTILE")
    assert res.rc == 0, res.stderr
    assert not marker.exists(), "a hostile value was executed"
    # values arrived intact, as single arguments
    run_calls = [c for c in res.calls("podman") if "run" in c]
    assert len(run_calls) == 2
    first = run_calls[0]
    assert f"src $(touch {marker}):/mnt/x;touch {marker}" in [a.replace(str(fc.submit_dir) + "/", "") for a in first]
    assert "--label=x;touch " + str(marker) in first and f"$(touch {marker})" in first
    assert any(a.startswith(f"{fc.submit_dir}/cache $(touch {marker}) dir:") for a in first)
    probes = [shlex.split(line)[1] for line in res.log if line.startswith("probe HOSTILE=")]
    assert probes and all(p == f"HOSTILE={hostile}" for p in probes)
    trainer = [c for c in res.calls("python") if "hpc_verl.trainer.main" in c][0]
    assert f"--flag=$(touch {marker})" in trainer
    assert f"trainer.experiment_name=$(touch {marker})" in trainer
    assert f"trainer.project_name=`touch {marker}`" in trainer
    env_line = [line for line in res.log if line.startswith("trainer-env HOSTILE=")][0]
    assert shlex.split(env_line)[1] == f"HOSTILE={hostile}"
    # the hostile data dir was created literally, and preprocessing wrote into it
    assert (fc.submit_dir / f"out dir `touch {marker}`; touch {marker}" / "train.parquet").exists()


def test_stages_in_order_and_skipped_after_requeue(fc):
    script = fc.render("testbed")
    first = fc.run(script)
    assert first.rc == 0, first.stderr
    order = _order(first.stderr, ["stage preprocess: start", "stage model-check: start", "ray-up: head",
                                  "stage train: start", "collect: logs"])
    assert order == sorted(order)
    stages = first.run_dir / "stages"
    assert sorted(p.name for p in stages.iterdir()) == ["model-check.done", "preprocess.done", "train.done"]
    trainer_runs = [c for c in first.calls("python") if "hpc_verl.trainer.main" in c]
    assert len(trainer_runs) == 1
    # derived overrides carry run-time values
    assert "trainer.nnodes=2" in trainer_runs[0] and "trainer.n_gpus_per_node=4" in trainer_runs[0]
    # ports derived from the job id at run time: base + (id % slots) * stride
    plan = [c for c in first.calls("python") if c[1:3] == ["hpc_verl.bootstrap", "plan"]][0]
    assert plan[plan.index("--port-base") + 1] == "20000" and plan[plan.index("--port-slots") + 1] == "120"
    assert plan[plan.index("--job-id") + 1] == JOB_ID and plan[plan.index("--gpus-per-node") + 1] == "4"
    assert [c for c in first.calls("python") if c[1:3] == ["hpc_verl.bootstrap", "head"]]
    wait = [c for c in first.calls("python") if c[1:3] == ["hpc_verl.bootstrap", "wait"]][0]
    assert wait[wait.index("--job-dir") + 1] == str(first.run_dir)
    # teardown asks the node supervisors to stop (they remove their temp dirs) before any TERM
    assert (first.run_dir / "ray" / "stop").exists()

    again = fc.run(script, SLURM_RESTART_COUNT="1")
    assert again.rc == 0, again.stderr
    assert "stage train: done in an earlier run of this job, skipping" in again.stderr
    assert "stage preprocess: done in an earlier run" in again.stderr
    assert len([c for c in again.calls("python") if "hpc_verl.trainer.main" in c]) == 1  # not run again
    assert "ray-up: head" in again.stderr.split("stage model-check")[1]  # Ray comes up again every run


def test_preemption_signal_checkpoints_and_requeues(fc):
    script = fc.render("testbed")
    proc = fc.popen(script, FAKE_TRAINER_WAIT_PREEMPT="1")
    started = fc.submit_dir / "jobs" / f"hpcv-{JOB_ID}" / "trainer.started"
    deadline = time.monotonic() + 30
    while not started.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "trainer never started"
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=30)
    res = fc.result(proc.returncode, out, err)
    assert res.rc == 0, err
    assert "got SIGUSR2 before the time limit" in err
    assert "checkpoint written" in out
    assert ["requeue", JOB_ID] in res.calls("scontrol")
    assert not (res.run_dir / "stages" / "train.done").exists()  # the next run trains (resumes) again


@pytest.mark.parametrize("code, trainer_rc, requeued", [(None, 99, True), ("42", 42, True), ("42", 99, False)])
def test_requeue_exit_code_is_the_trainers_constant(fc, code, trainer_rc, requeued):
    """The script requeues on exactly the code the trainer uses for "checkpointed, requeue me"
    (errors.REQUEUE_EXIT_CODE, or the variable a profile sets), and the trainer in the
    job sees that same code in its environment."""
    sets = [f"env.vars.HPC_VERL_REQUEUE_EXIT_CODE={code}"] if code else []
    res = fc.run(fc.render("testbed", sets), FAKE_TRAINER_RC=str(trainer_rc),
                 FAKE_PROBE="HPC_VERL_REQUEUE_EXIT_CODE")
    assert f"trainer-env HPC_VERL_REQUEUE_EXIT_CODE={code or 99}" in res.log
    if requeued:
        assert res.rc == 0, res.stderr
        assert f"asks to be requeued (exit {trainer_rc})" in res.stderr
        assert ["requeue", JOB_ID] in res.calls("scontrol")
    else:
        assert res.rc == 99 and f"the trainer exited with status {trainer_rc}" in res.stderr
        assert ["requeue", JOB_ID] not in res.calls("scontrol")


def test_requeue_exit_code_set_where_the_launcher_runs_reaches_script_and_trainer(cli, tmp_path):
    """HPC_VERL_REQUEUE_EXIT_CODE (docs/trainer.md) on the login node: the rendered script tests that
    code and exports it to the trainer's environment (containers included), instead of a literal 99."""
    out = tmp_path / "job.sbatch"
    res = cli("render", "--profile", "ib-a100", "-o", str(out), env={"HPC_VERL_REQUEUE_EXIT_CODE": "42"})
    assert res.returncode == 0, res.stderr
    script = out.read_text()
    assert "if ((rc == 42)); then" in script and "hpcv_export HPC_VERL_REQUEUE_EXIT_CODE 42" in script
    assert "rc == 99" not in script
    bad = cli("render", "--profile", "ib-a100", "--set", "env.vars.HPC_VERL_REQUEUE_EXIT_CODE=1")
    assert bad.returncode == 2 and "env.vars.HPC_VERL_REQUEUE_EXIT_CODE '1' must be an exit status" in bad.stderr


def test_requeue_budget_is_bounded(fc):
    script = fc.render("testbed", ["slurm.max_restarts=1"])
    proc = fc.popen(script, FAKE_TRAINER_WAIT_PREEMPT="1", SLURM_RESTART_COUNT="1")
    started = fc.submit_dir / "jobs" / f"hpcv-{JOB_ID}" / "trainer.started"
    deadline = time.monotonic() + 30
    while not started.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR2)
    out, err = proc.communicate(timeout=30)
    res = fc.result(proc.returncode, out, err)
    assert "not requeueing: restart 1 of 1" in err
    assert ["requeue", JOB_ID] not in res.calls("scontrol")




def test_wait_any_reports_a_child_that_ends_as_a_trap_runs(fc, tmp_path):
    """hpcv_wait_any, from a rendered script, against the race itself: a child signals the shell and
    exits at once. A loop that only retries `wait -n` after the trap misses that child in most tries
    (bash 5.2: 18 of 20 here) and waits for the other one; hpcv_wait_any must name the child that
    ended, with its status or, where bash lost it, an empty one."""
    text = fc.render("testbed").read_text()
    start = text.index("hpcv_wait_any() {")
    func = text[start:text.index("\n}\n", start) + 3]
    harness = tmp_path / "harness.sh"
    harness.write_text("set -euo pipefail\n" + func + """
trap 'x=$(date); : > "$0.trap"' USR2
( sleep 0.3; kill -USR2 $$; exit 3 ) & a=$!
sleep 20 & b=$!
hpcv_wait_any "$a" "$b"
printf '%s %s %s\\n' "$a" "$HPCV_DONE_PID" "${HPCV_DONE_RC:-lost}"
kill "$b"
""")
    for _ in range(5):
        res = subprocess.run(["bash", str(harness)], capture_output=True, text=True, timeout=15)
        assert res.returncode == 0, res.stderr
        child, done, status = res.stdout.split()
        assert done == child and status in ("3", "lost"), res.stdout
        assert (tmp_path / "harness.sh.trap").exists()  # the trap did run during the wait

@pytest.mark.parametrize("attempt", range(3))
def test_a_preemption_signal_as_the_barrier_ends_keeps_the_ready_cluster(fc, attempt):
    """bash 5.2 loses the status of a child that ends while a trap interrupts `wait -n`: the barrier
    signals the batch shell as it exits (ready), and the run must still train, checkpoint and
    requeue, not call the ready cluster failed. Three tries: the loss hit 18 of 20 in a bare loop."""
    script = fc.render("testbed")
    res = fc.run(script, FAKE_SIGNAL_AT_EXIT="barrier", FAKE_TRAINER_WAIT_PREEMPT="1")
    assert res.rc == 0, res.stderr
    assert "ray-up: 2 nodes and 8 GPUs ready" in res.stderr
    assert "got SIGUSR2 before the time limit" in res.stderr
    assert ["requeue", JOB_ID] in res.calls("scontrol")


@pytest.mark.parametrize("attempt", range(3))
def test_a_preemption_signal_as_the_trainer_ends_keeps_its_status(fc, attempt):
    """The same race for the trainer: its "requeue me" status comes from the step's own record
    (trainer.rc) when bash lost it."""
    script = fc.render("testbed")
    res = fc.run(script, FAKE_SIGNAL_AT_EXIT="trainer", FAKE_TRAINER_RC="99")
    assert res.rc == 0, res.stderr
    assert "asks to be requeued (exit 99)" in res.stderr
    assert ["requeue", JOB_ID] in res.calls("scontrol")
    assert (res.run_dir / "trainer.rc").read_text() == "99\n"

def test_dead_ray_head_fails_fast(fc):
    script = fc.render("testbed")
    res = fc.run(script, timeout=25, FAKE_HEAD_RC="1", FAKE_BARRIER_SLEEP="60")
    assert res.rc != 0
    assert "a Ray node step exited" in res.stderr
    assert not (res.run_dir / "stages" / "train.done").exists()


@pytest.mark.parametrize("trainer_rc", ["0", "3"])
def test_containers_named_per_job_and_node_and_stopped_on_exit(fc, trainer_rc):
    script = fc.render("testbed-podman")
    # like the test bed: placeholder GPUs, steps see only SLURM_GPUS_ON_NODE
    res = fc.run(script, FAKE_TRAINER_RC=trainer_rc, FAKE_GPUS="")
    assert res.rc == int(trainer_rc), res.stderr
    calls = res.calls("podman")
    runs = [c for c in calls if "run" in c]
    names = sorted(c[c.index("--name") + 1] for c in runs)
    assert names == [f"hpcv-{JOB_ID}-node1", f"hpcv-{JOB_ID}-node2"]
    for c in runs:
        assert c[:4] == ["--runtime", "runc", "--cgroup-manager=cgroupfs", "run"]
        assert "--init" in c and c[c.index("--network") + 1] == "host"
        assert "nofile=1024:1024" in c and "CUDA_VISIBLE_DEVICES=0,1,2,3" in c
        assert c[-3:] == ["localhost/hpc-verl-testbed:latest", "sleep", "infinity"]
        assert c[c.index("--stop-timeout") + 1] == "2"  # a short grace for the removal below
    # the cleanup trap ran on this exit path: each container is removed (by name) after its run
    started = {c[c.index("--name") + 1]: i for i, c in enumerate(calls) if "run" in c}
    removed = sorted({c[-1] for i, c in enumerate(calls) if "rm" in c and "--force" in c and i > started.get(c[-1], i)})
    assert removed == names
    if trainer_rc != "0":
        assert "cleanup (exit status 3)" in res.stderr


def test_gpus_come_from_the_allocation_never_all(fc):
    script = fc.render("ib-a100", ["slurm.gpus_per_node=2"])
    res = fc.run(script, FAKE_GPUS="4,5")
    assert res.rc == 0, res.stderr
    runs = [c for c in res.calls("docker") if "run" in c]
    assert len(runs) == 2
    for c in runs:
        assert c[c.index("--gpus") + 1] == '"device=4,5"'
        assert "CUDA_VISIBLE_DEVICES=0,1" in c
        assert c[c.index("--device") + 1] == "/dev/infiniband"
        assert "IPC_LOCK" in c and "memlock=-1:-1" in c and c[c.index("--shm-size") + 1] == "128g"
        assert "all" not in c
        # docker: the job's own uid/gid (files in the run dir are the user's); removed by name, no --rm
        assert c[c.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}" and "--rm" not in c
    names = sorted(c[c.index("--name") + 1] for c in runs)
    removed = sorted({c[-1] for c in res.calls("docker") if c[:2] == ["rm", "--force"]})
    assert removed == names
    srun_all = [line for line in res.log if line.startswith("srun ")]
    assert srun_all and all("--overlap" in line for line in srun_all)


def test_missing_gpus_in_allocation_is_an_error_not_all(fc):
    script = fc.render("ib-a100", ["slurm.gpus_per_node=2"])
    res = fc.run(script, FAKE_GPUS="")
    assert res.rc != 0
    assert "no GPUs in the SLURM allocation on node1" in res.stderr
    assert "containers: the container step exited before all 2 containers were up" in res.stderr
    assert not [c for c in res.calls("docker") if "run" in c]


def test_local_profile_runs_without_slurm(fc):
    """scheduler: local — no srun, no scontrol: the same pipeline on this machine."""
    script = fc.render("local")
    env_extra = {"SLURM_JOB_ID": "", "SLURM_JOB_NODELIST": "", "SLURM_SUBMIT_DIR": ""}
    res = fc.run(script, **env_extra)
    assert res.rc == 0, res.stderr
    assert not res.calls("srun") and not res.calls("scontrol")
    assert "ray-up: 1 nodes and 0 GPUs ready" in res.stderr
    trainer = [c for c in res.calls("python") if "hpc_verl.trainer.main" in c][0]
    assert "trainer.nnodes=1" in trainer and "trainer.n_gpus_per_node=0" in trainer
    run_dirs = list((fc.submit_dir / "jobs").iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / "stages" / "train.done").exists()


def test_pyxis_steps_run_in_the_named_container(fc):
    script = fc.render("pyxis-h100", ["slurm.gpus_per_node=2"])
    res = fc.run(script, FAKE_GPUS="0,1")
    assert res.rc == 0, res.stderr
    steps = [line for line in res.log if line.startswith("srun ")]
    assert "--container-image" not in steps[0]  # host-side preparation of bind sources first
    for line in steps[1:]:
        args = shlex.split(line)
        assert f"--container-name=hpcv-{JOB_ID}" in args and "--no-container-mount-home" in args
        image = [a for a in args if a.startswith("--container-image=")]
        assert image == ["--container-image=registry.example.org#hpc-verl/hpc-verl:0.1.0-cu124"]
        mounts = [a for a in args if a.startswith("--container-mounts=")][0].split("=", 1)[1].split(",")
        assert f"{fc.submit_dir}:{fc.submit_dir}" in mounts and f"{fc.ray_tmp}:{fc.ray_tmp}" in mounts
        assert "/dev/infiniband" in mounts


def test_apptainer_instances_per_node_started_and_stopped(fc):
    script = fc.render("eth-l40s")
    res = fc.run(script, FAKE_GPUS="2,3")
    assert res.rc == 0, res.stderr
    calls = res.calls("apptainer")
    starts = [c for c in calls if c[:2] == ["instance", "start"]]
    assert sorted(c[-1] for c in starts) == [f"hpcv-{JOB_ID}-node1", f"hpcv-{JOB_ID}-node2"]
    for c in starts:
        assert "--nv" in c and c[-2] == "/shared/containers/hpc-verl-0.1.0-cu124.sif"
        assert f"{fc.submit_dir}:{fc.submit_dir}" in c
    stops = {c[-1] for c in calls if c[:2] == ["instance", "stop"]}
    assert stops == {f"hpcv-{JOB_ID}-node1", f"hpcv-{JOB_ID}-node2"}
    execs = [c for c in calls if c[0] == "exec"]
    assert execs and all(c[3].startswith("instance://hpcv-") for c in execs)
