"""HybridScheduler: plans a DataflowGraph, materialises it on Ray and runs it.

Data path: the driver chains actor calls by ObjectRef (like hand-written Ray
code), so items move worker-to-worker through the object store and the driver
only waits on the sink results; at most ``window`` items (the smallest edge
capacity) are in flight, which bounds every channel and the memory it holds.
A monitor thread in the driver measures queues (from which refs are ready),
polls the workers' stats, runs the backpressure controller and publishes a
status snapshot to a named Ray actor (and optionally a JSON file) that the
dashboard reads from outside the driver.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
import warnings
from typing import Any, Sequence

from hpc_verl.dataflow.graph import DataflowGraph, DataflowRunError, Edge
from hpc_verl.dataflow.monitor import MonitorMixin
from hpc_verl.dataflow.plan import ClusterNode, InstancePlan, PlacementPlan, make_plan, place_extra
from hpc_verl.errors import DataflowError
from hpc_verl.util.suggest import did_you_mean

log = logging.getLogger("hpc_verl.dataflow")


class _Instance:
    __slots__ = ("iid", "node", "index", "handle", "pg", "plan", "info", "draining", "outstanding", "stats")

    def __init__(self, iid: str, node: str, index: int, handle: Any, pg: Any, plan: InstancePlan) -> None:
        self.iid, self.node, self.index, self.handle, self.pg, self.plan = iid, node, index, handle, pg, plan
        self.info: dict[str, Any] = {}
        self.draining = False
        self.outstanding = 0
        self.stats: dict[str, Any] = {}

    @property
    def ray_node_id(self) -> str:
        return self.info.get("ray_node_id") or self.plan.ray_node_id


class _Track:
    """One in-flight item: the ref and instance of every node it passes."""

    __slots__ = ("key", "size", "refs", "insts", "waiting")

    def __init__(self, key: int, size: int) -> None:
        self.key, self.size = key, size
        self.refs: dict[str, Any] = {}
        self.insts: dict[str, _Instance] = {}
        self.waiting = 0


class HybridScheduler(MonitorMixin):
    """Places a graph with co-location and staged strategies, runs it with bounded
    channels, adaptive backpressure and strongly consistent control edges."""

    def __init__(self, graph: DataflowGraph, *, cluster: list[ClusterNode] | None = None,
                 backpressure: bool = True, backpressure_window_s: float = 1.0,
                 monitor_interval_s: float = 0.2, stats_interval_s: float = 0.5,
                 status_file: str | None = None, start_timeout_s: float = 120.0) -> None:
        graph.validate()
        self.graph = graph
        self.decisions: list[str] = []
        self._cluster = cluster
        self.backpressure = backpressure
        self.backpressure_window_s = backpressure_window_s
        self.monitor_interval_s = monitor_interval_s
        self.stats_interval_s = stats_interval_s
        self.status_file = status_file
        self.start_timeout_s = start_timeout_s
        self._lock = threading.RLock()
        self._scale_lock = threading.RLock()
        self._instances: dict[str, list[_Instance]] = {n: [] for n in graph.nodes}
        self._routable: dict[str, list[_Instance]] = {n: [] for n in graph.nodes}
        self._next_index = {n: 0 for n in graph.nodes}
        self._board: dict[str, tuple[str, int, list]] = {}  # control edge key -> (src, version, [ref])
        self._live: dict[int, _Track] = {}
        self._item_ids = itertools.count()
        self._order = graph.topo_order()
        self._flow = graph.flow_nodes()
        self._in_data = {n: graph.in_edges(n) for n in graph.nodes}
        self._strong_in = {n: [e.key for e in graph.in_edges(n, control=True) if e.consistency == "strong"]
                           for n in graph.nodes}
        self._coloc_in = {n: [e.src_name for e in self._in_data[n] if e.colocated] for n in graph.nodes}
        self._emitters = [n for n in graph.nodes if graph.out_edges(n, control=True)]
        self._edge: dict[str, dict[str, Any]] = {
            e.key: {"queue": 0, "peak": 0, "items": 0, "last_action": 0.0, "cross_node": 0, "samples": []}
            for e in graph.edges}
        self._node_rate: dict[str, dict[str, float]] = {n: {"t": 0.0, "done": 0, "rate": 0.0} for n in graph.nodes}
        self._retired: dict[str, int] = {n: 0 for n in graph.nodes}  # items processed by removed instances
        self._ulysses = {n: bool(node.ulysses) for n, node in graph.nodes.items()}
        self._items_in = 0
        self._items_out = 0
        self._plan: PlacementPlan | None = None
        self._total: list[ClusterNode] = []
        self._hub: Any = None
        self._pgs: list[Any] = []
        self._monitor: threading.Thread | None = None
        self._stop = threading.Event()
        self._started = False
        self._last_stats = 0.0
        self._tag = uuid.uuid4().hex[:6]
        self._wait_div = 4
        self._bundle_counter = itertools.count()
        self.window = min((e.capacity for e in graph.data_edges()), default=256)

    # ---- planning ------------------------------------------------------------------
    def _clusters(self) -> tuple[list[ClusterNode], list[ClusterNode]]:
        if self._cluster is not None:
            return self._cluster, self._cluster
        from hpc_verl.dataflow.raycluster import cluster_from_ray

        return cluster_from_ray()

    def plan(self) -> PlacementPlan:
        """The placement plan on the cluster's free resources (pure once the cluster is known)."""
        free, total = self._clusters()
        self._total = total
        return make_plan(self.graph, free, total=total)

    @property
    def placement(self) -> PlacementPlan | None:
        """The plan ``start()`` placed the graph by (None before it)."""
        return self._plan

    def _decide(self, line: str) -> None:
        with self._lock:
            self.decisions.append(line)
        log.info(line)

    # ---- materialisation -----------------------------------------------------------
    def start(self) -> "HybridScheduler":
        """Create placement groups, actors and the status actor; start the monitor."""
        import ray

        from hpc_verl.dataflow import raycluster

        if self._started:
            return self
        if not ray.is_initialized():
            raise DataflowError("HybridScheduler.start(): Ray is not initialised; call ray.init(address=...) first")
        plan = self.plan()
        self._plan = plan
        for line in plan.decisions:
            self._decide(line)
        try:
            hub_cls = raycluster.make_hub_class()
            name = raycluster.hub_name(self.graph.name)
            try:
                ray.get_actor(name, namespace=raycluster.NAMESPACE)
            except ValueError:
                pass
            else:
                raise DataflowError(f"a dataflow graph named '{self.graph.name}' is already running on this Ray "
                                    f"cluster; give this graph another name or shut the other one down")
            self._hub = hub_cls.options(name=name, namespace=raycluster.NAMESPACE).remote()
            pgs = {}
            for b in plan.bundles:
                pg = raycluster.pinned_placement_group(b.resources, b.ray_node_id,
                                                       f"{self.graph.name}.{self._tag}.{b.bundle_id}")
                pgs[b.bundle_id] = pg
                self._pgs.append(pg)
            try:
                ray.get([pg.ready() for pg in pgs.values()], timeout=self.start_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise DataflowError(f"graph '{self.graph.name}': placement groups not ready after "
                                    f"{self.start_timeout_s:g}s (the cluster's free resources changed?); "
                                    f"check 'ray status'") from None
            for node in self._order:
                for ip in plan.for_node(node):
                    self._spawn(ip, pgs[ip.bundle])
                    self._next_index[node] = max(self._next_index[node], ip.index + 1)
            self._collect_info([i for insts in self._instances.values() for i in insts])
            for node in self._instances:
                self._routable[node] = list(self._instances[node])
            self._started = True
            self._publish_status()
            self._monitor = threading.Thread(target=self._monitor_loop, name=f"dataflow-{self.graph.name}",
                                             daemon=True)
            self._monitor.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    def _spawn(self, ip: InstancePlan, pg: Any) -> _Instance:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from hpc_verl.dataflow.worker import DataflowWorker

        node = self.graph.nodes[ip.node]
        res = node.resources
        custom = {k: v for k, v in res.items() if k not in ("CPU", "GPU")}
        in_ctl = self.graph.in_edges(ip.node, control=True)
        ins = self._in_data[ip.node]
        spec = {"node": ip.node, "instance_id": ip.instance_id, "index": ip.index, "target": node.target,
                "is_class": node.is_class, "init_args": node.init_args, "init_kwargs": node.init_kwargs,
                "method": node.method, "control_method": node.control_method,
                "in_control": [e.key for e in in_ctl], "edge_of": {e.key: e.data_type or e.key for e in in_ctl},
                "out_control": [e.data_type or e.key for e in self.graph.out_edges(ip.node, control=True)],
                "in_keys": [e.key for e in ins], "in_srcs": [e.src_name for e in ins]}
        opts: dict[str, Any] = {"num_cpus": res.get("CPU", 0.0), "num_gpus": res.get("GPU", 0.0),
                                "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, 0)}
        if custom:
            opts["resources"] = custom
        handle = DataflowWorker.options(**opts).remote(spec)
        inst = _Instance(ip.instance_id, ip.node, ip.index, handle, pg, ip)
        with self._lock:
            self._instances[ip.node].append(inst)
        return inst

    def _collect_info(self, insts: list[_Instance]) -> None:
        import ray

        refs = [i.handle.info.remote() for i in insts]
        try:
            infos = ray.get(refs, timeout=self.start_timeout_s)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            for inst, ref in zip(insts, refs):
                try:
                    ray.get(ref, timeout=self.start_timeout_s)
                except Exception as exc:  # noqa: BLE001 - reported as one line
                    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
                    last = lines[-1] if lines else type(exc).__name__
                    raise DataflowError(f"graph '{self.graph.name}': {inst.iid} failed to start: {last}") from None
            raise
        except ray.exceptions.GetTimeoutError:
            raise DataflowError(f"graph '{self.graph.name}': instances not up after {self.start_timeout_s:g}s") from None
        for inst, info in zip(insts, infos):
            inst.info = info

    # ---- running -------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._started:
            raise DataflowError(f"graph '{self.graph.name}' is not started; call scheduler.start() first")

    def run(self, inputs: dict[str, Sequence[Any]] | Sequence[Any], sinks_only: bool = True,
            micro_batch: int | str = "auto") -> dict[str, list[Any]]:
        """Push items through the graph; return ``{sink: [outputs in input order]}``.

        ``micro_batch``: items per actor call. ``"auto"`` packs many small items
        into one call (1 when there are few items, as with whole PPO batches);
        handlers still see one item at a time."""
        import ray

        self._require_started()
        sources = self.graph.sources()
        if not isinstance(inputs, dict):
            if len(sources) != 1:
                raise DataflowError(f"graph '{self.graph.name}' has {len(sources)} source nodes "
                                    f"({', '.join(sources)}); pass run({{source: items}})")
            inputs = {sources[0]: inputs}
        for name in inputs:
            if name not in sources:
                raise DataflowError(f"run(): '{name}' is not a source node of graph '{self.graph.name}'"
                                    f"{did_you_mean(name, sources)}; sources: {', '.join(sources)}")
        missing = [s for s in sources if s not in inputs]
        if missing:
            raise DataflowError(f"run(): no items given for source node(s) {', '.join(missing)}")
        items = {k: list(v) for k, v in inputs.items()}
        counts = {len(v) for v in items.values()}
        if len(counts) != 1:
            sizes = {k: len(v) for k, v in items.items()}
            raise DataflowError(f"run(): sources got different numbers of items ({sizes}); item i of every "
                                f"source shares one id, so give each the same count")
        n = counts.pop()
        mb = self._micro_batch(n, micro_batch)
        keep = list(self._flow) if not sinks_only else self.graph.sinks()
        watch = set(self.graph.sinks()) | (set(self._emitters) & set(self._flow))
        result_refs: dict[str, list[Any]] = {k: [] for k in keep}
        waiting: dict[Any, _Track] = {}
        pos = 0
        active = 0
        try:
            while pos < n or active:
                while pos < n and active < self.window:
                    size = min(mb, n - pos, max(1, self.window - active))
                    track = self._submit({s: items[s][pos:pos + size] for s in sources}, size)
                    for name in keep:
                        result_refs[name].append(track.refs[name])
                    for name in watch:
                        waiting[track.refs[name]] = track
                        track.waiting += 1
                    pos += size
                    active += size
                refs = list(waiting)
                ready, _ = ray.wait(refs, num_returns=max(1, len(refs) // self._wait_div), fetch_local=False)
                for ref in ready:
                    track = waiting.pop(ref)
                    track.waiting -= 1
                    if track.waiting == 0:
                        active -= track.size
                        self._complete(track)
            envs = ray.get([r for name in keep for r in result_refs[name]])
        except Exception as exc:  # noqa: BLE001 - turned into one clear error
            raise self._run_error(exc) from None
        finally:
            self._abandon({id(t): t for t in waiting.values()}.values())
        out: dict[str, list[Any]] = {}
        it = iter(envs)
        for name in keep:
            vals: list[Any] = []
            for _ in result_refs[name]:
                vals.extend(next(it)[1])
            out[name] = vals
        with self._lock:
            self._items_out += n
        return out

    def _abandon(self, tracks: Any) -> None:
        """Forget items a failed run left in flight (their instances may be drained)."""
        with self._lock:
            for track in tracks:
                if self._live.pop(track.key, None) is not None:
                    for inst in track.insts.values():
                        inst.outstanding -= track.size

    def _micro_batch(self, n: int, micro_batch: int | str) -> int:
        if micro_batch == "auto":
            slots = sum(max(1, len(self._routable[node])) for node in self._flow)
            return max(1, min(32, n // (8 * slots), self.window // (2 * slots)))
        if not isinstance(micro_batch, int) or micro_batch < 1:
            raise DataflowError(f"run(): micro_batch={micro_batch!r} must be an int >= 1 or 'auto'")
        return min(micro_batch, self.window)

    def _submit(self, values: dict[str, list], size: int) -> _Track:
        key = next(self._item_ids)
        track = _Track(key, size)
        with self._lock:
            self._items_in += size
            for node in self._flow:
                ins = self._in_data[node]
                inst = self._choose(node, track)
                strong = self._strong_in[node]
                args = [track.refs[e.src_name] for e in ins] if ins else [values[node]]
                required = {k: self._board[k] for k in strong if k in self._board} if strong else None
                if required:
                    ref = inst.handle.run_required.remote(required, *args)
                else:
                    ref = inst.handle.run.remote(*args)
                inst.outstanding += size
                track.refs[node] = ref
                track.insts[node] = inst
            self._live[key] = track
        return track

    def _choose(self, node: str, track: _Track) -> _Instance:
        cands = self._routable[node]
        if not cands:
            raise DataflowError(f"node '{node}' has no live instance to take items; raise its parallelism")
        partners = self._coloc_in[node]
        if partners and len(cands) > 1:
            up = track.insts[partners[0]]
            same = [c for c in cands if c.plan.bundle == up.plan.bundle]
            if not same:
                same = [c for c in cands if c.ray_node_id == up.ray_node_id]
            if same:
                cands = same
            else:
                self._edge[f"{partners[0]}->{node}"]["cross_node"] += track.size
        if len(cands) == 1:
            return cands[0]
        return min(cands, key=lambda c: c.outstanding)

    def _complete(self, track: _Track) -> None:
        import ray

        with self._lock:
            if self._live.pop(track.key, None) is None:
                return
            for inst in track.insts.values():
                inst.outstanding -= track.size
            for e in self.graph.data_edges():
                self._edge[e.key]["items"] += track.size
        for node in self._emitters:
            if node not in track.refs:
                continue
            try:
                env = ray.get(track.refs[node])
            except Exception as exc:  # noqa: BLE001
                raise self._run_error(exc) from None
            for data_type, version, payload in env[2] or ():
                edge = next(e for e in self.graph.out_edges(node, control=True)
                            if (e.data_type or e.key) == data_type)
                self._publish(edge, payload, version, src=node, strict=False)

    def _run_error(self, exc: BaseException) -> DataflowError:
        import ray

        cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None else exc
        if isinstance(cause, DataflowError):
            return cause
        where = ""
        text = str(exc)
        for insts in self._instances.values():
            for inst in insts:
                aid = inst.handle._actor_id.hex()
                if aid in text:
                    where = f" in {inst.iid}"
        first = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
        return DataflowRunError(f"graph '{self.graph.name}': a node failed{where}: {type(cause).__name__}: {first}")

    # ---- control edges -------------------------------------------------------------
    def send_control(self, edge: Edge | str, payload: Any, version: int, *, _delay_s: float = 0.0) -> None:
        """Publish ``payload`` as ``version`` on a control edge, from the driver.
        ``_delay_s`` delays delivery of the broadcast (tests of stale rejection)."""
        self._require_started()
        e = self.graph.edge(edge)
        if not e.control:
            raise DataflowError(f"edge {e.key} is a data edge; send_control needs a control edge")
        self._publish(e, payload, version, src="driver", delay_s=_delay_s)

    def _publish(self, e: Edge, payload: Any, version: int, src: str, delay_s: float = 0.0,
                 strict: bool = True) -> None:
        import ray

        if not isinstance(version, int) or isinstance(version, bool):
            raise DataflowError(f"control edge {e.key}: version {version!r} must be an int")
        with self._lock:
            prev = self._board.get(e.key)
            if prev is not None and version <= prev[1] and not strict:
                self._decide(f"Scheduling decision: dropped stale control v{version} from {src} on {e.key} "
                             f"(v{prev[1]} already published)")
                return
            if prev is not None and version <= prev[1]:
                raise DataflowError(f"control edge {e.key}: version {version} is not newer than the published "
                                    f"{prev[1]}; versions must grow")
            ref = ray.put(payload)
            self._board[e.key] = (src, version, [ref])
            targets = [i for i in self._instances[e.dst_name] if not i.draining]
        for inst in targets:
            inst.handle.apply_control.remote(e.key, src, version, [ref], delay_s)

    # ---- runtime control -----------------------------------------------------------
    def call_all(self, node_name: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every live instance of a class node; results in instance order."""
        self._require_started()
        self._node(node_name)
        insts = sorted(self._routable[node_name], key=lambda i: i.index)
        with self._lock:
            required = {k: self._board[k] for k in self._strong_in[node_name] if k in self._board} or None
        return self._gather_calls(node_name, [i.handle.call.remote(method, args, kwargs, required) for i in insts])

    def _gather_calls(self, node_name: str, refs: list) -> list[Any]:
        """Results of instance calls; control messages they emitted are published."""
        import ray

        try:
            pairs = ray.get(refs)
        except Exception as exc:  # noqa: BLE001
            raise self._run_error(exc) from None
        for _, emitted in pairs:
            for data_type, version, payload in emitted or ():
                edge = next(e for e in self.graph.out_edges(node_name, control=True)
                            if (e.data_type or e.key) == data_type)
                self._publish(edge, payload, version, src=node_name, strict=False)
        return [result for result, _ in pairs]

    def call_each(self, node_name: str, method: str, args_per_instance: Sequence[tuple]) -> list[Any]:
        """Call ``method(*args_per_instance[i])`` on instance i (e.g. one data shard each)."""
        self._require_started()
        self._node(node_name)
        insts = sorted(self._routable[node_name], key=lambda i: i.index)
        if len(args_per_instance) != len(insts):
            raise DataflowError(f"call_each('{node_name}', '{method}'): {len(args_per_instance)} argument tuples "
                                f"for {len(insts)} instances; give one per instance")
        with self._lock:
            required = {k: self._board[k] for k in self._strong_in[node_name] if k in self._board} or None
        return self._gather_calls(node_name, [i.handle.call.remote(method, tuple(a), {}, required)
                                              for i, a in zip(insts, args_per_instance)])

    def instances(self, node_name: str) -> list[str]:
        self._node(node_name)
        return [i.iid for i in sorted(self._routable[node_name], key=lambda i: i.index)]

    def _node(self, node_name: str) -> None:
        if node_name not in self.graph.nodes:
            raise DataflowError(f"graph '{self.graph.name}' has no node '{node_name}'"
                                f"{did_you_mean(node_name, self.graph.nodes)}; nodes: {', '.join(self.graph.nodes)}")

    def adjust_parallelism(self, node_name: str, target_parallelism: int, reason: str = "manual",
                           drain_timeout_s: float = 600.0) -> int:
        """Scale a node live to ``target_parallelism``; returns the parallelism reached."""
        self._require_started()
        self._node(node_name)
        if not isinstance(target_parallelism, int) or target_parallelism < 1:
            raise DataflowError(f"adjust_parallelism('{node_name}'): target {target_parallelism!r} must be an int >= 1")
        with self._scale_lock:
            before = len(self._routable[node_name])
            if target_parallelism > before:
                added = []
                for _ in range(target_parallelism - before):
                    inst = self._add_instance(node_name)
                    if inst is None:
                        self._decide(f"Scheduling decision: cannot raise {node_name} beyond "
                                     f"{before + len(added)}: no free resources for another instance ({reason})")
                        break
                    added.append(inst.iid)
                after = len(self._routable[node_name])
                if added:
                    where = ", ".join(f"{i.iid} on node {i.plan.ray_node_name}"
                                      for i in self._routable[node_name] if i.iid in added)
                    self._decide(f"Scheduling decision: raised {node_name} parallelism {before} -> {after} "
                                 f"({reason}): {where}")
                return after
            if target_parallelism < before:
                with self._lock:
                    victims = sorted(self._routable[node_name], key=lambda i: i.index)[target_parallelism:]
                    for v in victims:
                        v.draining = True
                    self._routable[node_name] = [i for i in self._routable[node_name] if not i.draining]
                self._decide(f"Scheduling decision: lowered {node_name} parallelism {before} -> "
                             f"{target_parallelism} ({reason}): draining {', '.join(v.iid for v in victims)}")
                self._drain(victims, drain_timeout_s)
            return len(self._routable[node_name])

    def _add_instance(self, node_name: str) -> _Instance | None:
        import ray

        from hpc_verl.dataflow import raycluster

        free, _ = self._clusters()
        partners = {e.src_name for e in self.graph.in_edges(node_name) if e.colocated}
        partners |= {e.dst_name for e in self.graph.out_edges(node_name) if e.colocated}
        prefer = []
        for p in sorted(partners):
            for inst in self._routable[p]:
                if inst.ray_node_id not in prefer:
                    prefer.append(inst.ray_node_id)
        index = self._next_index[node_name]
        placed = place_extra(self.graph, node_name, index, free, prefer, f"x{next(self._bundle_counter)}")
        if placed is None:
            return None
        ip, bundle = placed
        pg = raycluster.pinned_placement_group(bundle.resources, bundle.ray_node_id,
                                               f"{self.graph.name}.{self._tag}.{bundle.bundle_id}")
        try:
            ray.get(pg.ready(), timeout=30)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(pg)
            return None
        self._pgs.append(pg)
        self._next_index[node_name] = index + 1
        inst = self._spawn(ip, pg)
        self._collect_info([inst])
        # a new instance starts from the latest state of every incoming control edge
        with self._lock:
            board = {e.key: self._board[e.key] for e in self.graph.in_edges(node_name, control=True)
                     if e.key in self._board}
        if board:
            ray.get([inst.handle.apply_control.remote(k, src, v, refs) for k, (src, v, refs) in board.items()])
        if self._ulysses.get(node_name) is False and self.graph.nodes[node_name].ulysses:
            self._set_ulysses([inst], False)
        with self._lock:
            self._routable[node_name] = self._routable[node_name] + [inst]
        return inst

    def _drain(self, victims: list[_Instance], timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        while any(v.outstanding > 0 for v in victims):
            if time.monotonic() > deadline:
                raise DataflowError(f"draining {', '.join(v.iid for v in victims)} took over {timeout_s:g}s")
            time.sleep(0.02)
        for v in victims:
            try:
                stats = ray.get(v.handle.stats.remote(), timeout=10)
                self._retired[v.node] += int(stats.get("processed", 0))
            except Exception:  # noqa: BLE001 - a dead instance has nothing to count
                pass
            self._kill(v)
            with self._lock:
                self._instances[v.node] = [i for i in self._instances[v.node] if i is not v]

    def _kill(self, inst: _Instance) -> None:
        import ray

        try:
            ray.kill(inst.handle)
        except Exception:  # noqa: BLE001
            pass
        if inst.pg is not None and not any(i.pg is inst.pg for insts in self._instances.values()
                                           for i in insts if i is not inst):
            try:
                ray.util.remove_placement_group(inst.pg)
            except Exception:  # noqa: BLE001
                pass
            self._pgs = [p for p in self._pgs if p is not inst.pg]

    def disable_ulysses(self, node_name: str) -> bool:
        """Switch off a node's sequence-parallel mode; a warned no-op if it has none."""
        self._node(node_name)
        if not self.graph.nodes[node_name].ulysses:
            msg = f"disable_ulysses('{node_name}'): node has no sequence-parallel (Ulysses) mode; nothing to do"
            warnings.warn(msg, stacklevel=2)
            self._decide(f"Scheduling decision: {msg}")
            return False
        if self._started:
            self._set_ulysses(self._routable[node_name], False)
        self._ulysses[node_name] = False
        self._decide(f"Scheduling decision: disabled Ulysses sequence parallelism for {node_name}")
        return True

    def _set_ulysses(self, insts: list[_Instance], enabled: bool) -> None:
        import ray

        has = ray.get([i.handle.has_method.remote("set_ulysses") for i in insts]) if insts else []
        self._gather_calls(insts[0].node if insts else "", [i.handle.call.remote("set_ulysses", (enabled,), {})
                                                             for i, h in zip(insts, has) if h])

    # ---- teardown ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the monitor; kill exactly this graph's actors, placement groups and status actor."""
        import ray

        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=10)
        if not ray.is_initialized():
            return
        for insts in self._instances.values():
            for inst in insts:
                try:
                    ray.kill(inst.handle)
                except Exception:  # noqa: BLE001
                    pass
        for pg in self._pgs:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        if self._hub is not None:
            try:
                ray.kill(self._hub)
            except Exception:  # noqa: BLE001
                pass
        self._pgs, self._hub = [], None
        self._instances = {n: [] for n in self.graph.nodes}
        self._routable = {n: [] for n in self.graph.nodes}
        self._started = False

    def __enter__(self) -> "HybridScheduler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
