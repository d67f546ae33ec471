"""The pure placement plan: which instance runs on which Ray node, with which
GPU slots, in which stage and sharing which bundle. No Ray here: the cluster is
a list of ``ClusterNode`` (from ``ray.nodes()`` at run time, by hand in tests).

Strategies (each decision is one readable line in ``plan.decisions``):
- co-location: nodes joined by co-located edges (``co_locate=True`` or small
  ``max_size_bytes``) form groups; instance ``u`` of every member forms unit
  ``u``, planned as ONE bundle on one Ray node (the members share its GPUs where
  the sum allows, e.g. 1 + 0.5 GPU);
- staged: instances of a node with whole GPUs and parallelism > 1 are grouped
  by Ray node and GPU id into stages (8 x GPU:1 on 2 x 4 GPUs -> 2 stages).
Units are packed first-fit, biggest GPU demand first, so stages fill nodes.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from hpc_verl.dataflow.graph import DataflowGraph, Node
from hpc_verl.errors import DataflowError

MIN_BUNDLE_CPU = 0.01
_EPS = 1e-9


@dataclass
class ClusterNode:
    """One Ray node as the planner sees it: id, display name, FREE resources."""

    node_id: str
    name: str
    resources: dict[str, float]

    @property
    def gpus(self) -> float:
        return float(self.resources.get("GPU", 0.0))


@dataclass
class InstancePlan:
    instance_id: str
    node: str
    index: int
    ray_node_id: str
    ray_node_name: str
    gpu_slots: list[int]
    bundle: str
    stage: int | None = None


@dataclass
class BundlePlan:
    bundle_id: str
    ray_node_id: str
    ray_node_name: str
    resources: dict[str, float]
    members: list[str] = field(default_factory=list)


@dataclass
class PlacementPlan:
    graph: str
    instances: dict[str, InstancePlan]
    bundles: list[BundlePlan]
    decisions: list[str]

    def for_node(self, node: str) -> list[InstancePlan]:
        return sorted((i for i in self.instances.values() if i.node == node), key=lambda i: i.index)

    def bundle(self, bundle_id: str) -> BundlePlan:
        return next(b for b in self.bundles if b.bundle_id == bundle_id)

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "instances": {k: asdict(v) for k, v in self.instances.items()},
                "bundles": [asdict(b) for b in self.bundles], "decisions": list(self.decisions)}

    def __str__(self) -> str:
        lines = [f"Placement plan for graph '{self.graph}': {len(self.instances)} instances in "
                 f"{len(self.bundles)} bundles"]
        header = f"  {'instance':<24} {'ray node':<28} {'GPU slots':<12} {'stage':<6} bundle"
        lines.append(header)
        for inst in sorted(self.instances.values(), key=lambda i: (i.node, i.index)):
            gpus = ",".join(map(str, inst.gpu_slots)) or "-"
            stage = "-" if inst.stage is None else str(inst.stage)
            lines.append(f"  {inst.instance_id:<24} {inst.ray_node_name:<28} {gpus:<12} {stage:<6} {inst.bundle}")
        lines.extend(self.decisions)
        return "\n".join(lines)


class _NodeState:
    """Free resources of one cluster node while planning; GPUs tracked per id."""

    def __init__(self, cn: ClusterNode) -> None:
        self.cn = cn
        whole = int(cn.gpus + _EPS)
        self.gpu_free = [1.0] * whole
        if cn.gpus - whole > _EPS:
            self.gpu_free.append(cn.gpus - whole)
        self.other = {k: float(v) for k, v in cn.resources.items() if k != "GPU"}

    def try_alloc(self, demands: list[dict[str, float]]) -> list[list[int]] | None:
        """Allocate all demands together (one unit) or nothing; return GPU ids per demand."""
        saved_gpu, saved_other = list(self.gpu_free), dict(self.other)
        result: list[list[int]] = []
        for res in demands:
            ids = self._alloc_one(res)
            if ids is None:
                self.gpu_free, self.other = saved_gpu, saved_other
                return None
            result.append(ids)
        return result

    def _alloc_one(self, res: dict[str, float]) -> list[int] | None:
        for key, amount in res.items():
            if key == "GPU":
                continue
            if self.other.get(key, 0.0) + _EPS < amount:
                return None
        gpu = res.get("GPU", 0.0)
        ids: list[int] = []
        if gpu >= 1 - _EPS:
            free = [i for i, f in enumerate(self.gpu_free) if f >= 1 - _EPS]
            if len(free) < int(round(gpu)):
                return None
            ids = free[: int(round(gpu))]
            for i in ids:
                self.gpu_free[i] = 0.0
        elif gpu > 0:
            # best fit: the fullest GPU that still has room keeps whole GPUs whole
            fits = [i for i, f in enumerate(self.gpu_free) if f + _EPS >= gpu]
            if not fits:
                return None
            i = min(fits, key=lambda k: (self.gpu_free[k], k))
            self.gpu_free[i] -= gpu
            ids = [i]
        for key, amount in res.items():
            if key != "GPU":
                self.other[key] = self.other.get(key, 0.0) - amount
        return ids


def unit_resources(nodes: Iterable[Node]) -> dict[str, float]:
    """The bundle for a unit: the sum of its members' resources (at least a sliver of CPU)."""
    total: dict[str, float] = {}
    for node in nodes:
        for key, value in node.resources.items():
            total[key] = total.get(key, 0.0) + value
    total["CPU"] = max(total.get("CPU", 0.0), MIN_BUNDLE_CPU)
    return {k: round(v, 6) for k, v in total.items()}


