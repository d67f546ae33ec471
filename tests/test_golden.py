"""Golden files: the exact render of every shipped profile (and one job config).

Regenerate after an intended template change with
``UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py`` and review the diff in git.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from hpc_verl.launch.spec.launch_plan import build_plan
from hpc_verl.profiles import list_profiles

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
SHIPPED = ["eth-l40s", "ib-a100", "local", "mi300x-rocm", "pyxis-h100", "roce-h100", "testbed", "testbed-docker",
           "testbed-podman"]
CASES = {name: (name, None, []) for name in SHIPPED}
CASES["ib-a100-job"] = ("ib-a100", str(HERE / "data" / "job_example.yaml"), ["trainer.total_epochs=3"])


@pytest.fixture(autouse=True)
def _isolated_search_path(tmp_path, monkeypatch):
    # only the shipped profiles: no ./cluster_profiles, user dir or env path of the machine
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HPC_VERL_PROFILE_PATH", raising=False)


def test_every_shipped_profile_has_a_golden_file():
    assert [i.name for i in list_profiles()] == SHIPPED
    assert sorted(p.stem for p in GOLDEN.glob("*.sbatch")) == sorted(CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_render_matches_golden(case):
    profile, job, overrides = CASES[case]
    text = build_plan(profile, job, overrides).script
    # the job path appears only as provenance in the plan, never in the script: keep renders machine-free
    assert str(HERE) not in text and os.path.expanduser("~") + "/" not in text
    path = GOLDEN / f"{case}.sbatch"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
        return
    assert path.exists(), f"{path} is missing; run with UPDATE_GOLDEN=1 to create it"
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            fromfile=f"golden/{case}.sbatch", tofile="rendered"))
        pytest.fail(f"render of {case} differs from its golden file (UPDATE_GOLDEN=1 to accept):\n{diff}")


def test_render_is_deterministic():
    a = build_plan("ib-a100").script
    b = build_plan("ib-a100").script
    assert a == b
