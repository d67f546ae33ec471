"""The scheduler's instance pool: the Ray actors (processes) of a running graph.

It creates the pinned placement groups of a plan, spawns one actor per process
(a routed instance, or a worker group's rank hosting every node of the group),
runs the group rendezvous, and later adds routed replicas, drains them, and
replaces a whole worker group (a live resize). It is the only part of the
scheduler that creates or kills actors and placement groups.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Callable

from hpc_verl.dataflow.graph import DataflowGraph
from hpc_verl.dataflow.placement import BundlePlan, ClusterNode, InstancePlan, PlacementPlan, place_extra
from hpc_verl.errors import DataflowError, HpcVerlError


class Proc:
    """One Ray actor: a routed instance, or rank ``rank`` of worker group ``group``."""

    __slots__ = ("key", "group", "rank", "world_size", "handle", "pg", "bundle", "info", "nodes")

    def __init__(self, key: str, group: str | None, rank: int, world_size: int, handle: Any, pg: Any,
                 bundle: BundlePlan) -> None:
        self.key, self.group, self.rank, self.world_size = key, group, rank, world_size
        self.handle, self.pg, self.bundle = handle, pg, bundle
        self.info: dict[str, Any] = {}
        self.nodes: list[str] = []


class Instance:
    """One instance of one node (``<node>_<index>``), living in a Proc."""

    __slots__ = ("iid", "node", "index", "proc", "plan", "draining", "outstanding", "stats")

    def __init__(self, iid: str, node: str, index: int, proc: Proc, plan: InstancePlan) -> None:
        self.iid, self.node, self.index, self.proc, self.plan = iid, node, index, proc, plan
        self.draining = False
        self.outstanding = 0
        self.stats: dict[str, Any] = {}

    @property
    def handle(self) -> Any:
        return self.proc.handle

    @property
    def ray_node_id(self) -> str:
        return self.proc.info.get("ray_node_id") or self.plan.ray_node_id

    @property
    def info(self) -> dict[str, Any]:
        return self.proc.info

    def where(self) -> str:
        """How error lines name it: node, rank and Ray node."""
        rank = f" rank {self.index}/{self.proc.world_size} of group '{self.proc.group}'" if self.proc.group else ""
        host = self.proc.info.get("hostname") or self.plan.ray_node_name
        return f"{self.iid}{rank} on node {self.plan.ray_node_name} ({host}, pid {self.proc.info.get('pid', '?')})"


class InstancePool:
    def __init__(self, graph: DataflowGraph, tag: str, start_timeout_s: float, lock: threading.RLock,
                 decide: Callable[[str], None]) -> None:
        self.graph = graph
        self.tag = tag
        self.start_timeout_s = start_timeout_s
        self.lock = lock
        self.decide = decide
        self.procs: dict[str, Proc] = {}
        self.instances: dict[str, list[Instance]] = {n: [] for n in graph.nodes}
        self.routable: dict[str, list[Instance]] = {n: [] for n in graph.nodes}
        self.next_index = {n: 0 for n in graph.nodes}
        self.retired: dict[str, dict[str, int]] = {n: {"processed": 0, "rows": 0} for n in graph.nodes}
        self.world: dict[str, int] = {g: grp.world_size for g, grp in graph.groups().items()}
        self._pgs: list[Any] = []
        self._bundles = itertools.count()
        self._generation = {g: 0 for g in graph.groups()}

    # ---- queries -------------------------------------------------------------------
    def all_instances(self) -> list[Instance]:
        return [i for insts in self.instances.values() for i in insts]

    def group_procs(self, group: str) -> list[Proc]:
        return sorted((p for p in self.procs.values() if p.group == group), key=lambda p: p.rank)

    def find(self, actor_hex: str) -> list[Instance]:
        return [i for i in self.all_instances() if i.handle._actor_id.hex() == actor_hex]

    # ---- materialisation -----------------------------------------------------------
    def _placement_group(self, bundle: BundlePlan) -> Any:
        from hpc_verl.dataflow import raycluster

        pg = raycluster.pinned_placement_group(bundle.resources, bundle.ray_node_id,
                                               f"{self.graph.name}.{self.tag}.{bundle.bundle_id}")
        self._pgs.append(pg)
        return pg

    def _wait_ready(self, pgs: list[Any], what: str) -> None:
        import ray

        try:
            ray.get([pg.ready() for pg in pgs], timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DataflowError(f"graph '{self.graph.name}': placement groups for {what} not ready after "
                                f"{self.start_timeout_s:g}s (the cluster's free resources changed?); "
                                f"check 'ray status'") from None

    def spawn(self, plan: PlacementPlan, what: str) -> list[Proc]:
        """Placement groups and processes of ``plan``; their ``__init__`` (module imports) runs
        while the caller goes on. ``finish`` sets them up."""
        pgs = {b.bundle_id: self._placement_group(b) for b in plan.bundles}
        self._wait_ready(list(pgs.values()), what)
        return [self._spawn(key, insts, pgs[insts[0].bundle], plan.bundle(insts[0].bundle))
                for key, insts in plan.processes().items()]

    def finish(self, procs: list[Proc], nodes: list[str]) -> None:
        """Rendezvous and node objects of spawned ``procs``; ``nodes`` become routable."""
        self._setup(procs)
        with self.lock:
            for node in nodes:
                self.routable[node] = sorted(self.instances[node], key=lambda i: i.index)

    def _spawn(self, key: str, plans: list[InstancePlan], pg: Any, bundle: BundlePlan) -> Proc:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hpc_verl.dataflow.worker import DataflowWorker

        lead = next((p for p in plans if p.group is not None), plans[0])   # (hosted nodes ride with a rank)
        first = self.graph.nodes[lead.node]
        group = first.group if lead.group is not None else None
        res = dict(group.resources if group is not None else first.resources)
        world = self.world[group.name] if group is not None else 1
        rank = lead.index if group is not None else 0
        spec: dict[str, Any] = {"process": key, "graph": self.graph.name, "rank": rank, "world_size": world,
                                "group": group.name if group is not None else None,
                                "dist": ({"backend": group.backend, "timeout_s": group.timeout_s}
                                         if group is not None and group.dist else None),
                                "nodes": {p.node: self._node_spec(p) for p in plans}}
        custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
        opts: dict[str, Any] = {"num_cpus": res.get("CPU", 0.0), "num_gpus": res.get("GPU", 0.0),
                                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, 0)}
        if custom:
            opts["resources"] = custom
        handle = DataflowWorker.options(**opts).remote(spec)
        proc = Proc(key, spec["group"], rank, world, handle, pg, bundle)
        with self.lock:
            self.procs[key] = proc
            for p in plans:
                proc.nodes.append(p.node)
                self.instances[p.node].append(Instance(p.instance_id, p.node, p.index, proc, p))
                self.next_index[p.node] = max(self.next_index[p.node], p.index + 1)
        return proc

    def _node_spec(self, ip: InstancePlan) -> dict[str, Any]:
        g = self.graph
        node = g.nodes[ip.node]
        in_ctl = g.in_edges(ip.node, control=True)
        inputs = [{"key": e.key, "src": e.src_name, "src_dispatch": g.nodes[e.src_name].dispatch,
                   "src_collect": g.nodes[e.src_name].collect,
                   "planned": node.take_rows is not None and g.nodes[e.src_name].dispatch == "split"}
                  for e in g.in_edges(ip.node)]
        # a split node cuts each of its outputs into the rows that each rank of a take_rows consumer uses
        plans = ({e.dst_name: g.nodes[e.dst_name].take_rows for e in g.out_edges(ip.node)
                  if g.nodes[e.dst_name].take_rows is not None} if node.dispatch == "split" else {})
        return {"instance_id": ip.instance_id, "index": ip.index, "target": node.target, "is_class": node.is_class,
                "method": node.method,
                "control_method": node.control_method, "dispatch": node.dispatch, "split_key": node.split_key,
                "in_control": [e.key for e in in_ctl], "edge_of": {e.key: e.data_type or e.key for e in in_ctl},
                "out_control": [e.data_type or e.key for e in g.out_edges(ip.node, control=True)],
                "inputs": inputs, "row_plans": plans}

    def _setup(self, procs: list[Proc]) -> None:
        """Rendezvous of every dist group among ``procs``, then build the node objects."""
        import ray

        by_group: dict[str | None, list[Proc]] = {}
        for p in procs:
            by_group.setdefault(p.group, []).append(p)
        refs: list[tuple[Proc, Any]] = []
        try:
            for group, members in by_group.items():
                dist = group is not None and self.graph.groups()[group].dist
                address = None
                if dist:
                    rank0 = next(p for p in members if p.rank == 0)
                    address = ray.get(rank0.handle.open_rendezvous.remote(), timeout=self.start_timeout_s)
                    self.decide(f"Scheduling decision: worker group {group} rendezvous at "
                                f"{address[0]}:{address[1]} ({len(members)} rank(s), backend "
                                f"{self.graph.groups()[group].backend})")
                refs.extend((p, p.handle.setup.remote(address, self._inits(p))) for p in members)
            infos = ray.get([r for _, r in refs], timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise DataflowError(f"graph '{self.graph.name}': instances not up after {self.start_timeout_s:g}s "
                                f"(a rank that cannot reach rank 0, or a slow model load)") from None
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            for p, ref in refs:
                try:
                    ray.get(ref, timeout=self.start_timeout_s)
                except Exception as exc:  # noqa: BLE001 - reported as one line
                    cause = getattr(exc, "cause", None)   # a RayTaskError carries the rank's own error
                    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                    last = str(cause) if isinstance(cause, HpcVerlError) else lines[-1] if lines \
                        else type(exc).__name__
                    what = ", ".join(f"{n}_{p.rank}" for n in p.nodes)
                    raise DataflowError(f"graph '{self.graph.name}': {what} failed to start: {last}") from None
            raise
        for (p, _), info in zip(refs, infos):
            p.info = info

    def _inits(self, proc: Proc) -> dict[str, tuple[tuple, dict]]:
        """The init arguments of ``proc``'s nodes as they are now (sent with ``setup``, not with
        the process: they may be set after ``spawn``)."""
        return {n: (tuple(self.graph.nodes[n].init_args), dict(self.graph.nodes[n].init_kwargs or {}))
                for n in proc.nodes}

    # ---- routed replicas -----------------------------------------------------------
    def add_route_instance(self, node_name: str, free: list[ClusterNode]) -> Instance | None:
        """One more replica of a routed node (prefers its co-located partners' Ray nodes)."""
        import ray

        partners = {e.src_name for e in self.graph.in_edges(node_name) if e.colocated}
        partners |= {e.dst_name for e in self.graph.out_edges(node_name) if e.colocated}
        prefer: list[str] = []
        for p in sorted(partners):
            for inst in self.routable[p]:
                if inst.ray_node_id not in prefer:
                    prefer.append(inst.ray_node_id)
        index = self.next_index[node_name]
        placed = place_extra(self.graph, node_name, index, free, prefer, f"x{next(self._bundles)}")
        if placed is None:
            return None
        ip, bundle = placed
        pg = self._placement_group(bundle)
        try:
            ray.get(pg.ready(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            self._remove_pg(pg)
            return None
        proc = self._spawn(ip.process, [ip], pg, bundle)
        self._setup([proc])
        return next(i for i in self.instances[node_name] if i.proc is proc)

    def drain(self, victims: list[Instance], timeout_s: float) -> None:
        """Wait until the victims hold no items, count what they did, kill them."""
        import ray

        deadline = time.monotonic() + timeout_s
        while any(v.outstanding > 0 for v in victims):
            if time.monotonic() > deadline:
                raise DataflowError(f"draining {', '.join(v.iid for v in victims)} took over {timeout_s:g}s")
            time.sleep(0.02)
        for v in victims:
            self._retire(v, ray)
            self.kill_proc(v.proc)

    def _retire(self, inst: Instance, ray: Any) -> None:
        try:
            stats = ray.get(inst.handle.stats.remote(), timeout=10)["nodes"].get(inst.node, {})
        except Exception:  # noqa: BLE001 - a dead instance has nothing more to count
            stats = inst.stats
        self.retired[inst.node]["processed"] += int(stats.get("processed", 0))
        self.retired[inst.node]["rows"] += int(stats.get("rows", 0))

    def kill_proc(self, proc: Proc) -> None:
        import ray

        try:
            ray.kill(proc.handle)
        except Exception:  # noqa: BLE001
            pass
        with self.lock:
            self.procs.pop(proc.key, None)
            for node in proc.nodes:
                self.instances[node] = [i for i in self.instances[node] if i.proc is not proc]
                self.routable[node] = [i for i in self.routable[node] if i.proc is not proc]
        if not any(p.pg is proc.pg for p in self.procs.values()):
            self._remove_pg(proc.pg)

    def _remove_pg(self, pg: Any) -> None:
        import ray

        try:
            ray.util.remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
        self._pgs = [p for p in self._pgs if p is not pg]

    # ---- worker groups -------------------------------------------------------------
    def replace_group(self, group: str, plan: PlacementPlan) -> list[Proc]:
        """Kill the group's processes and start ``plan``'s (a resize at a step boundary)."""
        import ray

        for proc in self.group_procs(group):
            for node in proc.nodes:
                inst = next(i for i in self.instances[node] if i.proc is proc)
                self._retire(inst, ray)
            self.kill_proc(proc)
        self._generation[group] += 1
        self.world[group] = plan.groups()[group]["world_size"]
        return self._start(plan, f"worker group {group}",
                           self.graph.group_nodes(group) + self.graph.hosted_nodes(group))

    def _start(self, plan: PlacementPlan, what: str, nodes: list[str]) -> list[Proc]:
        """Placement groups, processes, rendezvous and node objects of ``plan``; ``nodes`` routable."""
        procs = self.spawn(plan, what)
        self.finish(procs, nodes)
        return procs

    def releasable(self, group: str) -> list[BundlePlan]:
        """The bundles that only this group's processes use (given back by a resize)."""
        out: dict[int, BundlePlan] = {}
        for proc in self.group_procs(group):
            if all(p.group == group for p in self.procs.values() if p.pg is proc.pg):
                out[id(proc.pg)] = proc.bundle
        return list(out.values())

    def bundle_prefix(self, group: str) -> str:
        return f"{group}.g{self._generation[group] + 1}.r"

    # ---- teardown ------------------------------------------------------------------
    def shutdown(self) -> None:
        import ray

        for proc in list(self.procs.values()):
            try:
                ray.kill(proc.handle)
            except Exception:  # noqa: BLE001
                pass
        for pg in list(self._pgs):
            self._remove_pg(pg)
        self.procs.clear()
        self.instances = {n: [] for n in self.graph.nodes}
        self.routable = {n: [] for n in self.graph.nodes}
