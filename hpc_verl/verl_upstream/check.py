"""A verl job's config checked as verl will build it: keys, composition, verl's own start-up
checks, then the batch arithmetic on the engine's real data-parallel sizes.

1. The keys exist in the config composed from the job's own choices (``--config-name``,
   ``model_engine=megatron``, ``actor@actor_rollout_ref.actor=...``), so Megatron and VeOmni
   keys are known; a renamed or removed key gets advice from verl's history (``advice``).
2. Hydra composes the whole command line and resolves it, as ``main_ppo`` does.
3. verl's ``validate_config`` runs on it (``startup``) where verl is installed here: its
   message is the job's refusal.
4. The arithmetic verl asserts only later (per-rank micro-batches, log-prob passes) with each
   role's data-parallel size: FSDP/VeOmni GPUs / Ulysses, Megatron GPUs / (TP × PP × CP).

Without verl here, the keys cannot be checked: what is skipped is said once, and the
arithmetic runs on the values the job gives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from hpc_verl.errors import ConfigError
from hpc_verl.util.batch_rules import (ACTOR, batch_problems, data_parallel, engine_dp, log_prob_split_problems,
                                       uses_critic)
from hpc_verl.util.dotted import get_path
from hpc_verl.verl_upstream import config as vconfig
from hpc_verl.verl_upstream import startup
from hpc_verl.verl_upstream.overrides import Override, check_overrides, choices_of, one_line, parse_overrides

SKIPPED_WITHOUT_VERL = ("upstream verl is not installed here, so these checks were skipped: the override keys "
                        "against verl's config, Hydra's composition, and verl's own start-up checks "
                        "(validate_config); the batch arithmetic ran on the values given (install verl on the "
                        "login node with: pip install --no-deps verl omegaconf hydra-core)")
REF = "actor_rollout_ref.ref"


@dataclass
class ConfigCheck:
    """What the check found: the resolved config, verl's version, notes for the user."""

    resolved: dict[str, Any]
    version: str | None = None
    warnings: list[str] = field(default_factory=list)


def dp_sizes(cfg: dict[str, Any], gpus: int) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """(engine ranks per role for ``batch_problems``, data-parallel ranks for the log-prob passes, problems)."""
    problems: list[str] = []
    worlds: dict[str, int] = {}
    for role, section in (("actor", ACTOR), ("critic", "critic"), ("ref", REF)):
        world, bad = engine_dp(cfg, section, gpus)
        if bad and (role != "critic" or uses_critic(cfg)):
            problems.append(bad)
        worlds[role] = world
    worlds["rollout"] = worlds["actor"]  # the rollout's old log-probs run on the actor's engine
    dps = {"rollout": data_parallel(cfg, ACTOR, worlds["actor"]), "ref": data_parallel(cfg, REF, worlds["ref"])}
    return worlds, dps, problems


def arithmetic(cfg: dict[str, Any], nnodes: int, gpus_per_node: int) -> list[str]:
    """verl's batch arithmetic on this allocation (0 GPUs per node: a CPU job, nothing split)."""
    gpus = max(0, nnodes * gpus_per_node)
    worlds, dps, problems = dp_sizes(cfg, gpus)
    problems += batch_problems(cfg, worlds, gpus_per_node=gpus_per_node, replica_may_span=True, pairs=False)
    ref_used = bool(get_path(cfg, "algorithm.use_kl_in_reward", False)) or bool(get_path(cfg, f"{ACTOR}.use_kl_loss",
                                                                                         False))
    problems += log_prob_split_problems(cfg, dps, ref_used)
    return problems


def check_config(overrides: Sequence[str], hydra: vconfig.HydraArgs, nnodes: int, gpus_per_node: int, *,
                 where: str, job_label: str, alloc_source: str) -> ConfigCheck:
    """Raise ConfigError (one line: verl's reason first, then every other finding) or return the config."""
    parsed = parse_overrides(overrides, where)
    install = vconfig.find_verl()
    if install is None:
        resolved = flat_values(parsed)
        problems = arithmetic(resolved, nnodes, gpus_per_node)
        if problems:
            raise ConfigError(f"{job_label} on {alloc_source}: {one_line(problems)}")
        return ConfigCheck(resolved, None, [SKIPPED_WITHOUT_VERL])
    cdir = vconfig.config_dir_for(install, hydra.config_path)
    groups = [p.name for p in cdir.iterdir() if p.is_dir()] if cdir.is_dir() else []
    try:
        schema = vconfig.schema(config_name=hydra.config_name, choices=choices_of(parsed, groups),
                                config_path=hydra.config_path)
    except ConfigError as exc:
        raise ConfigError(f"{job_label}: {exc}") from None
    assert schema is not None
    problems = check_overrides(parsed, schema, where)
    if problems:
        raise ConfigError(one_line(problems))
    notes: list[str] = []
    if schema.source != "hydra":  # verl's files but no hydra-core: its defaults, then the user's values
        notes.append("hydra-core is not installed: the overrides' keys were checked but not composed, and verl's "
                     "start-up checks were skipped (pip install hydra-core to compose them as main_ppo will)")
        resolved = {k: v for k, v in schema.defaults.items() if not (isinstance(v, str) and "${" in v)}
        resolved.update(flat_values(parsed))
        cfg = None
    else:
        cfg = vconfig.compose_dir(schema.config_dir, hydra.config_name, overrides, schema.version)
        resolved = _resolve(cfg)
    first: list[str] = []
    if cfg is not None:
        verdict = startup.run_checks(schema.config_dir, hydra.config_name, overrides, cfg)
        if verdict.problem:
            first.append(f"verl {schema.version} refuses this config at start ({verdict.problem})")
        if verdict.skipped:
            notes.append(f"verl's own start-up check was cut short: {verdict.skipped}")
    problems = arithmetic(resolved, nnodes, gpus_per_node)
    if first or problems:
        lead = f"{job_label}: " if first else f"{job_label} on {alloc_source}: "
        raise ConfigError(lead + one_line([*first, *problems]))
    return ConfigCheck(resolved, schema.version, notes)


def _resolve(cfg: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        raise ConfigError(f"verl config does not resolve: {' '.join(str(exc).split())}") from exc


def flat_values(parsed: Sequence[Override]) -> dict[str, Any]:
    """Without verl: the user's own values only (flat keys; checks skip what is absent)."""
    out: dict[str, Any] = {}
    for ov in parsed:
        if ov.value is None or ov.key.startswith("hydra.") or "@" in ov.key:
            continue
        v: Any = ov.value
        if v.lower() in ("true", "false"):
            v = v.lower() == "true"
        out[ov.key.lstrip("+")] = v
    return out
