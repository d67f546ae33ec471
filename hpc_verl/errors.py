"""The project's small error hierarchy.

Every user-facing failure is an ``HpcVerlError``: the CLI prints its message as
one line and exits 2. Use ``assert`` only for internal invariants.
"""
from __future__ import annotations

import sys
from typing import Callable


class HpcVerlError(Exception):
    """A user error: one clear line (what, where, how to fix)."""

    exit_code = 2


class ProfileError(HpcVerlError):
    """A cluster profile is missing, malformed or inconsistent."""


class ConfigError(HpcVerlError):
    """A job or trainer config (file or override) is invalid."""


class RenderError(HpcVerlError):
    """A template could not be rendered or the result failed its checks."""


class SubmitError(HpcVerlError):
    """Submission to a scheduler (SLURM, Ray Jobs, local) failed."""


class JobNotFoundError(HpcVerlError):
    """A job id or name is not in the registry."""


class BootstrapError(HpcVerlError):
    """Bringing up Ray (or a node) inside a job failed."""


class DataError(HpcVerlError):
    """An input data file is missing or malformed."""


class DataflowError(HpcVerlError):
    """A dataflow graph is invalid or cannot be placed on the cluster."""


def report_errors(func: Callable[[], int]) -> int:
    """Run an entry point: a user error becomes one line on stderr and its exit code, no traceback.

    Shared by ``hpc-verl`` and ``python -m hpc_verl.trainer.main`` (which must not import the CLI).
    """
    try:
        return int(func() or 0)
    except HpcVerlError as exc:
        print(f"hpc-verl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("hpc-verl: interrupted", file=sys.stderr)
        return 130
