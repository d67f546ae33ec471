"""Derived config values: verl's deprecated keys turned into the ones in effect (the Ulysses
sizes moved into the FSDP settings in verl 0.9) and verl's global micro-batch keys into the
per-rank ones the workers use, from the worker groups' sizes. ``load_config`` runs both.
Driver; no torch.
"""
from __future__ import annotations

import warnings

from hpc_verl.errors import ConfigError
from hpc_verl.trainer.config.topology import topology
from hpc_verl.util.dotted import get_path


# (role, global key, per-rank key) of verl's micro-batch pairs
MICRO_BATCH_KEYS = (
    ("actor", "actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("critic", "critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size_per_gpu"),
    ("ref", "actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu"),
    ("actor", "actor_rollout_ref.rollout.log_prob_micro_batch_size",
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
)


# (deprecated key, verl 0.9's key) of the Ulysses sequence-parallel sizes
SP_KEYS = (("actor_rollout_ref.actor.ulysses_sequence_parallel_size",
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"),
           ("critic.ulysses_sequence_parallel_size", "critic.fsdp.ulysses_sequence_parallel_size"))


REF_SP_KEY = "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size"


_SP_OF = {"actor": SP_KEYS[0][1], "critic": SP_KEYS[1][1], "ref": REF_SP_KEY}


def derive_sequence_parallel(cfg: dict) -> None:
    """verl 0.9 moved ``<role>.ulysses_sequence_parallel_size`` into the FSDP settings: the old key
    still works (with a warning); both keys end up holding the size in effect (the batch rules
    read the old one); the reference follows the actor unless set."""
    for old, new in SP_KEYS:
        old_v, new_v = get_path(cfg, old), get_path(cfg, new)
        if old_v != 1 and new_v not in (1, old_v):
            raise ConfigError(f"config keys '{old}'={old_v} and '{new}'={new_v} disagree; set only '{new}' "
                              f"(the first is deprecated)")
        if old_v != 1 and new_v == 1:
            warnings.warn(f"config key '{old}' is deprecated (verl 0.9); use '{new}'={old_v}", UserWarning,
                          stacklevel=2)
            new_v = old_v
        for key in (old, new):
            parent, leaf = key.rsplit(".", 1)
            get_path(cfg, parent)[leaf] = new_v
    if get_path(cfg, REF_SP_KEY) is None:
        parent, leaf = REF_SP_KEY.rsplit(".", 1)
        get_path(cfg, parent)[leaf] = get_path(cfg, SP_KEYS[0][1])


def derive_micro_batches(cfg: dict) -> None:
    """verl's deprecated global micro-batch keys -> per rank (divided by the role's group size)."""
    topo = topology(cfg)
    for role, global_key, rank_key in MICRO_BATCH_KEYS:
        g = get_path(cfg, global_key)
        if g is None or get_path(cfg, rank_key) is not None:
            continue
        spec = topo.group_of(role)
        sp = int(get_path(cfg, _SP_OF.get(role, SP_KEYS[0][1])) or 1)
        world = max(1, (spec.world_size if spec else 1) // sp)   # data-parallel ranks (verl divides by them)
        if g % world:
            raise ConfigError(f"config key '{global_key}'={g} must be a multiple of the {world} rank(s) of the "
                              f"{role}; or set {rank_key} instead")
        parent, leaf = rank_key.rsplit(".", 1)
        get_path(cfg, parent)[leaf] = g // world
        gparent, gleaf = global_key.rsplit(".", 1)
        get_path(cfg, gparent)[gleaf] = None   # one of the pair is set, as verl requires
