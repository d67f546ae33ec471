"""Run rendered scripts against FAKE srun/scontrol/sbatch and FAKE container runtimes (tests/fakebin).

What is faked and why: GPUs, InfiniBand and image registries do not exist here, and these tests are
about what the *script* does with the values it was given (quoting, stages, traps), so the cluster
commands are small recording stand-ins. The real SLURM/podman end-to-end runs belong to the SLURM
test bed (tests marked ``slurm``).
"""
from __future__ import annotations

import os
import shlex
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hpc_verl.launch.spec.launch_plan import build_plan

FAKEBIN = Path(__file__).resolve().parent / "fakebin"
JOB_ID = "4242"


@dataclass
class FakeRun:
    rc: int
    stdout: str
    stderr: str
    log: list[str]
    submit_dir: Path

    @property
    def run_dir(self) -> Path:
        return self.submit_dir / "jobs" / f"hpcv-{JOB_ID}"

    def calls(self, prog: str) -> list[list[str]]:
        """argv (after the program name) of every recorded call of ``prog``."""
        out = []
        for line in self.log:
            parts = shlex.split(line)
            if parts and parts[0] == prog:
                out.append(parts[1:])
        return out


class FakeCluster:
    """A submit directory, a short Ray temp root and the environment SLURM would give a batch script."""

    def __init__(self, root: Path):
        self.submit_dir = root / "submit"
        self.submit_dir.mkdir(parents=True)
        # Ray temp roots must be short (Unix socket paths): a fresh directory directly under /tmp
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="hv", dir="/tmp"))
        self.log = root / "fake.log"

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.ray_tmp, ignore_errors=True)

    def profile_sets(self) -> list[str]:
        return [f"ray.python={FAKEBIN / 'python'}", f"ray.temp_dir_root={self.ray_tmp}",
                "ray.readiness_timeout_s=30", "container.start_timeout_s=30"]

    def render(self, profile: str, sets: list[str] | None = None, job: str | None = None,
               overrides: list[str] | None = None) -> Path:
        plan = build_plan(profile, job, overrides, profile_overrides=[*self.profile_sets(), *(sets or [])])
        return plan.write(self.submit_dir / "job.sbatch")

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "HPCV_", "FAKE_"))}
        env.update({
            "PATH": f"{FAKEBIN}:{env.get('PATH', '/usr/bin:/bin')}",
            "FAKE_LOG": str(self.log),
            "FAKE_NODES": "node1 node2",
            "SLURM_JOB_ID": JOB_ID,
            "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_SUBMIT_DIR": str(self.submit_dir),
        })
        env.update(extra)
        return env

    def popen(self, script: Path, **extra: str) -> subprocess.Popen:
        return subprocess.Popen(["bash", str(script)], cwd=self.submit_dir, env=self.env(**extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, script: Path, timeout: float = 60, **extra: str) -> FakeRun:
        proc = self.popen(script, **extra)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"script did not finish in {timeout}s; stderr:\n{err}")
        return self.result(proc.returncode, out, err)

    def result(self, rc: int, out: str, err: str) -> FakeRun:
        log = self.log.read_text().splitlines() if self.log.exists() else []
        return FakeRun(rc, out, err, log, self.submit_dir)
