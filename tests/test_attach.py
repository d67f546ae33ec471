"""`hpc-verl attach JOB [--node N] [-- CMD]` (issue 13, item 2).

On the real SLURM test bed with the podman runtime: the command runs inside the job's container on
the chosen node, through `srun --overlap --jobid` and `podman exec`, with the job's RAY_ADDRESS and
token (a Ray client in there joins the job's cluster); a shell reads commands from a pipe and from a
pseudo-terminal (`srun --pty`, `podman exec --tty`). A local job: the same script on this machine.
"""
from __future__ import annotations

import json
import os
import pty
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from slurm_bed import leftovers

RAY_NODES = ("import ray; ray.init(logging_level='ERROR'); "
             "print('ALIVE', len([n for n in ray.nodes() if n['Alive']]))")


def workload_job(tmp_path: Path, name: str) -> str:
    """A job that keeps running (400 short steps) on Ray, so there is something to attach to."""
    cfg = {"name": name, "trainer": {"module": "hpc_verl.bootstrap.workload", "derive_overrides": False,
                                     "args": ["--steps", "400", "--step-s", "0.5"]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def one_line_exit_2(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    return lines[0]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what()
        time.sleep(0.5)


def in_a_pty(argv: list[str], env: dict, cwd: str, typed: str, timeout_s: float = 90) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as stdin/stdout (as a person at a terminal), type ``typed``."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd, close_fds=True)
    os.close(slave)
    os.write(master, typed.encode())
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # the other side closed: the session ended
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    return proc.wait(timeout=30), out.decode(errors="replace")


# --------------------------------------------------------------------------- the SLURM test bed, podman
def container_id(name: str) -> str:
    from hpc_verl.testbed.image import PODMAN_GLOBAL

    res = subprocess.run(["podman", *PODMAN_GLOBAL, "inspect", "--format", "{{.Id}}", name], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and len(res.stdout.strip()) == 64, res.stderr
    return res.stdout.strip()


@pytest.mark.slurm
@pytest.mark.slow
def test_attach_runs_inside_the_jobs_container_on_the_test_bed(slurm_testbed, tmp_path):
    bed = slurm_testbed
    if not bed.podman_image:
        pytest.skip("podman not installed (scripts/setup.sh installs it)")
    res = bed.cli("submit", "--profile", "testbed-podman-local", "--config", workload_job(tmp_path, "att"))
    assert res.returncode == 0, res.stderr
    job = re.search(r"submitted job (\d+)", res.stdout).group(1)
    run_dir = Path(re.search(r"run directory: (\S+)", res.stdout).group(1))
    batch_log = Path(f"{run_dir}.out")
    try:
        wait_for(lambda: batch_log.exists() and "step 1/400 done" in batch_log.read_text(errors="replace"), 240,
                 lambda: batch_log.read_text(errors="replace") if batch_log.exists() else "no batch log yet")
        status = json.loads(bed.cli("status", job, "--json").stdout)

        # the acceptance line: the node's name, from inside the job (the head's container)
        res = bed.cli("attach", job, "--", "hostname")
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == socket.gethostname()  # both test bed nodes live on this host

        # inside node2's container (the N-th node), with the job's Ray address and token: the
        # process's cgroup is the one podman made for that container (its id, asked on the host)
        ids = {n: container_id(f"hpcv-{job}-{n}") for n in ("node1", "node2")}
        show = 'cat /proc/self/cgroup; echo "RAY=$RAY_ADDRESS TOKEN=$RAY_AUTH_TOKEN_PATH"; pwd'
        res = bed.cli("attach", job, "--node", "1", "--", "sh", "-c", show)
        assert res.returncode == 0, res.stderr
        assert ids["node2"] in res.stdout and ids["node1"] not in res.stdout
        assert f"RAY={status['ray_address']} TOKEN={run_dir}/ray/token" in res.stdout
        assert res.stdout.strip().endswith(str(bed.dir))  # the job's submit dir, as for its own steps
        res = bed.cli("attach", job, "--node", "node1", "--", "cat", "/proc/self/cgroup")
        assert res.returncode == 0 and ids["node1"] in res.stdout, res.stderr

        # a Ray client in there joins the job's token-protected cluster (both nodes)
        res = bed.cli("attach", job, "--", sys.executable, "-c", RAY_NODES, timeout=180)
        assert res.returncode == 0 and "ALIVE 2" in res.stdout, res.stderr[-2000:]

        # no command: a shell; from a pipe, and at a terminal (srun --pty, podman exec --tty)
        piped = subprocess.run([sys.executable, "-m", "hpc_verl", "attach", job], input="echo piped-$HPCV_JOB_ID\n"
                               "exit 4\n", env=bed.env, cwd=str(bed.dir), capture_output=True, text=True, timeout=120)
        assert piped.returncode == 4 and f"piped-{job}" in piped.stdout, piped.stderr
        rc, out = in_a_pty([sys.executable, "-m", "hpc_verl", "attach", job, "--node", "1"], bed.env, str(bed.dir),
                           "[[ -t 0 && -t 1 ]] && echo TTY-$((6 * 7)); cat /proc/self/cgroup; exit 5\n")
        assert rc == 5 and "TTY-42" in out and ids["node2"] in out, out

        # the command's exit status is attach's; a node the job does not have is one line
        assert bed.cli("attach", job, "--", "sh", "-c", "exit 7").returncode == 7
        line = one_line_exit_2(bed.cli("attach", job, "--node", "2"))
        assert "has no node '2'" in line and "0: node1, 1: node2" in line
    finally:
        bed.cli("cancel", job)
    assert bed.wait_state(int(job), {"CANCELLED", "COMPLETED", "FAILED"}, timeout_s=90) == "CANCELLED"
    line = one_line_exit_2(bed.cli("attach", job, "--", "hostname"))
    assert f"job {job} is CANCELLED, not running" in line
    # the attach steps ended with the job: no process, container or port of it is left. (Not asserted:
    # the nodes' Ray temp dirs, which a cancelled podman job leaves with or without attach - seen on the
    # base branch too; test_slurm_e2e's cancel test runs without a container.)
    left = [x for x in leftovers(str(run_dir), int(job)) if "Ray temp dir" not in x]
    assert not left, f"job {job} left behind: {left}"


# --------------------------------------------------------------------------- a local job
@pytest.mark.slow
def test_attach_to_a_local_job_is_a_shell_here_with_its_environment(cli, tmp_path):
    env = {"HPC_VERL_HOME": str(tmp_path / "home")}
    res = cli("submit", "--profile", "local", "--config", workload_job(tmp_path, "latt"), "--detach",
              cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    job = re.search(r"started local job (\d+)", res.stdout).group(1)
    run_dir = Path(re.search(r"run directory: (\S+)", res.stdout).group(1))
    try:
        wait_for(lambda: (run_dir / "ray" / "env.sh").exists(), 120, lambda: "the job's Ray did not come up")
        res = cli("attach", job, "--", "sh", "-c", 'echo "RAY=$RAY_ADDRESS RUN=$HPCV_RUN_DIR"; hostname',
                  cwd=tmp_path, env=env)
        assert res.returncode == 0, res.stderr
        assert f"RUN={run_dir}" in res.stdout and "RAY=" in res.stdout and "RAY= " not in res.stdout
        assert socket.gethostname() in res.stdout
        res = cli("attach", job, "--", sys.executable, "-c", RAY_NODES, cwd=tmp_path, env=env, timeout=180)
        assert res.returncode == 0 and "ALIVE 1" in res.stdout, res.stderr[-2000:]
        line = one_line_exit_2(cli("attach", job, "--node", "1", cwd=tmp_path, env=env))
        assert f"job {job} has no node '1'" in line
    finally:
        cli("cancel", job, cwd=tmp_path, env=env)


# --------------------------------------------------------------------------- the attach script itself
HOSTILE = "a b'c\"d $(touch {m}) `touch {m}`; \\ *"


def test_attach_script_keeps_hostile_values_and_enters_the_nodes_container(tmp_path):
    """The job's attach.sh against FAKE srun/podman (tests/fakebin): podman's exec with stdin open,
    on the node SLURM runs it on, with the profile's environment intact (a hostile value stays inert)."""
    from fakecluster import JOB_ID, FakeCluster

    fc = FakeCluster(tmp_path)
    try:
        marker = tmp_path / "MARKER"
        hostile = HOSTILE.format(m=marker)
        res = fc.run(fc.render("testbed-podman", [f"env.vars.HOSTILE={hostile}"]))
        assert res.rc == 0, res.stderr
        script = res.run_dir / "attach.sh"
        assert oct(script.stat().st_mode & 0o777) == "0o600"
        env = fc.env(SLURMD_NODENAME="node2")
        out = subprocess.run(["bash", str(script), "sh", "-c", 'printf "%s|%s" "$HOSTILE" "$RAY_ADDRESS"'],
                             env=env, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        value, _, address = out.stdout.partition("|")
        assert value == hostile and not marker.exists()
        ray_env = res.run_dir / "ray" / "env.sh"
        expected = subprocess.run(["bash", "-c", 'source "$1"; printf "%s" "$RAY_ADDRESS"', "-", str(ray_env)],
                                  capture_output=True, text=True, check=True).stdout
        assert expected and address == expected
        execs = [c for c in fc.result(0, "", "").calls("podman") if "exec" in c and "sh" in c]
        assert execs and "--interactive" in execs[-1] and "--tty" not in execs[-1]  # stdin a pipe, no terminal
        assert execs[-1][execs[-1].index("sh") - 1] == f"hpcv-{JOB_ID}-node2"
        assert subprocess.run(["bash", str(script), "--srun-args"], env=env, capture_output=True).stdout == b""
    finally:
        fc.close()


def test_pyxis_attach_runs_in_the_jobs_named_container(tmp_path):
    """pyxis: the attach step carries the job's container options (name, mounts), the srun line is built
    by the SLURM backend (not run: pyxis is not installed here)."""
    from fakecluster import JOB_ID, FakeCluster

    from hpc_verl.launch.backends.slurm import SlurmBackend
    from hpc_verl.launch.registry import JobRecord

    fc = FakeCluster(tmp_path)
    try:
        res = fc.run(fc.render("pyxis-h100", ["slurm.gpus_per_node=2"]), FAKE_GPUS="0,1")
        assert res.rc == 0, res.stderr
        script = res.run_dir / "attach.sh"
        rec = JobRecord(name="hpcv", job_dir=str(tmp_path), profile="pyxis-h100", job_id=int(JOB_ID),
                        run_dir=str(res.run_dir))
        argv = SlurmBackend().attach_command(rec, "node2", script, ["hostname"], tty=True)
        cut = argv.index("bash")
        assert argv[:7] == ["srun", "--overlap", f"--jobid={JOB_ID}", "--nodes=1", "--ntasks=1", "--nodelist=node2",
                            "--pty"]
        assert f"--container-name=hpcv-{JOB_ID}" in argv[7:cut] and argv[cut:] == ["bash", str(script), "hostname"]
        mounts = [a for a in argv[7:cut] if a.startswith("--container-mounts=")][0]
        assert f"{fc.submit_dir}:{fc.submit_dir}" in mounts  # the run dir (and attach.sh) is visible in there
    finally:
        fc.close()


# --------------------------------------------------------------------------- what cannot be attached to
def test_a_dry_run_and_a_ray_job_are_refused_in_one_line(cli, tmp_path):
    env = {"HPC_VERL_HOME": str(tmp_path / "home")}
    res = cli("submit", "--profile", "testbed", "--dry-run", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    job_dir = Path(re.search(r"job directory (\S+)", res.stdout).group(1))
    line = one_line_exit_2(cli("attach", job_dir.name, cwd=tmp_path, env=env))
    assert "was a dry run; there is nothing to attach to" in line
    res = cli("submit", "--ray-address", "127.0.0.1:1", "--dry-run", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    sid = json.loads(next(Path(tmp_path / "home").glob("jobs/*/ray_job.json")).read_text())["submission_id"]
    from hpc_verl.launch import registry
    os.environ["HPC_VERL_HOME"] = env["HPC_VERL_HOME"]  # (restored by conftest)
    rec = registry.find(sid)
    rec.dry_run = False  # as if it had been sent: the refusal needs no cluster
    rec.save()
    line = one_line_exit_2(cli("attach", sid, "--", "hostname", cwd=tmp_path, env=env))
    assert f"job {sid} is a Ray job" in line and "hpc-verl attach CLUSTER_JOB" in line


def test_pick_node_by_index_or_name():
    from hpc_verl.errors import JobNotFoundError
    from hpc_verl.launch.backends.script import node_list, pick_node

    nodes = node_list("gpu[07-08],cpu1")
    assert nodes == ["gpu07", "gpu08", "cpu1"]
    assert pick_node(nodes, None, "J") == "gpu07" and pick_node(nodes, "2", "J") == "cpu1"
    assert pick_node(nodes, "gpu08", "J") == "gpu08"
    with pytest.raises(JobNotFoundError, match=r"job J has no node '3'.*0: gpu07, 1: gpu08, 2: cpu1"):
        pick_node(nodes, "3", "J")


def test_the_command_after_dashdash_reaches_the_verb_untouched(monkeypatch):
    import hpc_verl.cli.attach as verb
    from hpc_verl.cli.main import main

    seen = []
    monkeypatch.setattr(verb, "run", lambda args: seen.append((args.job, args.node, args.command)) or 0)
    main(["attach", "J", "--node", "1", "--", "ls", "--node", "--", "-x"])
    main(["attach", "J"])
    assert seen == [("J", "1", ["ls", "--node", "--", "-x"]), ("J", None, [])]
