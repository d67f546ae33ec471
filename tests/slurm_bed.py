"""Session fixtures for the real SLURM test bed (used by tests marked ``slurm``).

``slurm_testbed`` brings up munge, slurmctld and two slurmd in a temp dir of its
own (or reuses ``$HPC_VERL_TESTBED_DIR`` when a person started one with
``scripts/testbed.sh up``; that one is left running), writes this machine's
test bed profiles, builds the podman image, and tears everything down at the end.
The image (with the engines: some GB) is built in the background: its reference is a content
key known at once, so the profiles are written before it exists, and only what runs a
container waits for it (``Bed.podman_image``, ``Bed.cli`` with a podman or docker profile).
Its root file system tar is kept until ``docker_testbed`` imports the same tar into Docker.
``docker_testbed`` adds a Docker daemon of the test bed's own, for the tests that need one.
GPUs are fake (empty device files behind SLURM's gres); everything else is real.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Bed:
    """What a test needs to submit jobs to the test bed."""

    dir: Path
    env: dict[str, str]
    temp_root: str
    image_ref: str | None = None
    image_build: Future | None = None
    image_tar: Path | None = None
    submitted: list[int] = field(default_factory=list)

    @property
    def podman_image(self) -> str | None:
        """The image's reference, once it is built (waits for the background build; its error fails here)."""
        if self.image_build is not None:
            self.image_build.result()
        return self.image_ref

    def cli(self, *args: str, env: dict | None = None, timeout: float = 120,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess:
        if "--profile" in args and any(w in args[args.index("--profile") + 1] for w in ("podman", "docker")):
            self.podman_image  # noqa: B018 - the job's containers need the image
        return subprocess.run([sys.executable, "-m", "hpc_verl", *args], env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, cwd=str(cwd or self.dir))

    def slurm(self, *cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=60)

    def job_state(self, job_id: int) -> str:
        from hpc_verl.launch.backends import slurm

        info = slurm.job_info(job_id, env=self.env)
        return info.state if info else "UNKNOWN"

    def wait_state(self, job_id: int, states: set[str], timeout_s: float = 240) -> str:
        """Poll until the job reaches one of ``states`` (a hang fails the test here)."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(1)
        raise AssertionError(f"job {job_id} still {state} after {timeout_s}s (wanted {states})")

    def wait_requeue_settled(self, job_id: int, timeout_s: float = 60) -> None:
        """Until a requeued job's first run has fully ended (job PENDING, no node still completing).

        SLURM holds a requeued job for a BeginTime delay; release it only after this, else slurmd
        refuses the start ("credential revoked") - what the delay avoids on a real cluster."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            nodes = self.slurm("sinfo", "-h", "-N", "-o", "%t").stdout.split()
            if self.job_state(job_id) == "PENDING" and not any(n.startswith("comp") for n in nodes):
                return
            time.sleep(0.5)

    def release_requeued(self, job_id: int, run_dir: str, before_release: Callable[[], None] | None = None) -> None:
        """Let a requeued job's next run start now, not after SLURM's requeue delay (2 min), unless it
        started already. Whether it did is the batch log's header of run 1, not the job's state: the job
        counts its restart when the script asks for the requeue and stays RUNNING while the script cleans
        up, and a test that took that for the next run waited out the whole delay."""
        from hpc_verl.launch.backends import slurm

        log = Path(run_dir + ".out")
        if log.exists() and f"({job_id}), run 1" in log.read_text(errors="replace"):
            return
        self.wait_requeue_settled(job_id)
        if before_release is not None:
            before_release()
        time.sleep(2)
        slurm.release_requeued(job_id, env=self.env)


#: run once in a fresh image: reads what a node's Ray start reads under a bound (the raylet and GCS binaries,
#: the dashboard agent's imports), so that a first job's raylet, on a loaded machine, does not miss Ray's
#: 30 s registration bound reading a cold multi-GB layer
WARM_CODE = ("import glob, os, ray, ray.dashboard.agent, hpc_verl.bootstrap.node; "
             "[open(p, 'rb').read() for p in glob.glob(os.path.join(os.path.dirname(ray.__file__), 'core', 'src', "
             "'ray', '*', '*')) if os.path.isfile(p)]")


def _build_and_warm(tree, tar: Path) -> str:
    from hpc_verl.testbed.image import PODMAN_GLOBAL, PODMAN_RUN, build_image

    ref = build_image(sys.executable, tree, tar)
    warm = subprocess.run(["podman", *PODMAN_GLOBAL, "run", "--rm", *PODMAN_RUN, "--network", "host", "--env",
                           f"PYTHONPATH={REPO}", ref, sys.executable, "-c", WARM_CODE],
                          capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, f"the podman image cannot import Ray and the project: {warm.stderr[-1500:]}"
    return ref


def _short_tmp() -> str:
    # Ray's Unix sockets live under the temp root: keep it short
    return tempfile.mkdtemp(prefix="hpcvt", dir="/tmp")


@pytest.fixture(scope="session")
def slurm_testbed():
    from hpc_verl.testbed import TestBed
    from hpc_verl.testbed.profiles import write_profiles

    for tool in ("slurmctld", "slurmd", "munged", "sbatch"):
        if not (shutil.which(tool) or os.path.exists(f"/usr/sbin/{tool}")):
            pytest.fail(f"{tool} missing: run 'bash scripts/setup.sh' (the README's test command does)")
    given = os.environ.get("HPC_VERL_TESTBED_DIR")
    bed_dir = Path(given) if given else Path(tempfile.mkdtemp(prefix="hpcv-testbed-"))
    bed = TestBed(bed_dir)
    owned = not bed.is_up()
    bed.up()
    temp_root = _short_tmp()
    image = build = tar = None
    pool = ThreadPoolExecutor(max_workers=1)
    if shutil.which("podman"):
        from hpc_verl.testbed.image import image_ref, image_tree

        tree = image_tree(sys.executable)
        image = image_ref(tree)
        tar = Path(tempfile.mkdtemp(prefix="hpcv-image-")) / "rootfs.tar"
        build = pool.submit(_build_and_warm, tree, tar)
    prof_dir = write_profiles(bed_dir / "profiles", sys.executable, temp_root=temp_root, image=image,
                              readiness_timeout_s=90)
    home = bed_dir / "home"
    env = {**os.environ, **bed.env(), "HPC_VERL_HOME": str(home), "HPC_VERL_PROFILE_PATH": str(prof_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for k in ("HPC_VERL_FAULT", "HPC_VERL_FAULT_NODE", "RAY_ADDRESS"):
        env.pop(k, None)
    b = Bed(bed_dir, env, temp_root, image, build, tar)
    try:
        yield b
    finally:
        pool.shutdown(wait=True)
        if tar is not None:
            shutil.rmtree(tar.parent, ignore_errors=True)
        if owned:
            bed.down()
            shutil.rmtree(bed_dir, ignore_errors=True)
        shutil.rmtree(temp_root, ignore_errors=True)


@dataclass
class DockerBed:
    """The test bed's own Docker daemon and the image in it (``testbed-docker-local`` uses them)."""

    daemon: object  # hpc_verl.testbed.docker.DockerDaemon
    image: str
    profile: str = "testbed-docker-local"

    @property
    def host(self) -> str:
        return self.daemon.host

    def names(self) -> list[str]:
        """Names of every container the daemon has (running or not)."""
        out = self.daemon.docker("ps", "-a", "--format", "{{.Names}}")
        assert out.returncode == 0, out.stderr
        return out.stdout.split()


@pytest.fixture(scope="session")
def docker_testbed(slurm_testbed):
    """A dockerd of the test bed's own (data, exec root, socket and pid file in a temp dir), the test bed's
    image loaded into it and ``testbed-docker-local`` written beside the other profiles; stopped and
    removed at the end (a system daemon is never touched)."""
    import yaml

    from hpc_verl.testbed.docker import DockerDaemon
    from hpc_verl.testbed.image import docker_image
    from hpc_verl.testbed.profiles import write_profiles

    bed = slurm_testbed
    if not (shutil.which("dockerd") or os.path.exists("/usr/sbin/dockerd")):
        pytest.fail("dockerd missing: run 'bash scripts/setup.sh' (apt: docker.io)")
    daemon = DockerDaemon(tempfile.mkdtemp(prefix="hpcvd", dir="/tmp"))
    try:
        daemon.start()
        image = docker_image(daemon, sys.executable, podman_ref=bed.podman_image, tar=bed.image_tar)
        if bed.image_tar is not None:  # (its only reader)
            bed.image_tar.unlink(missing_ok=True)
        # the image runs and holds Ray's agents; reading them once also warms the fresh layer's files, so
        # that a first job's dashboard agent does not miss the raylet's start bound on a loaded machine
        warm = daemon.docker("run", "--rm", "--network", "host", "--env", f"PYTHONPATH={REPO}", image,
                             sys.executable, "-c", WARM_CODE, timeout_s=600)
        assert warm.returncode == 0, f"the docker image cannot import Ray and the project: {warm.stderr[-1500:]}"
        prof_dir = bed.dir / "profiles"
        ray = yaml.safe_load((prof_dir / "testbed-local.yaml").read_text())["ray"]
        write_profiles(prof_dir, sys.executable, temp_root=bed.temp_root, image=image,
                       readiness_timeout_s=ray["readiness_timeout_s"], port_base=ray["port_base"],
                       docker_host=daemon.host)
        yield DockerBed(daemon, image)
    finally:
        daemon.remove(background=True)  # (its multi-GB image takes minutes to delete: not in the last test's time)


# ----------------------------------------------------------------------------- leftovers
def _listen_inodes() -> dict[str, int]:
    """{socket inode: port} of every TCP socket listening here."""
    out = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A":  # LISTEN
                out[f[9]] = int(f[1].rsplit(":", 1)[1], 16)
    return out


def _listening_ports() -> set[int]:
    return set(_listen_inodes().values())


def leftovers(job_dir: str, job_id: int, wait_s: float = 30, docker_host: str | None = None) -> list[str]:
    """Ray processes, containers, listening ports or Ray temp dirs of this job still around (empty = clean).

    Polls up to ``wait_s``: SLURM finishes a job's steps shortly after it reports the state.
    """
    from hpc_verl.util import procs

    deadline = time.monotonic() + wait_s
    while True:
        found: list[str] = []
        ray = Path(job_dir) / "ray" / "nodes"
        for p in sorted(ray.glob("*.json")) if ray.exists() else []:
            st = json.loads(p.read_text())
            for pid in [st.get("supervisor_pid"), st.get("raylet_pid"), *st.get("ray_pids", [])]:
                if pid and procs.alive(pid) and st.get("role") and not _in_container(st):
                    found.append(f"{p.stem}: pid {pid} ({procs.comm(pid)}) alive")
            if st.get("temp_dir") and Path(st["temp_dir"]).exists():
                found.append(f"{p.stem}: Ray temp dir {st['temp_dir']} left")
            ports = st.get("ports") or {}
            if ports:
                mine = set(range(ports["block_start"], ports["block_start"] + 100))
                busy = sorted(mine & _listening_ports())
                if busy:
                    found.append(f"{p.stem}: ports {busy} still listening")
        if shutil.which("podman"):
            out = subprocess.run(["podman", "--runtime", "runc", "--cgroup-manager=cgroupfs", "ps", "-a",
                                  "--format", "{{.Names}}"], capture_output=True, text=True).stdout.split()
            found += [f"container {n}" for n in out if n.startswith(f"hpcv-{job_id}-")]
        if docker_host:
            out = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}}"], capture_output=True, text=True,
                                 env={**os.environ, "DOCKER_HOST": docker_host}).stdout.split()
            found += [f"docker container {n}" for n in out if n.startswith(f"hpcv-{job_id}-")]
        if not found or time.monotonic() > deadline:
            log = Path(job_dir) / "logs" / "containers.log"
            if any(f.startswith(("container", "docker container")) for f in found) and log.exists():
                found.append("containers.log ends: " + " | ".join(log.read_text(errors="replace").splitlines()[-8:]))
            return found
        time.sleep(1)


def _in_container(state: dict) -> bool:
    # pids recorded inside a container's PID namespace mean nothing on the host; the container check covers them
    return bool(state.get("in_container"))
