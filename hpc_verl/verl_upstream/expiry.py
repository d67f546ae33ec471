"""The job's time limit as upstream verl's "capacity block expiry", kept current.

verl 0.9.1 saves a checkpoint before its machines go away when
``should_save_ckpt_esi`` (``verl/utils/checkpoint/checkpoint_manager.py``) says
so: it reads ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (Unix time in
seconds, a float, compared with ``time.time()``) and saves once
``remaining <= 60 + longest step + trainer.esi_redundant_time``. The batch
script exports that variable from SLURM's real end time of the job
(``squeue -o %e``) on every node before ``ray start`` and rewrites
``$HPCV_EXPIRY_FILE`` when the end moves (``scontrol update TimeLimit=...``).

verl reads the variable with ``os.getenv`` in its TaskRunner, a Ray actor whose
environment was fixed when it started. So the launcher names
:func:`runtime_env_hook` in ``RAY_RUNTIME_ENV_HOOK`` for the trainer process:
Ray calls it in ``ray.init`` and it adds :func:`follow_expiry_file` as the
job's ``worker_process_setup_hook``, which keeps ``os.environ`` of every Ray
worker of the job in step with the file.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

#: The variable verl 0.9.1 checks first (its AWS twin, SAGEMAKER_..., is only read when this one is unset).
EXPIRY_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
#: The file the batch script keeps current (one line: Unix seconds of the job's end).
EXPIRY_FILE_ENV = "HPCV_EXPIRY_FILE"
#: How often the batch script asks SLURM, and the workers look at the file (seconds).
POLL_ENV = "HPCV_EXPIRY_POLL_S"
POLL_DEFAULT_S = 60.0  # one squeue per job per minute: gentle on slurmctld; TimeLimit changes are rare
SETUP_HOOK = f"{__name__}.follow_expiry_file"
RUNTIME_ENV_HOOK = f"{__name__}.runtime_env_hook"
#: verl's own estimate of one save (``should_save_ckpt_esi(save_ckpt_duration=60)``).
VERL_SAVE_ESTIMATE_S = 60


def read_expiry(path: str | os.PathLike[str] | None) -> float | None:
    """The end time in the file (Unix seconds), or None when there is no readable one."""
    if not path:
        return None
    try:
        with open(path) as fh:
            return float(fh.read().strip())
    except (OSError, ValueError):
        return None


def poll_interval_s(env: Any = None) -> float:
    env = os.environ if env is None else env
    try:
        value = float(env.get(POLL_ENV, POLL_DEFAULT_S))
    except ValueError:
        return POLL_DEFAULT_S
    return value if value > 0 else POLL_DEFAULT_S


def refresh_environ(path: str | os.PathLike[str] | None, environ: Any = None) -> bool:
    """Set ``EXPIRY_ENV`` from the file when it says something new; True when it changed."""
    environ = os.environ if environ is None else environ
    end = read_expiry(path)
    if end is None:
        return False
    text = f"{end:.0f}" if end.is_integer() else repr(end)
    if environ.get(EXPIRY_ENV) == text:
        return False
    environ[EXPIRY_ENV] = text
    return True


_follower: threading.Thread | None = None


def follow_expiry_file() -> None:
    """Ray ``worker_process_setup_hook``: keep this worker's ``EXPIRY_ENV`` in step with the file.

    A daemon thread re-reads the file (a few bytes) every few seconds; without
    ``$HPCV_EXPIRY_FILE`` (not a SLURM job) it does nothing.
    """
    global _follower
    path = os.environ.get(EXPIRY_FILE_ENV)
    if not path or (_follower is not None and _follower.is_alive()):
        return
    refresh_environ(path)
    interval = min(poll_interval_s(), 5.0)

    def loop() -> None:
        while True:
            time.sleep(interval)
            refresh_environ(path)

    _follower = threading.Thread(target=loop, name="hpcv-expiry", daemon=True)
    _follower.start()


def runtime_env_hook(runtime_env: dict | None) -> dict:
    """``RAY_RUNTIME_ENV_HOOK``: add :func:`follow_expiry_file` to the job's runtime env.

    A ``worker_process_setup_hook`` the job already has is kept (Ray allows one),
    and then the workers see the end time as it was when Ray started on their node.
    """
    env = dict(runtime_env or {})
    if not env.get("worker_process_setup_hook"):
        env["worker_process_setup_hook"] = SETUP_HOOK
    return env


def derived_overrides(signal_lead_s: int) -> list[tuple[str, str]]:
    """verl keys the launcher sets for an upstream job (unless the job sets them), with why.

    ``trainer.esi_redundant_time`` = the profile's signal lead: verl then starts
    its expiry save more than ``60 s + lead`` before the end, so the save is done
    when SLURM's preemption signal (``lead`` seconds before the end) arrives.
    """
    return [("trainer.resume_mode", "auto"), ("trainer.esi_redundant_time", str(int(signal_lead_s)))]
