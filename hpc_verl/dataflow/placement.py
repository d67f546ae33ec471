"""The pure placement plan: which instance runs on which Ray node, with which
GPU slots, in which stage, sharing which bundle and process. No Ray here: the
cluster is a list of ``ClusterNode`` (from ``ray.nodes()`` at run time, by hand
in tests and in ``hpc-verl train --dry-run``).

Strategies (each decision is one readable line in ``plan.decisions``):
- worker groups: the W ranks of a group are W processes, one bundle each; every
  node the group hosts has its instance ``r`` in rank ``r``'s process (verl's
  hybrid engine); ``ranks_per_node`` fills Ray nodes in rank order;
- co-location: nodes joined by co-located edges (``co_locate=True`` or small
  ``max_size_bytes``) form components; instance ``u`` of every member forms unit
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
    group: str | None = None     # worker group (split/spmd nodes); None for routed replicas
    process: str = ""            # the Ray actor that hosts it: "<group>_<rank>" or the instance id


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

    def processes(self) -> dict[str, list[InstancePlan]]:
        """Process key -> the instances it hosts (one Ray actor each)."""
        out: dict[str, list[InstancePlan]] = {}
        for inst in sorted(self.instances.values(), key=lambda i: (i.process, i.node)):
            out.setdefault(inst.process, []).append(inst)
        return out

    def groups(self) -> dict[str, dict[str, Any]]:
        """Per worker group: world size, hosted nodes and where each rank runs."""
        out: dict[str, dict[str, Any]] = {}
        for inst in sorted(self.instances.values(), key=lambda i: (i.group or "", i.index, i.node)):
            if inst.group is None:
                continue
            g = out.setdefault(inst.group, {"nodes": [], "ranks": {}})
            if inst.node not in g["nodes"]:
                g["nodes"].append(inst.node)
            g["ranks"].setdefault(inst.index, {"rank": inst.index, "ray_node": inst.ray_node_name,
                                               "ray_node_id": inst.ray_node_id, "bundle": inst.bundle,
                                               "gpu_slots": list(inst.gpu_slots)})
        for g in out.values():
            g["ranks"] = [g["ranks"][r] for r in sorted(g["ranks"])]
            g["world_size"] = len(g["ranks"])
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "instances": {k: asdict(v) for k, v in self.instances.items()},
                "bundles": [asdict(b) for b in self.bundles], "groups": self.groups(),
                "decisions": list(self.decisions)}

    def describe(self, decisions: bool = True) -> str:
        """The plan as short lines a person reads in a log (a list, no wide table): the worker
        groups with their ranks, the routed instances, and (``decisions``) the plan's decisions.
        A scheduler logs each decision once as it makes it, so its plan log leaves them out."""
        lines = [f"Placement plan for graph '{self.graph}': {len(self.instances)} instances in "
                 f"{len(self.processes())} processes, {len(self.bundles)} bundles"]
        for name, g in self.groups().items():
            lines.append(f"  worker group {name}: world size {g['world_size']}, one process per rank hosts "
                         f"{', '.join(g['nodes'])}")
            for r in g["ranks"]:
                gpus = ",".join(map(str, r["gpu_slots"])) or "-"
                lines.append(f"    - rank {r['rank']} on node {r['ray_node']}, GPU slots {gpus}, bundle {r['bundle']}")
        routed = sorted((i for i in self.instances.values() if i.group is None), key=lambda i: (i.node, i.index))
        if routed:
            lines.append("  routed instances:")
            for inst in routed:
                gpus = ",".join(map(str, inst.gpu_slots)) or "-"
                stage = "" if inst.stage is None else f", stage {inst.stage}"
                shared = f" (in process {inst.process})" if inst.process != inst.instance_id else ""
                lines.append(f"    - {inst.instance_id} on node {inst.ray_node_name}, GPU slots {gpus}{stage}, "
                             f"bundle {inst.bundle}{shared}")
        if decisions:
            lines.extend(self.decisions)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()


class _NodeState:
    """Free resources of one cluster node while planning; GPUs tracked per id."""

    def __init__(self, cn: ClusterNode) -> None:
        self.cn = cn
        whole = int(cn.gpus + _EPS)
        self.gpu_free = [1.0] * whole
        if cn.gpus - whole > _EPS:
            self.gpu_free.append(cn.gpus - whole)
        self.other = {k: float(v) for k, v in cn.resources.items() if k != "GPU"}
        self.ranks: dict[str, int] = {}   # worker group -> ranks placed here

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


def _process_group(node: Node) -> Any:
    """The worker group whose processes an instance lives in: its own, or its host (None: alone)."""
    return node.group or node.host


def process_key(node: Node, index: int) -> str:
    """The Ray actor an instance lives in: its worker group's rank, its host group's rank 0, or its own."""
    group = _process_group(node)
    return f"{group.name}_{index}" if group is not None else f"{node.name}_{index}"


def _demand(node: Node) -> dict[str, float]:
    group = _process_group(node)
    return dict(group.resources) if group is not None else dict(node.resources)


def unit_resources(nodes: Iterable[Node]) -> dict[str, float]:
    """The bundle for a unit: the sum of its processes' resources (at least a sliver of CPU).
    Nodes sharing a worker-group process count once."""
    total: dict[str, float] = {}
    seen: set[str] = set()
    for node in nodes:
        group = _process_group(node)
        key = group.name if group is not None else f"node:{node.name}"
        if key in seen:
            continue
        seen.add(key)
        for k, value in _demand(node).items():
            total[k] = total.get(k, 0.0) + value
    total["CPU"] = max(total.get("CPU", 0.0), MIN_BUNDLE_CPU)
    return {k: round(v, 6) for k, v in total.items()}


def colocation_groups(graph: DataflowGraph) -> list[list[str]]:
    """Connected components over co-located data edges and shared worker groups, in topological order."""
    parent = {n: n for n in graph.nodes}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for e in graph.data_edges():
        if e.colocated:
            parent[find(e.src_name)] = find(e.dst_name)
    for g in graph.groups():
        members = graph.group_nodes(g) + graph.hosted_nodes(g)
        for other in members[1:]:
            parent[find(other)] = find(members[0])
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
        need = _demand(node)
        if any(_NodeState(cn).try_alloc([need]) is not None for cn in nodes):
            continue
        best = {k: max(float(cn.resources.get(k, 0.0)) for cn in nodes) for k in need}
        what = f"worker group '{node.group.name}' of node '{node.name}'" if node.group else f"node '{node.name}'"
        raise DataflowError(f"{what} asks for {_fmt(need)} per instance but no cluster node can hold "
                            f"it (largest: {_fmt(best)}); lower its resources or add bigger nodes")


def _parallelism(graph: DataflowGraph, parallelism: dict[str, int] | None) -> dict[str, int]:
    par = {n: (parallelism or {}).get(n, graph.nodes[n].parallelism) for n in graph.nodes}
    for name, g in graph.groups().items():  # every node of a group has the group's world size
        for n in graph.group_nodes(name):
            par[n] = (parallelism or {}).get(name, par[n])
    return par


def make_plan(graph: DataflowGraph, cluster: list[ClusterNode], parallelism: dict[str, int] | None = None,
              total: list[ClusterNode] | None = None) -> PlacementPlan:
    """Plan every instance of ``graph`` onto ``cluster`` (free resources; ``total``:
    the same nodes with all their resources, for the "can never fit" check). Pure."""
    graph.validate()
    check_feasible(graph, cluster, total)
    par = _parallelism(graph, parallelism)
    states = [_NodeState(copy.deepcopy(cn)) for cn in cluster]
    instances: dict[str, InstancePlan] = {}
    bundles: list[BundlePlan] = []
    decisions: list[str] = []
    comps = colocation_groups(graph)
    order = {n: i for i, n in enumerate(graph.topo_order())}
    comps.sort(key=lambda g: (-max(_demand(graph.nodes[n]).get("GPU", 0.0) for n in g), order[g[0]]))
    for comp in comps:
        units = max(par[n] for n in comp)
        for u in range(units):
            members = [n for n in comp if par[n] > u]
            _place_unit(graph, members, u, states, instances, bundles, decisions, f"b{len(bundles)}")
    _group_decisions(graph, instances, decisions)
    _assign_stages(graph, instances, decisions, par)
    return PlacementPlan(graph=graph.name, instances=instances, bundles=bundles, decisions=decisions)


def _host_decisions(graph: DataflowGraph, group: str, decisions: list[str]) -> None:
    hosted = graph.hosted_nodes(group)
    if hosted:
        verb = "runs" if len(hosted) == 1 else "run"
        decisions.append(f"Scheduling decision: {' and '.join(f'{n}_0' for n in hosted)} {verb} in worker group "
                         f"{group}'s rank 0 process (Node(host=...): no process of their own)")


def _place_unit(graph: DataflowGraph, members: list[str], u: int, states: list[_NodeState],
                instances: dict[str, InstancePlan], bundles: list[BundlePlan], decisions: list[str],
                bid: str) -> None:
    procs: dict[str, Node] = {}
    for n in members:
        procs.setdefault(process_key(graph.nodes[n], u), graph.nodes[n])
    demands = _with_sliver([_demand(node) for node in procs.values()])
    groups = sorted({graph.nodes[n].group.name for n in members if graph.nodes[n].group is not None})
    for st in states:
        if any(_cap_reached(graph.groups()[g], st) for g in groups):
            continue
        ids = st.try_alloc(demands)
        if ids is None:
            continue
        for g in groups:
            st.ranks[g] = st.ranks.get(g, 0) + 1
        bundles.append(BundlePlan(bid, st.cn.node_id, st.cn.name, unit_resources(graph.nodes[n] for n in members),
                                  [f"{n}_{u}" for n in members]))
        gpu_of = dict(zip(procs, ids))
        for n in members:
            node = graph.nodes[n]
            iid = f"{n}_{u}"
            proc = process_key(node, u)
            instances[iid] = InstancePlan(iid, n, u, st.cn.node_id, st.cn.name, gpu_of[proc], bid,
                                          group=node.group.name if node.group is not None else None, process=proc)
        if len(procs) > 1:  # (a group's nodes in one process are the group's own decision line)
            names = " and ".join(f"{n}_{u}" for n in members)
            shared = [f"{g} rank {u}" for g in groups if len(graph.group_nodes(g)) > 1]
            how = f"; {', '.join(shared)} is one process" if shared else ""
            decisions.append(f"Scheduling decision: co-located {names} on node {st.cn.name} "
                             f"(one bundle {bid}: {_fmt(bundles[-1].resources)}{how})")
        return
    if len(procs) > 1:
        decisions.append(f"Scheduling decision: cannot co-locate {', '.join(f'{n}_{u}' for n in members)} on one "
                         f"node (not enough free resources together); placing them apart")
        by_proc: dict[str, list[str]] = {}
        for n in members:
            by_proc.setdefault(process_key(graph.nodes[n], u), []).append(n)
        for i, ms in enumerate(by_proc.values()):
            _place_unit(graph, ms, u, states, instances, bundles, decisions, f"{bid}.{i}")
        return
    node = graph.nodes[members[0]]
    free = "; ".join(f"{st.cn.name}: GPU={sum(st.gpu_free):g} CPU={st.other.get('CPU', 0):g}" for st in states)
    what = f"rank {u} of worker group '{node.group.name}'" if node.group else f"{members[0]}_{u}"
    cap = ""
    if node.group is not None and node.group.ranks_per_node:
        cap = f" at most {node.group.ranks_per_node} rank(s) per node;"
    raise DataflowError(f"cannot place {what} ({_fmt(_demand(node))}):{cap} the cluster has no free room "
                        f"left ({free}); lower parallelism or resources, or add nodes")


def _with_sliver(demands: list[dict[str, float]]) -> list[dict[str, float]]:
    """A bundle takes at least MIN_BUNDLE_CPU (see unit_resources): count it while planning too,
    or CPU-free instances would over-fill a node's CPUs."""
    if sum(d.get("CPU", 0.0) for d in demands) >= MIN_BUNDLE_CPU:
        return demands
    first = dict(demands[0])
    first["CPU"] = first.get("CPU", 0.0) + MIN_BUNDLE_CPU
    return [first, *demands[1:]]


