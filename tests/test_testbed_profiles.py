"""The test bed's generated profiles and ``testbed.sh env``: what a person needs to run a test's job by
hand (no SLURM daemons started here: the profiles and the exports only)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_cpu_twins_are_two_cpu_nodes_of_each_runtime(tmp_path, monkeypatch):
    from hpc_verl.profiles.loader import load_profile
    from hpc_verl.testbed.profiles import write_profiles

    d = write_profiles(tmp_path / "profiles", "/opt/py/bin/python", image="localhost/hpc-verl-testbed:abc",
                       docker_host="unix:///tmp/x/docker.sock")
    monkeypatch.setenv("HPC_VERL_PROFILE_PATH", str(d))
    runtimes = {"testbed-cpu": "none", "testbed-cpu-podman": "podman", "testbed-cpu-docker": "docker"}
    for name, runtime in runtimes.items():
        p = load_profile(name)
        assert (p.accelerator, p.slurm.nodes, p.slurm.gpus_per_node, p.slurm.cpus_per_task) == ("none", 2, 0, 2), name
        assert p.container.runtime == runtime and p.ray.python == "/opt/py/bin/python", name
        assert p.ray.readiness_timeout_s == 240, name
        if runtime != "none":
            assert p.container.image == "localhost/hpc-verl-testbed:abc", name
    assert load_profile("testbed-cpu-docker").env.vars["DOCKER_HOST"] == "unix:///tmp/x/docker.sock"
    # without an image (no podman here) only the no-container profiles are written
    bare = write_profiles(tmp_path / "bare")
    assert sorted(p.stem for p in bare.glob("*.yaml")) == ["testbed-cpu", "testbed-local"]


def test_testbed_env_exports_the_slurm_conf_and_the_profile_path(tmp_path):
    bed = tmp_path / "bed dir"
    out = subprocess.run(["bash", str(REPO / "scripts" / "testbed.sh"), "env"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "HPC_VERL_TESTBED_DIR": str(bed),
                              "HPC_VERL_PYTHON": sys.executable}, timeout=60)
    assert out.returncode == 0, out.stderr
    got = subprocess.run(["bash", "-c", out.stdout + '\nprintf "%s\\n" "$SLURM_CONF" "$HPC_VERL_PROFILE_PATH"'],
                         capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert got == [str(bed / "slurm.conf"), str(bed / "profiles")]
