"""A non-editable install ships the templates and profiles and works from any directory."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_in_fresh_venv_lists_and_renders(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "jobs", "runs",
        ".testbed", "tests"))
    import os

    # no PYTHONPATH pointing at the checkout: pip would think hpc_verl is already installed
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(src), "-w", str(wheels)],
                   check=True, capture_output=True, text=True, env=clean)
    (wheel,) = wheels.glob("hpc_verl-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # the light dependencies (jinja2, pyyaml, rich, submitit) come from the package index
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                          str(wheel)], capture_output=True, text=True, env=clean)
    assert res.returncode == 0, res.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    res = subprocess.run([str(venv / "bin" / "hpc-verl"), "profiles", "list", "--json"], cwd=elsewhere, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    import json

    listed = json.loads(res.stdout)
    assert {p["name"] for p in listed} >= {"local", "ib-a100", "roce-h100", "eth-l40s", "mi300x-rocm",
                                           "pyxis-h100", "testbed-podman", "testbed-docker"}
    assert all(p["origin"] == "shipped" and str(venv) in p["path"] for p in listed)
    res = subprocess.run([str(venv / "bin" / "hpc-verl"), "render", "--profile", "ib-a100"], cwd=elsewhere, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("#!/bin/bash") and "#SBATCH --gpus-per-node=8" in res.stdout
    res = subprocess.run([str(venv / "bin" / "python"), "-c", "import hpc_verl; print(hpc_verl.__file__)"],
                         cwd=elsewhere, env=env, capture_output=True, text=True)
    assert str(venv) in res.stdout