def _cap_reached(group: Any, st: _NodeState) -> bool:
    return bool(group.ranks_per_node) and st.ranks.get(group.name, 0) >= group.ranks_per_node


def _group_decisions(graph: DataflowGraph, instances: dict[str, InstancePlan], decisions: list[str]) -> None:
    for name in graph.groups():
        ranks: dict[int, InstancePlan] = {}
        for inst in instances.values():
            if inst.group == name:
                ranks.setdefault(inst.index, inst)
        runs: list[list[int]] = []   # consecutive ranks on one Ray node
        for r in sorted(ranks):
            if runs and runs[-1][-1] == r - 1 and ranks[runs[-1][0]].ray_node_id == ranks[r].ray_node_id:
                runs[-1].append(r)
            else:
                runs.append([r])
        spans = [f"rank{'s' if len(run) > 1 else ''} {run[0]}{'-' + str(run[-1]) if len(run) > 1 else ''} on "
                 f"{ranks[run[0]].ray_node_name}" for run in runs]
        n_nodes = len({i.ray_node_id for i in ranks.values()})
        g = graph.groups()[name]
        kind = "torch.distributed group" if g.dist else "independent replicas"
        decisions.append(f"Scheduling decision: worker group {name} ({kind}: {', '.join(graph.group_nodes(name))}) "
                         f"has {len(ranks)} rank(s) on {n_nodes} node(s): {'; '.join(spans)}")
        _host_decisions(graph, name, decisions)


