"""The PPO loop as a DataflowGraph: ``build_ppo_graph`` declares the nodes (roles/nodes.py,
by the names defined there) in the worker groups that ``topology`` derives from verl's keys,
and the edges between them; ``describe_placement`` is what ``--dry-run`` prints.

Runners: ray_runner.DataflowRunner (Ray, the HybridScheduler) and inline_runner.InlineRunner
(in this process). Driver; no torch: the node classes are torch-free until a rank builds them.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping

from hpc_verl.dataflow import ClusterNode, DataflowGraph, Edge, Node, WorkerGroup, make_plan
from hpc_verl.errors import ConfigError
from hpc_verl.trainer.config.schema import batch_problems_for
from hpc_verl.trainer.config.topology import Topology, topology
from hpc_verl.trainer.roles import nodes as N
from hpc_verl.trainer.roles.minibatch import actor_rows

POLICY_EDGE_KEY = f"{N.ACTOR_NODE}->{N.ROLLOUT_NODE}"
_DIST_ROLES = {"actor", "critic", "ref"}


def worker_groups(cfg: Mapping, topo: Topology) -> dict[str, Any]:
    """One WorkerGroup per group of the topology (a torch.distributed group where a role trains
    or shards; rollout-only and reward-model groups are independent replicas)."""
    timeout = float(cfg["hpc_verl"]["collective_timeout_s"])
    return {g.name: WorkerGroup(g.name, g.world_size, g.resources, ranks_per_node=g.ranks_per_node,
                                dist=bool(_DIST_ROLES & set(g.roles)), timeout_s=timeout)
            for g in topo.groups.values()}


def build_ppo_graph(cfg: Mapping, total_steps: int, name: str = "ppo") -> Any:
    """Declare the PPO dataflow for ``cfg`` (a plain dict)."""
    topo = topology(cfg)
    groups = worker_groups(cfg, topo)

    def group(role: str) -> Any:
        spec = topo.group_of(role)
        return groups[spec.name] if spec else None

    def light_host(role: str) -> Any:
        """Where a light routed node lives: the role's group's rank 0 (one process fewer to start)."""
        return group(role) if cfg["hpc_verl"]["light_nodes_in_rank0"] else None

    grpo = cfg["algorithm"]["adv_estimator"] != "gae"   # a critic-free estimator: GRPO, RLOO, REINFORCE++
    graph = DataflowGraph(name)
    with graph:
        # a GRPO group's n samples stay on one replica
        rollout = Node(N.ROLLOUT_NODE, N.RolloutNode, group=group("rollout"), dispatch="split", split_key="uid",
                       init_args=(cfg,))
        if group("reward") is not None:   # a reward model: rows split over its group
            reward = Node(N.REWARD_NODE, N.RewardNode, group=group("reward"), dispatch="split", init_args=(cfg,))
        else:                             # rule-based: no device; in the rollout's rank 0 unless asked not to
            reward = Node(N.REWARD_NODE, N.RewardNode, init_args=(cfg,), host=light_host("rollout"))
        if group("ref") is not None:
            ref = Node(N.REF_NODE, N.RefNode, group=group("ref"), dispatch="spmd", init_args=(cfg,),
                       ulysses=_sp(cfg, "ref") > 1)
        if grpo:
            adv = Node(N.ADVANTAGE_NODE, N.AdvantageNode, init_args=(cfg,), max_parallelism=1,
                       host=light_host("actor"))
        else:
            adv = Node(N.CRITIC_NODE, N.CriticNode, group=group("critic"), dispatch="spmd",
                       init_args=(cfg, total_steps), ulysses=_sp(cfg, "critic") > 1)
        # each rank fetches only the rollout rows it trains on (the rollout cuts them out)
        actor = Node(N.ACTOR_NODE, N.ActorNode, group=group("actor"), dispatch="spmd",
                     init_args=(cfg, total_steps), ulysses=_sp(cfg, "actor") > 1,
                     take_rows=functools.partial(actor_rows, cfg))
        # scores are a few bytes per response: keep reward next to the rollout
        Edge(rollout, reward, data_type="rollout_batch", co_locate=True)
        Edge(rollout, adv, data_type="rollout_batch")
        Edge(reward, adv, data_type="scores", max_size_bytes=1_000_000)
        if group("ref") is not None:
            Edge(rollout, ref, data_type="rollout_batch")
            Edge(ref, adv, data_type="ref_log_prob")
        Edge(rollout, actor, data_type="rollout_batch")
        Edge(adv, actor, data_type="advantages")
        Edge(actor, rollout, data_type=N.POLICY_EDGE, control=True, consistency="strong")
    return graph


def _sp(cfg: Mapping, role: str) -> int:
    """The role's Ulysses sequence-parallel size (verl 0.9's keys, resolved by load_config)."""
    if role == "critic":
        return int(cfg["critic"]["fsdp"]["ulysses_sequence_parallel_size"])
    return int(cfg["actor_rollout_ref"][role]["fsdp_config"]["ulysses_sequence_parallel_size"])


def adv_node_name(cfg: Mapping) -> str:
    """The node that computes advantages: the critic (GAE) or the critic-free one."""
    return N.CRITIC_NODE if cfg["algorithm"]["adv_estimator"] == "gae" else N.ADVANTAGE_NODE


def synthetic_cluster(cfg: Mapping) -> list[Any]:
    """The cluster ``trainer.nnodes x n_gpus_per_node`` describes (plans without Ray: --dry-run)."""
    t = cfg["trainer"]
    per = float(t["n_gpus_per_node"])
    res = {"CPU": per + 8.0} if t["device"] == "cpu" else {"CPU": 8.0 * per + 8.0, "GPU": per}
    return [ClusterNode(f"node{i}", f"node{i}", dict(res)) for i in range(int(t["nnodes"]))]


def describe_placement(cfg: Mapping) -> str:
    """What ``--dry-run`` prints: the worker groups and the placement plan on the cluster the
    config describes (batch arithmetic checked against the groups first)."""
    problems = batch_problems_for(cfg)
    if problems:
        raise ConfigError(problems[0])
    topo = topology(cfg)
    t = cfg["trainer"]
    unit = "CPU rank(s)" if t["device"] == "cpu" else "GPU(s)"
    graph = build_ppo_graph(cfg, 1, name=f"ppo-{t['experiment_name']}")
    plan = make_plan(graph, synthetic_cluster(cfg))
    head = [f"Trainer layout: {t['nnodes']} node(s) x {t['n_gpus_per_node']} {unit}; rollout replicas: "
            f"{topo.rollout_replicas}; actor strategy {cfg['actor_rollout_ref']['actor']['strategy']}"]
    head += [f"  {line}" for line in topo.lines()]
    return "\n".join(head + [str(plan)])
