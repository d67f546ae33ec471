"""Validate a job's trainer before submission: upstream verl or the built-in trainer.

The hook the launcher calls (render, validate, submit) on the login node, CPU
only. A job chooses its trainer with ``trainer.module`` in the job file:
``verl.trainer.main_ppo`` is upstream verl, anything else the built-in trainer
(``hpc_verl.trainer.main``). For verl, the overrides must be keys of verl's own
config, compose with it, and satisfy the batch arithmetic on the profile's
allocation; ``trainer.nnodes``/``trainer.n_gpus_per_node`` come from the
allocation and a disagreeing override is refused. On a CPU profile a verl job is a
smoke run: its settings and refusals are ``verl_upstream.cpu.rules``'. The built-in trainer's config
(through its own loader, with its defaults) gets the same allocation checks and the
same arithmetic (``hpc_verl.util.batch_rules``).
"""
from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

from hpc_verl.errors import ConfigError
from hpc_verl.verl_upstream import findings, neighbours
from hpc_verl.verl_upstream.config import find_verl
from hpc_verl.verl_upstream.cpu import rules as cpu_rules
from hpc_verl.verl_upstream.command import runs_verl
from hpc_verl.verl_upstream.command import Allocation, VerlCommand, VerlNotInstalledWarning, build_verl_command
from hpc_verl.verl_upstream.overrides import one_line

ALLOCATION_KEYS = ("trainer.nnodes", "trainer.n_gpus_per_node")


@dataclass
class TrainerCheck:
    """What validation found: the trainer kind, the verl command (verl jobs), warnings."""

    kind: str  # "verl" | "builtin"
    command: VerlCommand | None = None
    warnings: list[str] = field(default_factory=list)


#: our trainer: it can start before Ray is ready and connect once the barrier has passed
BUILTIN_MODULE = "hpc_verl.trainer.main"


def starts_with_ray(job: Any) -> bool:
    """Whether the job's trainer is ours, which the script starts together with Ray (its imports
    and data loading overlap the bring-up); any other module starts after the barrier."""
    return getattr(job.trainer, "module", "") == BUILTIN_MODULE


def trainer_kind(job: Any) -> str:
    """``verl`` when the job runs upstream verl's main_ppo, else ``builtin``."""
    return "verl" if runs_verl(job) else "builtin"


def allocation_of(profile: Any, nodes: int | None = None) -> Allocation:
    n = nodes if nodes is not None else profile.slurm.nodes
    gpn = profile.slurm.gpus_per_node
    if profile.accelerator == "none" and profile.cpu.ranks_per_node > 1:
        gpn = profile.cpu.ranks_per_node  # the built-in trainer on CPU: n_gpus_per_node CPU ranks per node
    return Allocation(n, gpn, profile.slurm.cpus_per_task,
                      source=f"profile '{profile.name}' ({n} node(s) × {gpn} GPU(s))")


def _source(job: Any) -> str:
    return str(getattr(job, "source", None) or "(command line)")


def _user_overrides(job: Any) -> list[str]:
    return list(job.trainer_override_args())


