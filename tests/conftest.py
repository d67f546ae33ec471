"""Shared test fixtures. Service fixtures (SLURM test bed, Ray) live in their own modules."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# No test reaches the Hugging Face hub: models are built from a config, data is written by the tests.
# Set before any test module imports huggingface_hub, which reads the variable once, at import: a
# model named by its hub id then fails at once instead of after the hub client's retries (23 s a model).
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


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
from slurm_bed import docker_testbed, slurm_testbed  # noqa: E402,F401  (session fixtures for -m slurm tests)


@pytest.hookimpl(tryfirst=True)      # before xdist's own hook, which turns the marks into node-id suffixes
def pytest_collection_modifyitems(config, items):
    """Groups for pytest-xdist's ``--dist loadgroup`` (scripts/test.sh runs two workers). Every
    test on the SLURM test bed goes to one worker: the bed is a session fixture, and one bed per
    worker would start two slurmctlds and build the podman image twice. Every other test stays
    with its file, so a module fixture (a Ray cluster, a trained run) is built once.

    Order (scripts/test.sh keeps it with --no-loadscope-reorder): the bed's group first, as it is
    the longest and runs on one worker while the other takes the rest; then files with slow tests,
    then the others, so that the short ones fill the end on both workers."""
    def group(item) -> str:
        return "slurm_testbed" if "slurm_testbed" in item.fixturenames else item.nodeid.split("::")[0]

    slow_groups = {group(item) for item in items if item.get_closest_marker("slow")}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=lambda item: (group(item) != "slurm_testbed", group(item) not in slow_groups))


def pytest_xdist_node_collection_finished(node, ids):
    """The groups above exist only as '@group' suffixes of the ids a worker collected. Without them
    xdist spreads the bed's tests over both workers, each starting a test bed of its own (pytest 9.2
    keeps node ids where pytest-xdist 3.8 cannot add the suffix): stop before any test runs."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        pytest.exit("tests: pytest-xdist did not apply the test groups (its loadgroup needs pytest < 9.2): "
                    "pip install 'pytest<9.2'", returncode=3)


@pytest.fixture(autouse=True)
def _restore_environ():
    """Code under test may export variables (the bootstrap's barrier sets RAY_AUTH_* for its
    own process); keep them from leaking into later tests in this process."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)
