"""What ``scripts/testbed.sh up`` sets up beside the SLURM daemons, so that a person can run a
test's job by hand: the test bed's image (with the engines when this Python has them), a Docker
daemon of the bed's own with that image, and the bed's profiles (``testbed-local``,
``testbed-podman-local``, ``testbed-docker-local`` and their CPU twins ``testbed-cpu``,
``testbed-cpu-podman``, ``testbed-cpu-docker``) in ``<bed dir>/profiles``. ``testbed.sh env``
prints the ``HPC_VERL_PROFILE_PATH`` that finds them. A missing podman or dockerd leaves its
profiles out, with a line that says so.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from hpc_verl.testbed.cluster import TestBed

#: the Ray temp root of the bed's profiles (short: Ray's Unix sockets live below it)
TEMP_ROOT = "/tmp/hpcv-tb"


def profile_dir(bed: TestBed) -> Path:
    return bed.dir / "profiles"


def docker_dir(bed: TestBed) -> Path:
    return bed.dir / "docker"


def _have(tool: str) -> bool:
    return bool(shutil.which(tool) or os.path.exists(f"/usr/sbin/{tool}"))


def provision(bed: TestBed, python: str | None = None, say: Callable[[str], None] = print) -> Path:
    """Build (or reuse) the image, start the bed's Docker daemon with it, write the profiles; returns
    the profile directory."""
    from hpc_verl.testbed.image import build_image, docker_image
    from hpc_verl.testbed.profiles import write_profiles

    py = python or sys.executable
    image = docker_host = None
    if _have("podman"):
        t0 = time.monotonic()
        say("test bed: building the node image (reused when this Python's packages did not change)...")
        tar = bed.dir / "image-rootfs.tar"  # one tar for podman and Docker, removed once both have it
        image = build_image(py, keep_tar=tar)
        say(f"test bed: image {image} ({time.monotonic() - t0:.0f} s)")
    else:
        say("test bed: no podman: the podman and docker profiles are left out")
    if image and _have("dockerd") and os.geteuid() == 0:
        from hpc_verl.testbed.docker import DockerDaemon

        daemon = DockerDaemon(docker_dir(bed)).start()
        t0 = time.monotonic()
        docker_image(daemon, py, podman_ref=image, tar=tar)
        docker_host = daemon.host
        say(f"test bed: Docker daemon at {docker_host} holds the image ({time.monotonic() - t0:.0f} s)")
    elif image:
        say("test bed: no dockerd (or not root): the docker profiles are left out")
    if image:
        tar.unlink(missing_ok=True)
    prof = write_profiles(profile_dir(bed), py, temp_root=TEMP_ROOT, image=image, readiness_timeout_s=90,
                          docker_host=docker_host)
    say(f"test bed: profiles in {prof}: " + ", ".join(sorted(p.stem for p in prof.glob("*.yaml"))))
    return prof


def unprovision(bed: TestBed) -> None:
    """Stop the bed's Docker daemon (its containers go with it) and drop its directory."""
    if docker_dir(bed).exists():
        from hpc_verl.testbed.docker import DockerDaemon

        DockerDaemon(docker_dir(bed)).remove()
