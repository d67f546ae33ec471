"""Where the installed package lives, for the files it ships and the jobs it starts."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""``hpc_verl/``: ``templates/`` and ``cluster_profiles/`` link here so that a wheel ships them."""


def with_package_on_pythonpath(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this package's parent first on ``PYTHONPATH`` (a job's processes import this copy)."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_DIR.parent), env.get("PYTHONPATH")]))
    return env
