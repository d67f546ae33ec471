"""Shared test fixtures. Service fixtures (SLURM test bed, Ray) live in their own modules."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cwd: str | os.PathLike[str] | None = None, env: dict | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``hpc-verl`` as a user would: a separate process, text output."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full_env.get("PYTHONPATH")]))
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-m", "hpc_verl", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_bed import slurm_testbed  # noqa: E402,F401  (session fixture for -m slurm tests)
