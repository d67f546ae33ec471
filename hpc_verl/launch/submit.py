"""The Python API: ``hpc_verl.submit(...)``, the same submission as ``hpc-verl submit``.

A SLURM profile goes through submitit and returns a ``submitit.Job`` whose
function runs our rendered batch script once on the first node of the
allocation, so the Ray bootstrap is the same code path; with ``ray_address`` the
job goes to that running Ray cluster through its Jobs API and the return value
is a ``RayJobHandle`` (state, logs(), wait(), stop()). Both are recorded in the
registry like CLI submissions.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from hpc_verl.errors import ConfigError
from hpc_verl.launch import backends
from hpc_verl.launch.backends.base import SubmitRequest


def submit(profile: Optional[str] = None, config: Optional[str] = None, overrides: Sequence[str] = (),
           sets: Sequence[str] = (), name: Optional[str] = None, *, ray_address: Optional[str] = None,
           ray_token_file: Optional[str] = None, command: Sequence[str] = ()) -> Any:
    """Submit a job; returns a ``submitit.Job`` (SLURM) or a ``RayJobHandle`` (``ray_address``).
    ``command``: the trainer command line (``["python3", "-m", "verl.trainer.main_ppo", "k=v", ...]``),
    as after ``--`` on the command line."""
    request = SubmitRequest(profile=profile, config=config, overrides=tuple(overrides), sets=tuple(sets), name=name,
                            ray_address=ray_address, ray_token_file=ray_token_file, command=tuple(command))
    if ray_address:
        rayjob = backends.get("rayjob")
        return rayjob.handle(rayjob.submit(rayjob.dryrun(request)))
    if not profile:
        raise ConfigError("submit() needs a profile name (or ray_address=... for a running Ray cluster)")
    if not backends.get("slurm").accepts(request):
        raise ConfigError(f"submit(): profile {profile} does not use SLURM; run it with "
                          "'hpc-verl submit --profile ...' (or backends.for_request(...).submit(...))")
    submitit = backends.get("submitit")
    return submitit.submit_job(submitit.dryrun(request))[1]