def colocation_groups(graph: DataflowGraph) -> list[list[str]]:
    """Connected components over co-located data edges, in topological order."""
    parent = {n: n for n in graph.nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in graph.data_edges():
        if e.colocated:
            parent[find(e.src_name)] = find(e.dst_name)
    order = graph.topo_order()
    groups: dict[str, list[str]] = {}
    for n in order:
        groups.setdefault(find(n), []).append(n)
    return list(groups.values())


def check_feasible(graph: DataflowGraph, cluster: list[ClusterNode], total: list[ClusterNode] | None = None) -> None:
    """A node whose single instance no cluster node could ever hold is a graph error."""
    nodes = total or cluster
    if not nodes:
        raise DataflowError("the cluster description is empty: no Ray node to place on (is Ray running?)")
    for node in graph.nodes.values():
        need = dict(node.resources)
        if any(_NodeState(cn).try_alloc([need]) is not None for cn in nodes):
            continue
        best = {k: max(float(cn.resources.get(k, 0.0)) for cn in nodes) for k in need}
        raise DataflowError(f"node '{node.name}' asks for {_fmt(need)} per instance but no cluster node can hold "
                            f"it (largest: {_fmt(best)}); lower its resources or add bigger nodes")


def make_plan(graph: DataflowGraph, cluster: list[ClusterNode], parallelism: dict[str, int] | None = None,
              total: list[ClusterNode] | None = None) -> PlacementPlan:
    """Plan every instance of ``graph`` onto ``cluster`` (free resources; ``total``:
    the same nodes with all their resources, for the "can never fit" check). Pure."""
    graph.validate()
    check_feasible(graph, cluster, total)
    par = {n: (parallelism or {}).get(n, graph.nodes[n].parallelism) for n in graph.nodes}
    states = [_NodeState(copy.deepcopy(cn)) for cn in cluster]
    instances: dict[str, InstancePlan] = {}
    bundles: list[BundlePlan] = []
    decisions: list[str] = []
    groups = colocation_groups(graph)
    order = {n: i for i, n in enumerate(graph.topo_order())}
    groups.sort(key=lambda g: (-max(graph.nodes[n].gpus for n in g), order[g[0]]))
    for group in groups:
        units = max(par[n] for n in group)
        for u in range(units):
            members = [n for n in group if par[n] > u]
            _place_unit(graph, members, u, states, instances, bundles, decisions)
    _assign_stages(graph, instances, decisions, par)
    return PlacementPlan(graph=graph.name, instances=instances, bundles=bundles, decisions=decisions)


def _place_unit(graph: DataflowGraph, members: list[str], u: int, states: list[_NodeState],
                instances: dict[str, InstancePlan], bundles: list[BundlePlan], decisions: list[str]) -> None:
    demands = [graph.nodes[n].resources for n in members]
    for st in states:
        ids = st.try_alloc(demands)
        if ids is None:
            continue
        bid = f"b{len(bundles)}"
        bundles.append(BundlePlan(bid, st.cn.node_id, st.cn.name, unit_resources(graph.nodes[n] for n in members),
                                  [f"{n}_{u}" for n in members]))
        for n, gids in zip(members, ids):
            iid = f"{n}_{u}"
            instances[iid] = InstancePlan(iid, n, u, st.cn.node_id, st.cn.name, gids, bid)
        if len(members) > 1:
            names = " and ".join(f"{n}_{u}" for n in members)
            decisions.append(f"Scheduling decision: co-located {names} on node {st.cn.name} "
                             f"(one bundle {bid}: {_fmt(bundles[-1].resources)})")
        return
    if len(members) > 1:
        decisions.append(f"Scheduling decision: cannot co-locate {', '.join(f'{n}_{u}' for n in members)} on one "
                         f"node (not enough free resources together); placing them apart")
        for n in members:
            _place_unit(graph, [n], u, states, instances, bundles, decisions)
        return
    node = graph.nodes[members[0]]
    free = "; ".join(f"{st.cn.name}: GPU={sum(st.gpu_free):g} CPU={st.other.get('CPU', 0):g}" for st in states)
    raise DataflowError(f"cannot place {members[0]}_{u} ({_fmt(node.resources)}): the cluster has no free room "
                        f"left ({free}); lower parallelism or resources, or add nodes")


def _assign_stages(graph: DataflowGraph, instances: dict[str, InstancePlan], decisions: list[str],
                   par: dict[str, int]) -> None:
    for name, node in graph.nodes.items():
        if par[name] <= 1 or node.gpus < 1:
            continue
        insts = sorted((i for i in instances.values() if i.node == name),
                       key=lambda i: (i.ray_node_name, i.ray_node_id, i.gpu_slots))
        by_node: dict[str, list[InstancePlan]] = {}
        for inst in insts:
            by_node.setdefault(inst.ray_node_id, []).append(inst)
        parts = []
        for stage, group in enumerate(by_node.values()):
            for inst in group:
                inst.stage = stage
            gpus = sorted(g for inst in group for g in inst.gpu_slots)
            parts.append(f"stage {stage} = {', '.join(i.instance_id for i in group)} on node "
                         f"{group[0].ray_node_name} (GPUs {','.join(map(str, gpus))})")
        decisions.append(f"Scheduling decision: staged {name} into {len(by_node)} stage(s) by GPU id: "
                         + "; ".join(parts))


def place_extra(graph: DataflowGraph, node_name: str, index: int, cluster: list[ClusterNode],
                prefer_nodes: list[str], bundle_id: str) -> tuple[InstancePlan, BundlePlan] | None:
    """Plan one more instance (live scale-up) on the free resources; prefer nodes
    that host its co-located partners. None when nothing fits."""
    node = graph.nodes[node_name]
    ranked = sorted(cluster, key=lambda cn: (cn.node_id not in prefer_nodes, prefer_nodes.index(cn.node_id)
                                             if cn.node_id in prefer_nodes else 0))
    for cn in ranked:
        st = _NodeState(cn)
        ids = st.try_alloc([node.resources])
        if ids is None:
            continue
        iid = f"{node_name}_{index}"
        b = BundlePlan(bundle_id, cn.node_id, cn.name, unit_resources([node]), [iid])
        return InstancePlan(iid, node_name, index, cn.node_id, cn.name, ids[0], bundle_id), b
    return None


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()))
