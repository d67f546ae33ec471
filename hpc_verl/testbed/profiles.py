"""Profiles for this machine's test bed, generated next to it (put on HPC_VERL_PROFILE_PATH).

They extend the shipped ``testbed`` / ``testbed-podman`` profiles with what only
this machine knows: the Python that has Ray and the project, the podman image
built here (which holds them), a short Ray temp root, and a port base below
the kernel's ephemeral range. The test bed is loopback-only by nature (both
slurmd on one host), hence ``network.allow_loopback: true`` in the shipped ones.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

from hpc_verl.util.fs import atomic_write_text

REPO = Path(__file__).resolve().parents[2]


def write_profiles(directory: str | Path, python: str | None = None, temp_root: str = "/tmp/hpcv-tb",
                   image: str | None = None, readiness_timeout_s: int = 60) -> Path:
    """Write ``testbed-local.yaml`` (and ``testbed-podman-local.yaml`` when ``image``); returns the dir."""
    d = Path(directory)
    py = python or sys.executable
    ray = {"python": py, "port_base": 20000, "port_stride": 100, "port_slots": 120,
           "temp_dir_root": temp_root, "readiness_timeout_s": readiness_timeout_s}
    env = {"vars": {"PYTHONPATH": str(REPO)}}
    local = {"description": "this machine's SLURM test bed, no container (generated)", "extends": "testbed",
             "ray": ray, "env": env}
    atomic_write_text(d / "testbed-local.yaml", yaml.safe_dump(local, sort_keys=False))
    if image:
        pod = {"description": "this machine's SLURM test bed, podman (generated)", "extends": "testbed-podman",
               "container": {"image": image}, "ray": ray, "env": env}
        atomic_write_text(d / "testbed-podman-local.yaml", yaml.safe_dump(pod, sort_keys=False))
    return d
