"""The job's size comes from the job: ``trainer.nnodes``/``trainer.n_gpus_per_node`` ask for the allocation.

A verl run script says how big it is (``trainer.nnodes=1 trainer.n_gpus_per_node=8``).
Those values become the profile's ``slurm.nodes``/``slurm.gpus_per_node`` (as if given
with ``--set``), unless the user set those with ``--set`` too; then both must agree.
A job that asks for more GPUs per node than the profile's nodes have is refused, naming
the ``--set`` that would say otherwise. One rule, used by every way a job is sent.
"""
from __future__ import annotations

from typing import Any, Sequence

from hpc_verl.errors import ConfigError

#: trainer key -> (profile key it asks for, what it counts)
SIZE_KEYS = (("trainer.nnodes", "slurm.nodes", "nodes"),
             ("trainer.n_gpus_per_node", "slurm.gpus_per_node", "GPUs per node"))


def _job_value(job: Any, key: str) -> Any:
    """The job's own value of ``key`` (with Hydra's ``+``/``++`` spellings), None when unset."""
    found = None
    for k, v in job.trainer.overrides.items():
        if k.lstrip("+") == key:
            found = v
    return found


def job_count(job: Any, key: str) -> int | None:
    """The job's whole-number value of ``key`` (None: unset); one line when it is not a number."""
    raw = _job_value(job, key)
    if raw is None:
        return None
    try:
        return int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"{key}={raw} in job {job.source}: must be a whole number") from None


def _set_value(sets: Sequence[str], key: str) -> str | None:
    found = None
    for text in sets:
        k, sep, v = str(text).partition("=")
        if sep and k.strip() == key:
            found = v.strip()
    return found


def size_sets(profile: Any, job: Any, sets: Sequence[str] = ()) -> list[str]:
    """``--set`` values the job's own size asks for (``profile``: as loaded with the user's ``sets``).

    Raises ConfigError (one line) where the job and ``--set`` disagree, or where the job asks for
    more GPUs per node than the profile's nodes have."""
    if not getattr(job.trainer, "derive_overrides", True):
        return []
    out: list[str] = []
    for tkey, pkey, what in SIZE_KEYS:
        if pkey == "slurm.gpus_per_node" and getattr(profile, "accelerator", None) in ("none",):
            continue  # CPU nodes: logical GPUs (verl_upstream.cpu.rules), not an allocation
        wanted = job_count(job, tkey)
        if wanted is None:
            continue
        if wanted < 1:
            raise ConfigError(f"{tkey}={wanted} in job {job.source}: the job needs at least 1 of its {what}")
        given = _set_value(sets, pkey)
        if given is not None:
            if given != str(wanted):
                raise ConfigError(f"{tkey}={wanted} in job {job.source} disagrees with --set {pkey}={given}; "
                                  f"use --set {pkey}={wanted} (or change {tkey} to {given})")
            continue
        have = getattr(profile.slurm, pkey.split(".")[1])
        if pkey == "slurm.gpus_per_node" and wanted > have:
            raise ConfigError(f"{tkey}={wanted} in job {job.source} asks for more GPUs per node than profile "
                              f"'{profile.name}' has ({have}); set {tkey}={have} and raise trainer.nnodes, or, "
                              f"if its nodes do have {wanted}, add --set {pkey}={wanted}")
        if wanted != have:
            out.append(f"{pkey}={wanted}")
    return out
