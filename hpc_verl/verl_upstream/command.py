"""The ``python3 -m verl.trainer.main_ppo`` command for a job, validated before submission.

What the allocation decides is never typed twice: ``trainer.nnodes`` and
``trainer.n_gpus_per_node`` come from the profile and the node count; a user
override that disagrees is refused with both numbers. ``RAY_ADDRESS`` comes from
the bootstrap (the job's own Ray cluster); in that mode Ray refuses
``ray.init(num_cpus=...)`` ("When connecting to an existing cluster, num_cpus
and num_gpus must not be provided"), so the CPU count from the allocation goes
to ``ray start --num-cpus`` and ``ray_kwargs.ray_init.num_cpus`` is set only when
verl starts Ray itself (a single node without the bootstrap).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from hpc_verl.errors import ConfigError
from hpc_verl.util.batch_rules import check_ppo_arithmetic
from hpc_verl.verl_upstream import config as vconfig
from hpc_verl.verl_upstream.check import check_config, flat_values
from hpc_verl.verl_upstream.overrides import one_line, override_map, parse_overrides

MODULE = "verl.trainer.main_ppo"


def runs_verl(job: Any) -> bool:
    """Whether ``job`` (a JobConfig) runs upstream verl's main_ppo rather than the built-in trainer."""
    return getattr(job.trainer, "module", "") == MODULE
ROLLOUT_NAME = "actor_rollout_ref.rollout.name"
NUM_CPUS = "ray_kwargs.ray_init.num_cpus"
KNOWN_ROLLOUTS = ("vllm", "sglang", "hf", "trtllm")


class VerlNotInstalledWarning(UserWarning):
    """verl is absent here: keys cannot be checked (arithmetic still is)."""


@dataclass(frozen=True)
class Allocation:
    """What one job gets: nodes, GPUs and CPUs per node."""

    nnodes: int
    gpus_per_node: int
    cpus_per_node: int
    source: str = "the allocation"  # named in messages, e.g. "profile 'ib-a100' (--nodes 2)"


@dataclass
class VerlCommand:
    """argv to run inside the container, plus what the launcher must provide."""

    python: str
    derived: list[str]
    user: list[str]
    attach_to_ray: bool
    env_required: list[str] = field(default_factory=list)
    verl_version: str | None = None
    warnings: list[str] = field(default_factory=list)
    #: the config main_ppo will see (composed and resolved; only the user's values without verl)
    resolved: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def overrides(self) -> list[str]:
        return [*self.derived, *self.user]

    @property
    def argv(self) -> list[str]:
        return [self.python, "-m", MODULE, *self.overrides]


def build_verl_command(user_overrides: Sequence[str], alloc: Allocation, *, python: str = "python3",
                       attach_to_ray: bool = True, check_keys: bool = True,
                       where: str = "verl override",
                       launcher_defaults: Sequence[tuple[str, str]] = (),
                       hydra_args: Sequence[str] = ()) -> VerlCommand:
    """Derive, validate and assemble the main_ppo command; raise ConfigError on any problem.

    ``launcher_defaults``: (key, value) the launcher adds where the job does not set the key
    (a CPU profile's settings, ``verl_upstream.cpu.rules``); checked and composed like the rest.
    ``hydra_args``: the job's ``trainer.args`` (``--config-name NAME``, ``--config-path DIR``)."""
    parsed = parse_overrides(user_overrides, where)
    values = override_map(parsed)
    job_label = where.removesuffix("verl override").rstrip(": ") or "verl job"
    derived: list[str] = []
    derived += _derive(values, "trainer.nnodes", alloc.nnodes, alloc, "nodes")
    derived += _derive(values, "trainer.n_gpus_per_node", alloc.gpus_per_node, alloc, "GPUs per node")
    given = {key.lstrip("+") for key in values}
    derived += [f"{key}={value}" for key, value in launcher_defaults if key.lstrip("+") not in given]
    owned = {"trainer.nnodes", "trainer.n_gpus_per_node"}
    cpus = values.get(NUM_CPUS)
    if attach_to_ray:
        if cpus not in (None, "null"):
            raise ConfigError(f"{where} '{NUM_CPUS}={cpus}': the job attaches to its own Ray cluster "
                              f"(RAY_ADDRESS) and Ray refuses num_cpus when connecting; the "
                              f"{alloc.cpus_per_node} CPUs per node from {alloc.source} already go to "
                              "'ray start --num-cpus'; drop this override")
    else:
        derived += _derive(values, NUM_CPUS, alloc.cpus_per_node, alloc, "CPUs per node")
        owned.add(NUM_CPUS)
    user = [ov.raw for ov in parsed if ov.key not in owned]

    name = values.get(ROLLOUT_NAME)
    if not name or name in ("???", "null"):
        raise ConfigError(f"{job_label}: '{ROLLOUT_NAME}' is required (verl has no default); add "
                          f"{ROLLOUT_NAME}=vllm (or {', '.join(KNOWN_ROLLOUTS[1:])}) to the overrides")

    cmd = VerlCommand(python=python, derived=derived, user=user, attach_to_ray=attach_to_ray,
                      env_required=["RAY_ADDRESS"] if attach_to_ray else [])
    if check_keys:  # keys, composition, verl's own start-up checks, arithmetic (verl_upstream.check)
        found = check_config(cmd.overrides, vconfig.split_hydra_args(hydra_args), alloc.nnodes, alloc.gpus_per_node,
                             where=where, job_label=job_label, alloc_source=alloc.source)
        resolved, cmd.verl_version = found.resolved, found.version
        cmd.warnings += found.warnings
        if found.version is None:
            warnings.warn(found.warnings[0], VerlNotInstalledWarning, stacklevel=2)
    else:
        resolved = flat_values(parsed)
        problems = check_ppo_arithmetic(resolved, alloc.nnodes, alloc.gpus_per_node, replica_may_span=True,
                                        pairs=False)
        if problems:
            raise ConfigError(f"{job_label} on {alloc.source}: {one_line(problems)}")
    cmd.resolved = resolved
    return cmd


def _derive(values: dict[str, str | None], key: str, actual: int, alloc: Allocation, what: str) -> list[str]:
    given = values.get(key)
    if given is None:
        return [f"{key}={actual}"]
    try:
        same = int(str(given)) == actual
    except ValueError:
        same = False
    if not same:
        pkey = {"trainer.nnodes": "slurm.nodes", "trainer.n_gpus_per_node": "slurm.gpus_per_node"}.get(key)
        fix = (f"ask for that allocation with --set {pkey}={given}, or set {key}={actual}" if pkey
               else f"drop the override (hpc-verl sets {key}={actual})")
        raise ConfigError(f"override '{key}={given}' disagrees with {alloc.source}, which has {actual} {what}; "
                          f"{fix}")
    return [f"{key}={actual}"]


def resolved_config(overrides: Sequence[str]) -> dict[str, Any]:
    """verl's config composed with ``overrides`` and interpolations resolved (plain dict)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = vconfig.compose(overrides)
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"verl config does not resolve: {' '.join(str(exc).split())}") from exc
