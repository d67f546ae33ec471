"""How many CPUs this process may use, and whether CPU ranks fit on them.

The one place that answers it (the trainer, ``plan`` and ``doctor`` ask here): the smallest of
the CPUs this process may run on (``sched_getaffinity``), the cgroup v2 CPU quota
(``cpu.max``, rounded up) and, inside a SLURM job, ``SLURM_CPUS_PER_TASK`` and
``SLURM_CPUS_ON_NODE``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

OVERSUBSCRIBE_KEY = "hpc_verl.allow_cpu_oversubscribe"
#: the trainer ranks the launcher places on each node of a CPU profile (accelerator none) unless the
#: profile's ``cpu.ranks_per_node`` says more: the built-in trainer gets n_gpus_per_node 0 (one rank),
#: upstream verl one logical GPU
CPU_PROFILE_RANKS_PER_NODE = 1


@dataclass(frozen=True)
class UsableCpus:
    count: int
    source: str    # what set the count: "CPU affinity", "cgroup cpu.max quota", "SLURM_CPUS_PER_TASK", ...

    def __str__(self) -> str:
        return f"{self.count} usable CPU(s) ({self.source})"


def _cgroup_quota(root: Path) -> int | None:
    """The cgroup v2 CPU quota of this process, rounded up (None: no quota, or not cgroup v2)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    rel = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    if rel is None:
        return None
    best = None
    d = root / rel.lstrip("/")
    while True:   # the tightest quota on the way up to the root
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max" and int(period) > 0:
                n = max(1, math.ceil(int(quota) / int(period)))
                best = n if best is None else min(best, n)
        except (OSError, ValueError):
            pass
        if d == root or root not in d.parents:
            return best
        d = d.parent


def usable_cpus(env: Mapping[str, str] | None = None, cgroup_root: str = "/sys/fs/cgroup") -> UsableCpus:
    """The CPUs this process may use (see the module doc); the smallest limit wins."""
    env = os.environ if env is None else env
    try:
        found = [(len(os.sched_getaffinity(0)), "CPU affinity")]
    except (AttributeError, OSError):
        found = [(os.cpu_count() or 1, "os.cpu_count")]
    quota = _cgroup_quota(Path(cgroup_root))
    if quota is not None:
        found.append((quota, "cgroup cpu.max quota"))
    for var in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        value = (env.get(var) or "").strip()
        if value.isdigit() and int(value) > 0:
            found.append((int(value), var))
    count, source = min(found, key=lambda f: f[0])
    return UsableCpus(count, source)


def rank_problem(ranks: int, cpus: UsableCpus, ranks_key: str, where: str = "this node") -> str | None:
    """The one line that refuses ``ranks`` CPU ranks per node on ``cpus`` (None: they fit)."""
    if ranks <= cpus.count:
        return None
    return (f"{ranks_key}={ranks} asks for {ranks} CPU ranks per node, but {where} has {cpus}; set "
            f"{ranks_key} to at most {cpus.count}, or {OVERSUBSCRIBE_KEY}=true to run them anyway (slower)")


def rank_line(ranks: int, cpus: UsableCpus) -> str:
    """What ``--dry-run`` and ``--check`` print: ranks against CPUs."""
    verdict = "fits" if ranks <= cpus.count else "oversubscribed"
    return f"CPU ranks per node: {ranks} on {cpus} ({verdict})"


def profile_cpus(scheduler: str, cpus_per_task: int, env: Mapping[str, str] | None = None) -> UsableCpus:
    """The CPUs a rank of a profile may use: this process's own (a local profile, or inside a SLURM
    job), else what the profile asks SLURM for per task."""
    env = os.environ if env is None else env
    if scheduler == "local" or env.get("SLURM_JOB_ID"):
        return usable_cpus(env)
    if cpus_per_task:
        return UsableCpus(cpus_per_task, "slurm.cpus_per_task")
    return UsableCpus(1, "slurm.cpus_per_task unset: SLURM's default of 1")


def profile_rank_check(scheduler: str, cpus_per_task: int, env: Mapping[str, str] | None = None,
                       ranks: int = CPU_PROFILE_RANKS_PER_NODE,
                       ranks_key: str = "trainer.n_gpus_per_node") -> tuple[str, str | None]:
    """``plan`` and ``doctor`` on a CPU profile: (ranks against CPUs, the refusal or None)."""
    usable = profile_cpus(scheduler, cpus_per_task, env)
    return rank_line(ranks, usable), rank_problem(ranks, usable, ranks_key)


#: set by the job (a verl job on a CPU profile whose rollout replica has several ranks in a node): how
#: many CPU sets the node's CPUs are cut into, one per rank of an engine (``VLLM_CPU_OMP_THREADS_BIND``)
CPU_SETS_ENV = "HPCV_CPU_SETS_PER_NODE"


def cpu_sets(cpus: list[int], sets: int) -> list[list[int]]:
    """``cpus`` cut into ``sets`` contiguous sets, as even as they come (at least one CPU each)."""
    cpus = sorted(cpus)
    if sets < 1 or len(cpus) < sets:
        raise ValueError(f"cannot cut {len(cpus)} CPU(s) into {sets} set(s)")
    bounds = [round(i * len(cpus) / sets) for i in range(sets + 1)]
    return [cpus[a:b] for a, b in zip(bounds, bounds[1:])]


def vllm_cpu_bind(env: Mapping[str, str], cpus: list[int] | None = None) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for this node: one CPU set per engine rank (``0|1``), from the CPUs
    this process may use; None where the job asks for none or sets the variable itself. vLLM-CPU's own
    ("auto") binds one NUMA node per rank and refuses more ranks than NUMA nodes."""
    try:
        sets = int(env.get(CPU_SETS_ENV, "0") or 0)
    except ValueError:
        return None
    if sets < 2 or env.get("VLLM_CPU_OMP_THREADS_BIND"):
        return None
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if len(cpus) < sets:
        return None   # fewer CPUs than ranks: leave vLLM's choice (the profile check refuses this before)
    return "|".join(",".join(map(str, s)) for s in cpu_sets(cpus, sets))
