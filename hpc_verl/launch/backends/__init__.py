"""Where jobs run: one interface (``base.Backend``), one module per backend, chosen by name.

``for_request`` picks the backend that runs a submission (each is asked whether
it ``accepts`` the request, in ``BACKENDS`` order); ``for_record`` the one that
answers for a registered job (by its ``scheduler``). Nothing outside this
package calls sbatch, squeue, scancel, a container runtime or the Ray Jobs API.

Adding a backend: a module here with a ``Backend`` subclass, and its line in
``BACKENDS`` (docs/development.md shows it with the Ray Jobs backend).
"""
from __future__ import annotations

import importlib
from functools import lru_cache

from hpc_verl.errors import ConfigError, SubmitError
from hpc_verl.launch.backends.base import Backend, DryRun, JobInfo, JobState, SubmitRequest
from hpc_verl.launch.registry import JobRecord

__all__ = ["BACKENDS", "Backend", "DryRun", "JobInfo", "JobState", "SubmitRequest", "for_record",
           "for_request", "get"]

# JobRecord.scheduler -> "module:Class" (imported when first used, so `hpc-verl --help` stays light).
# The order is the order in which backends are asked whether they accept a submission.
BACKENDS: dict[str, str] = {
    "rayjob": "hpc_verl.launch.backends.rayjobs:RayJobsBackend",
    "slurm": "hpc_verl.launch.backends.slurm:SlurmBackend",
    "submitit": "hpc_verl.launch.backends.slurm:SubmititBackend",
    "local": "hpc_verl.launch.backends.local:LocalBackend",
}


@lru_cache(maxsize=None)
def get(scheduler: str) -> Backend:
    """The backend registered as ``scheduler``."""
    target = BACKENDS.get(scheduler)
    if target is None:
        raise SubmitError(f"no backend '{scheduler}' in this hpc-verl (known: {', '.join(BACKENDS)}); "
                          "a job recorded by another version needs that version")
    module, _, name = target.partition(":")
    backend = getattr(importlib.import_module(module), name)()
    assert backend.scheduler == scheduler, f"{target} is registered as {scheduler!r}, says {backend.scheduler!r}"
    return backend


def for_record(record: JobRecord) -> Backend:
    """The backend that ran a registered job."""
    return get(record.scheduler)


def for_request(request: SubmitRequest) -> Backend:
    """The backend that runs ``request``: the first in ``BACKENDS`` that accepts it (``--resume``:
    the one that ran that job)."""
    if request.resume:
        from hpc_verl.launch import registry

        backend = for_record(registry.find(request.resume))
        if not backend.resumes:
            raise SubmitError(f"job {request.resume} ran on {backend.scheduler}, which resumes its own jobs (a SLURM "
                              "job requeues and continues in its run directory); to continue it elsewhere, "
                              "submit a new job with trainer.resume_mode=resume_path and "
                              "trainer.resume_from_path=<its global_step_N>")
        return backend
    for scheduler in BACKENDS:
        backend = get(scheduler)
        if backend.accepts(request):
            return backend
    if not request.profile:
        raise ConfigError("submit needs --profile NAME (a SLURM profile, or 'local' for this machine; see "
                          "'hpc-verl profiles list'), or --ray-address URL / --cluster JOB for a running Ray cluster")
    raise ConfigError(f"no backend runs profile {request.profile} (backends: {', '.join(BACKENDS)}); "
                      "check its 'scheduler'")