def validate_job_trainer(profile: Any, job: Any, nodes: int | None = None) -> TrainerCheck:
    """Raise ConfigError (one line) if the job's trainer config cannot run on this allocation."""
    alloc = allocation_of(profile, nodes)
    if trainer_kind(job) == "verl":
        _refuse_bad_neighbours(profile, job)
        defaults: list[tuple[str, str]] = []
        if cpu_rules.applies(profile, job):  # a smoke run on CPU: refusals and settings before anything starts
            alloc = cpu_allocation(profile, alloc)
            refused = cpu_rules.refusals(_user_overrides(job))
            if refused:
                raise ConfigError(f"job config {_source(job)}: {one_line(refused)}")
            install = find_verl()
            cpu_rules.check_version(install.version if install else None)
            defaults = cpu_rules.derived_overrides(_user_overrides(job))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", VerlNotInstalledWarning)
            cmd = build_verl_command(_user_overrides(job), alloc, python=getattr(profile.ray, "python", "python3"),
                                     attach_to_ray=True, where=f"job config {_source(job)}: verl override",
                                     launcher_defaults=defaults, hydra_args=list(job.trainer.args))
        errors, notes = findings.split(findings.review(
            cmd.resolved, findings.user_keys_of(cmd.user), cmd.verl_version, alloc.nnodes, alloc.gpus_per_node,
            time_limited=profile.scheduler == "slurm", transport=profile.network.transport,
            cpus_per_node=alloc.cpus_per_node if profile.accelerator in ("nvidia", "amd") else None))
        if errors:
            raise ConfigError(f"job config {_source(job)}: {one_line(errors)}")
        cmd.warnings += notes
        if cpu_rules.applies(profile, job):
            cmd.warnings += cpu_rules.shared_tmp_notes(cmd.resolved, alloc.nnodes, alloc.gpus_per_node,
                                                       profile.network.allow_loopback)
        for line in cmd.warnings:  # one clean line for the person at the terminal
            print(f"hpc-verl: warning: {line}", file=sys.stderr)
        return TrainerCheck("verl", cmd, list(cmd.warnings))
    return _validate_builtin(profile, job, alloc)


def _refuse_bad_neighbours(profile: Any, job: Any) -> None:
    """Packages in the job's Python that make verl or vLLM fail at run time (verl_upstream.neighbours)."""
    python = getattr(profile.ray, "python", "python3")
    bad = neighbours.problems(neighbours.installed(python) or {})
    if bad:
        raise ConfigError(f"job config {_source(job)}: the job's Python ({python}): {'; '.join(bad)}")


def cpu_allocation(profile: Any, alloc: Allocation) -> Allocation:
    """A verl job on CPU nodes: each node is ``cpu.ranks_per_node`` logical GPU(s) (Ray slots)."""
    gpn = profile.cpu.ranks_per_node
    return Allocation(alloc.nnodes, gpn, alloc.cpus_per_node,
                      source=f"profile '{profile.name}' ({alloc.nnodes} CPU node(s) × {gpn} logical GPU(s))")


def builtin_device_overrides(profile: Any) -> list[tuple[str, str]]:
    """The built-in trainer on CPU-only nodes: its ranks are CPU processes (n_gpus_per_node 0: one each,
    else ``cpu.ranks_per_node`` of them)."""
    if profile.accelerator != "none":
        return []
    ranks = profile.cpu.ranks_per_node
    return [("trainer.device", "cpu")] + ([("trainer.n_gpus_per_node", str(ranks))] if ranks > 1 else [])


def _validate_builtin(profile: Any, job: Any, alloc: Allocation) -> TrainerCheck:
    from hpc_verl.trainer.config.job import job_problems   # the trainer's config decides what is valid

    overrides = _user_overrides(job)
    for item in overrides:
        key, _, value = item.partition("=")
        key = key.lstrip("+~")
        if key in ALLOCATION_KEYS:
            actual = alloc.nnodes if key == "trainer.nnodes" else alloc.gpus_per_node
            if value.strip() != str(actual):
                raise ConfigError(f"job config {_source(job)}: override '{item}' disagrees with {alloc.source}; "
                                  f"hpc-verl sets {key} from the allocation: drop the override")
    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    derived = [f"trainer.nnodes={alloc.nnodes}", f"trainer.n_gpus_per_node={alloc.gpus_per_node}"]
    derived += [f"{k}={v}" for k, v in builtin_device_overrides(profile) if k not in given]
    gpus = alloc.gpus_per_node
    if profile.accelerator in ("none", "fake"):  # CPU workers: no per-GPU split to check
        gpus = 0
    try:
        problems = job_problems([*derived, *[o for o in overrides
                                             if o.split("=", 1)[0].lstrip("+~") not in ALLOCATION_KEYS]],
                                alloc.nnodes, gpus)
    except ConfigError as exc:
        raise ConfigError(f"job config {_source(job)}: {exc}") from None
    if problems:
        extra = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ConfigError(f"job config {_source(job)} on {alloc.source}: {problems[0]}{extra}")
    return TrainerCheck("builtin")
