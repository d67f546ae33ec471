"""World sizes from verl's keys: which roles share which processes, and how many.

The job has ``trainer.nnodes x trainer.n_gpus_per_node`` devices (on CPU,
``trainer.device=cpu``, ``n_gpus_per_node`` counts CPU ranks per node, 0 meaning
one). By
default the actor, rollout and reference - and the critic - share all of them:
one process per device holds every role (verl's hybrid engine), so the actor's
weights reach the rollout inside the process. ``hpc_verl.device_mapping`` (GPU
ids per node, per role) gives a role its own devices: roles with the same ids
share processes, roles with disjoint ids get separate worker groups, partly
overlapping ids are refused. The rollout has ``devices / tensor_model_parallel_size``
replicas. A rule-based reward needs no device and stays an independent replica.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from hpc_verl.errors import ConfigError

GPU_ROLES = ("actor", "rollout", "ref", "critic", "reward")
_NAME_ORDER = ("actor", "rollout", "critic", "ref", "reward")


def roles_for(cfg: Mapping) -> tuple[str, ...]:
    roles = ["rollout", "actor", "reward"]
    if cfg["algorithm"]["use_kl_in_reward"] or cfg["actor_rollout_ref"]["actor"]["use_kl_loss"]:
        roles.append("ref")
    if cfg["critic"]["enable"]:
        roles.append("critic")
    return tuple(roles)


@dataclass
class GroupSpec:
    """One worker group: the roles its processes hold and where they run."""

    name: str
    roles: tuple[str, ...]
    device_ids: tuple[int, ...]          # per node
    nnodes: int
    ranks_per_node: int
    resources: dict[str, float] = field(default_factory=dict)   # per rank

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nnodes

    def describe(self) -> str:
        per = ", ".join(f"{k}={v:g}" for k, v in sorted(self.resources.items()))
        return (f"group {self.name}: {'+'.join(self.roles)}, world size {self.world_size} "
                f"({self.nnodes} node(s) x {self.ranks_per_node} rank(s), {per} per rank, "
                f"device ids {','.join(map(str, self.device_ids))})")


@dataclass
class Topology:
    groups: dict[str, GroupSpec]
    role_group: dict[str, str]
    device: str

    def group_of(self, role: str) -> GroupSpec | None:
        name = self.role_group.get(role)
        return self.groups[name] if name else None

    @property
    def rollout_replicas(self) -> int:
        g = self.group_of("rollout")
        return g.world_size if g else 1

    def lines(self) -> list[str]:
        return [g.describe() for g in self.groups.values()]


def topology(cfg: Mapping) -> Topology:
    """The worker groups of ``cfg`` (one clear ConfigError for a layout that cannot work)."""
    t = cfg["trainer"]
    device = "cpu" if t["device"] == "cpu" else "cuda"
    per_node, nnodes = int(t["n_gpus_per_node"]), int(t["nnodes"])
    unit = "CPU ranks" if device == "cpu" else "GPUs"
    if per_node == 0 and device == "cpu":   # a CPU-only allocation (the local profile derives 0 GPUs): one rank
        per_node = 1
    if per_node < 1:
        raise ConfigError(f"trainer.n_gpus_per_node={per_node}: the trainer needs at least one device per node "
                          f"(on trainer.device=cpu it counts CPU ranks per node); set it to 1 or more")
    roles = roles_for(cfg)
    rm = bool(cfg["reward_model"]["enable"])
    placed = [r for r in GPU_ROLES if r in roles and (r != "reward" or rm)]
    mapping = cfg["hpc_verl"]["device_mapping"] or {}
    everything = tuple(range(per_node))
    ids: dict[str, tuple[int, ...]] = {"actor": tuple(mapping.get("actor", everything))}
    for r in placed:
        ids[r] = tuple(mapping.get(r, ids["actor"]))
    for i, a in enumerate(placed):
        for b in placed[i + 1:]:
            shared = set(ids[a]) & set(ids[b])
            if shared and set(ids[a]) != set(ids[b]):
                raise ConfigError(f"hpc_verl.device_mapping: {a} {list(ids[a])} and {b} {list(ids[b])} overlap on "
                                  f"{sorted(shared)}; roles either share a device group (the same ids: one process "
                                  f"per device holds both) or use disjoint devices")
    by_ids: dict[frozenset, list[str]] = {}
    for r in placed:
        by_ids.setdefault(frozenset(ids[r]), []).append(r)
    groups: dict[str, GroupSpec] = {}
    role_group: dict[str, str] = {}
    per_rank = {"CPU": 1.0} if device == "cpu" else {"GPU": 1.0}
    for members in by_ids.values():
        name = "hybrid" if {"actor", "rollout"} <= set(members) else next(r for r in _NAME_ORDER if r in members)
        dev_ids = tuple(sorted(ids[members[0]]))
        groups[name] = GroupSpec(name, tuple(sorted(members, key=_NAME_ORDER.index)), dev_ids, nnodes,
                                 len(dev_ids), dict(per_rank))
        for r in members:
            role_group[r] = name
    _rollout_replicas(cfg, groups, role_group, unit)
    return Topology(groups, role_group, device)


def _rollout_replicas(cfg: Mapping, groups: dict[str, GroupSpec], role_group: dict[str, str], unit: str) -> None:
    rollout = cfg["actor_rollout_ref"]["rollout"]
    tp = int(rollout["tensor_model_parallel_size"])
    if tp == 1:
        return
    g = groups[role_group["rollout"]]
    if rollout["name"] == "hf":
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}: the transformers rollout "
                          f"(rollout.name=hf) runs one replica per device; tensor parallelism needs rollout.name=vllm")
    if len(g.roles) > 1:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} inside the hybrid engine "
                          f"(the rollout shares {unit} with {', '.join(r for r in g.roles if r != 'rollout')}) is "
                          f"not implemented yet; give the rollout its own devices with hpc_verl.device_mapping")
    if g.ranks_per_node % tp:
        raise ConfigError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the "
                          f"rollout's {g.ranks_per_node} {unit} per node")
    g.ranks_per_node //= tp
    g.resources = {k: v * tp for k, v in g.resources.items()}