def _assign_stages(graph: DataflowGraph, instances: dict[str, InstancePlan], decisions: list[str],
                   par: dict[str, int]) -> None:
    """Whole-GPU instances grouped by Ray node and GPU id into stages; a worker group is staged
    once (its nodes share the ranks' processes)."""
    done: set[str] = set()
    for name, node in graph.nodes.items():
        if par[name] <= 1 or node.gpus < 1:
            continue
        key = node.group.name if node.group is not None else name
        members = graph.group_nodes(key) if node.group is not None else [name]
        insts = sorted((i for i in instances.values() if i.node in members),
                       key=lambda i: (i.ray_node_name, i.ray_node_id, i.gpu_slots, i.index))
        by_node: dict[str, list[InstancePlan]] = {}
        for inst in insts:
            by_node.setdefault(inst.ray_node_id, []).append(inst)
        if key in done:
            continue
        done.add(key)
        parts = []
        for stage, group in enumerate(by_node.values()):
            for inst in group:
                inst.stage = stage
            ranks = sorted({i.index for i in group})
            gpus = sorted({g for inst in group for g in inst.gpu_slots})
            who = (f"ranks {_span(ranks)}" if node.group is not None
                   else ", ".join(i.instance_id for i in group))
            parts.append(f"stage {stage} = {who} on node {group[0].ray_node_name} (GPUs {_span(gpus)})")
        what = f"worker group {key}" if node.group is not None else name
        decisions.append(f"Scheduling decision: staged {what} into {len(by_node)} stage(s) by GPU id: "
                         + "; ".join(parts))


