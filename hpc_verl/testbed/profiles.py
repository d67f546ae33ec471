"""Profiles for this machine's test bed, generated next to it (put on HPC_VERL_PROFILE_PATH).

They extend the shipped ``testbed`` / ``testbed-podman`` profiles with what only
this machine knows: the Python that has Ray and the project, the podman image
built here (which holds them; the docker profile also names the test bed's own daemon), a short Ray temp root, and Ray ports below the
kernel's ephemeral range. Every test bed numbers its jobs from 1, so two test
beds on one machine (several people running the suite) would give job N the same
port block at the same moment; each bed therefore gets its own range of
``PORT_SLOTS`` blocks, picked at random (the node's port probe handles the rest).
The test bed is loopback-only by nature (both slurmd on one host), hence
``network.allow_loopback: true`` in the shipped ones.

Each of them has a CPU twin for upstream verl with its engines (``testbed-cpu``,
``testbed-cpu-podman``, ``testbed-cpu-docker``): ``accelerator: none``, all of the
test bed's nodes (``CPU_NODES``), no GPUs, both CPUs of a node to its task.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import yaml

from hpc_verl.util.fs import atomic_write_text

REPO = Path(__file__).resolve().parents[2]
PORT_STRIDE = 100
PORT_SLOTS = 10  # a bed runs a few jobs at once; ids wrap within its own range
CPU_NODES = 2
#: what the CPU twins change: verl's CPU platform, one rank per node (see hpc_verl.verl_upstream.cpu), and a
#: longer Ray readiness bound: a node's first start from the multi-GB engine image reads it cold, and a raylet
#: that misses Ray's own 30 s registration bound is started again (hpc_verl.bootstrap.node)
CPU_READINESS_S = 240
CPU = {"accelerator": "none", "slurm": {"nodes": CPU_NODES, "gpus_per_node": 0, "cpus_per_task": 2},
       "ray": {"readiness_timeout_s": CPU_READINESS_S}}


def write_profiles(directory: str | Path, python: str | None = None, temp_root: str = "/tmp/hpcv-tb",
                   image: str | None = None, readiness_timeout_s: int = 60, port_base: int | None = None,
                   docker_host: str | None = None) -> Path:
    """Write ``testbed-local.yaml`` (and ``testbed-podman-local.yaml`` when ``image``; with ``docker_host``
    too, ``testbed-docker-local.yaml``: the same image in the Docker daemon at that ``DOCKER_HOST``);
    returns the dir.

    ``port_base``: the bed's first Ray port (default: one of 22000..31000 in steps of a
    thousand, at random: below the kernel's ephemeral ports, and above the blocks of the
    first jobs of a bed laid out with the schema's defaults, 20000 + job id x 100)."""
    d = Path(directory)
    py = python or sys.executable
    if port_base is None:
        port_base = 20000 + PORT_SLOTS * PORT_STRIDE * random.SystemRandom().randrange(2, 12)
    ray = {"python": py, "port_base": port_base, "port_stride": PORT_STRIDE, "port_slots": PORT_SLOTS,
           "temp_dir_root": temp_root, "readiness_timeout_s": readiness_timeout_s}
    env = {"vars": {"PYTHONPATH": str(REPO)}}
    local = {"description": "this machine's SLURM test bed, no container (generated)", "extends": "testbed",
             "ray": ray, "env": env}
    atomic_write_text(d / "testbed-local.yaml", yaml.safe_dump(local, sort_keys=False))
    _cpu_twin(d, "testbed-cpu", "testbed-local", "no container")
    if image:
        pod = {"description": "this machine's SLURM test bed, podman (generated)", "extends": "testbed-podman",
               "container": {"image": image}, "ray": ray, "env": env}
        atomic_write_text(d / "testbed-podman-local.yaml", yaml.safe_dump(pod, sort_keys=False))
        _cpu_twin(d, "testbed-cpu-podman", "testbed-podman-local", "podman")
    if image and docker_host:
        dock = {"description": "this machine's SLURM test bed, docker (generated)", "extends": "testbed-docker",
                "container": {"image": image}, "ray": ray,
                "env": {"vars": {**env["vars"], "DOCKER_HOST": docker_host}}}
        atomic_write_text(d / "testbed-docker-local.yaml", yaml.safe_dump(dock, sort_keys=False))
        _cpu_twin(d, "testbed-cpu-docker", "testbed-docker-local", "docker")
    return d


def _cpu_twin(d: Path, name: str, base: str, how: str) -> None:
    twin = {"description": f"this machine's SLURM test bed, {CPU_NODES} CPU nodes for upstream verl, {how} "
                           "(generated)", "extends": base, **CPU}
    atomic_write_text(d / f"{name}.yaml", yaml.safe_dump(twin, sort_keys=False))