def _span(xs: list[int]) -> str:
    """0,1,2,3 -> '0-3'; 0,2 -> '0,2'."""
    if xs and xs == list(range(xs[0], xs[-1] + 1)) and len(xs) > 2:
        return f"{xs[0]}-{xs[-1]}"
    return ",".join(map(str, xs))


def place_extra(graph: DataflowGraph, node_name: str, index: int, cluster: list[ClusterNode],
                prefer_nodes: list[str], bundle_id: str) -> tuple[InstancePlan, BundlePlan] | None:
    """Plan one more instance of a routed node (live scale-up) on the free resources;
    prefer nodes that host its co-located partners. None when nothing fits."""
    node = graph.nodes[node_name]
    ranked = sorted(cluster, key=lambda cn: (cn.node_id not in prefer_nodes, prefer_nodes.index(cn.node_id)
                                             if cn.node_id in prefer_nodes else 0))
    for cn in ranked:
        st = _NodeState(cn)
        ids = st.try_alloc(_with_sliver([node.resources]))
        if ids is None:
            continue
        iid = f"{node_name}_{index}"
        b = BundlePlan(bundle_id, cn.node_id, cn.name, unit_resources([node]), [iid])
        return InstancePlan(iid, node_name, index, cn.node_id, cn.name, ids[0], bundle_id, process=iid), b
    return None


def place_group(graph: DataflowGraph, group: str, world_size: int, cluster: list[ClusterNode],
                bundle_prefix: str) -> PlacementPlan:
    """Plan a worker group alone at ``world_size`` ranks on the free resources (a live resize)."""
    sub = DataflowGraph(f"{graph.name}-{group}")
    members, hosted = graph.group_nodes(group), graph.hosted_nodes(group)
    for n in members + hosted:
        sub.nodes[n] = graph.nodes[n]
    states = [_NodeState(copy.deepcopy(cn)) for cn in cluster]
    instances: dict[str, InstancePlan] = {}
    bundles: list[BundlePlan] = []
    decisions: list[str] = []
    for u in range(world_size):   # the hosted nodes' one instance goes with rank 0
        _place_unit(sub, members + (hosted if u == 0 else []), u, states, instances, bundles, decisions,
                    f"{bundle_prefix}{u}")
    _group_decisions(sub, instances, decisions)
    return PlacementPlan(graph=graph.name, instances=instances, bundles=bundles, decisions=decisions)


def _fmt(res: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in sorted(res.items()))
