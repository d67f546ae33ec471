"""HybridScheduler: plans a DataflowGraph, materialises it on Ray and runs it.

The seed's API lives here; the work is done by four parts with one job each:
``pool.InstancePool`` (actors and placement groups: spawn, resize, drain, kill),
``board.ControlBoard`` (control versions and how they are delivered),
``router.Router`` (items through the graph, method calls, error lines) and
``monitor.Monitor`` (queues, stats, backpressure, the status snapshot the
dashboard reads).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import uuid
import warnings
from typing import Any, Callable, Iterator, Sequence

from hpc_verl.dataflow.board import ControlBoard
from hpc_verl.dataflow.distgroup import DEFAULT_BUCKET_BYTES
from hpc_verl.dataflow.graph import DataflowGraph, Edge
from hpc_verl.dataflow.monitor import Monitor, Tables
from hpc_verl.dataflow.placement import ClusterNode, PlacementPlan, make_plan, place_group
from hpc_verl.dataflow.pool import Instance, InstancePool
from hpc_verl.dataflow.router import Router
from hpc_verl.errors import DataflowError
from hpc_verl.util.suggest import did_you_mean

log = logging.getLogger("hpc_verl.dataflow")


class HybridScheduler:
    """Places a graph with worker-group, co-location and staged strategies, runs it with
    bounded channels, adaptive backpressure and strongly consistent control edges."""

    def __init__(self, graph: DataflowGraph, *, cluster: list[ClusterNode] | None = None,
                 backpressure: bool = True, backpressure_window_s: float = 1.0,
                 monitor_interval_s: float = 0.2, stats_interval_s: float = 0.5,
                 status_file: str | None = None, start_timeout_s: float = 120.0,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, scratch_dir: str | None = None) -> None:
        graph.validate()
        self.graph = graph
        self.decisions: list[str] = []
        self.lock = threading.RLock()
        self._cluster = cluster
        self._scale_lock = threading.RLock()
        self._tag = uuid.uuid4().hex[:6]
        self._plan: PlacementPlan | None = None
        self._total: list[ClusterNode] = []
        self._hub: Any = None
        self._started = False
        self._spawned: list[Any] | None = None   # processes spawn() created, not yet set up
        self._ulysses = {n: bool(node.ulysses) for n, node in graph.nodes.items()}
        self.scratch_dir = scratch_dir
        self.edge_stats: dict[str, dict[str, Any]] = {
            e.key: {"queue": 0, "peak": 0, "items": 0, "last_action": 0.0, "cross_node": 0, "samples": []}
            for e in graph.edges}
        self.pool = InstancePool(graph, self._tag, start_timeout_s, self.lock, self._decide)
        self.board = ControlBoard(graph, self.pool, self.lock, self._decide, bucket_bytes)
        self.router = Router(graph, self.pool, self.board, self.lock, self.edge_stats)
        tables = Tables(graph, self.pool, self.router, self.board, self.lock, self.edge_stats)
        self.monitor = Monitor(self, tables, backpressure, backpressure_window_s, monitor_interval_s,
                               stats_interval_s, status_file)

    @property
    def window(self) -> int:
        return self.router.window

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

    def _place(self) -> PlacementPlan:
        """Plan on the cluster and keep the plan; each of its decisions is logged here, once
        (the plan's text in the driver's log leaves them out: ``PlacementPlan.describe``)."""
        plan = self.plan()
        self._plan = plan
        for line in plan.decisions:
            self._decide(line)
        return plan

    @property
    def placement(self) -> PlacementPlan | None:
        """The plan ``start()`` placed the graph by (None before it)."""
        return self._plan

    def _decide(self, line: str) -> None:
        with self.lock:
            self.decisions.append(line)
        log.info(line)

    decide = _decide   # (the monitor logs its decisions through it)

    @property
    def started(self) -> bool:
        return self._started

    @property
    def hub(self) -> Any:
        """The named status actor the dashboard reads (None when not started)."""
        return self._hub

    @property
    def cluster_total(self) -> list[ClusterNode]:
        """Every Ray node with all its resources, as last planned against."""
        return list(self._total)

    def ulysses_on(self, node_name: str) -> bool | None:
        """The node's sequence-parallel mode (None: it has none)."""
        return self._ulysses[node_name] if self.graph.nodes[node_name].ulysses is not None else None

    # ---- materialisation -----------------------------------------------------------
    def spawn(self) -> "HybridScheduler":
        """Place the graph and create its processes, without waiting for them: each imports its
        nodes' modules (torch, transformers) while the caller gets on with its own set-up;
        ``start()`` then builds the node objects, with the init arguments set by then
        (``set_init_args``). Calling ``start()`` alone does both."""
        import ray

        from hpc_verl.dataflow import raycluster

        if self._started or self._spawned is not None:
            return self
        if not ray.is_initialized():
            raise DataflowError("HybridScheduler.start(): Ray is not initialised; call ray.init(address=...) first")
        plan = self._place()
        try:
            name = raycluster.hub_name(self.graph.name)
            try:
                ray.get_actor(name, namespace=raycluster.NAMESPACE)
            except ValueError:
                pass
            else:
                raise DataflowError(f"a dataflow graph named '{self.graph.name}' is already running on this Ray "
                                    f"cluster; give this graph another name or shut the other one down")
            self._spawned = self.pool.spawn(plan, "the graph")
        except BaseException:
            self.shutdown()
            raise
        return self

    def set_init_args(self, node_name: str, *args: Any, **kwargs: Any) -> None:
        """Replace a node's init arguments between ``spawn()`` and ``start()`` (a value the
        caller only knows once its own set-up is done, such as a step count)."""
        if self._started:
            raise DataflowError(f"set_init_args('{node_name}'): graph '{self.graph.name}' is already started")
        self._node(node_name)
        node = self.graph.nodes[node_name]
        node.init_args, node.init_kwargs = tuple(args), dict(kwargs)

    def start(self) -> "HybridScheduler":
        """Create placement groups, actors (with their process groups) and the status actor;
        start the monitor."""
        if self._started:
            return self
        self.spawn()
        procs, self._spawned = self._spawned, None
        try:
            self.pool.finish(procs or [], list(self.graph.nodes))
            # the status actor last: its process start is not in the way of the graph's own
            from hpc_verl.dataflow import raycluster
            self._hub = raycluster.make_hub_class().options(name=raycluster.hub_name(self.graph.name),
                                                            namespace=raycluster.NAMESPACE).remote()
            self._started = True
            self.monitor.publish()
            self.monitor.start()
        except BaseException:
            self.shutdown()
            raise
        return self

    # ---- running -------------------------------------------------------------------
    def _require_started(self) -> None:
        if not self._started:
            raise DataflowError(f"graph '{self.graph.name}' is not started; call scheduler.start() first")

    def run(self, inputs: dict[str, Sequence[Any]] | Sequence[Any], sinks_only: bool = True,
            micro_batch: int | str = "auto") -> dict[str, list[Any]]:
        """Push items through the graph; return ``{sink: [outputs in input order]}``.

        ``micro_batch``: items per actor call. ``"auto"`` packs many small items
        into one call (1 when there are few items, as with whole PPO batches, and
        whenever a worker group is on the path); handlers still see one item at a time."""
        self._require_started()
        return self.router.run(inputs, sinks_only, micro_batch)

    def stream(self, produce: Callable[[], Any], depth: int = 2) -> Iterator[dict[str, Any]]:
        """Feed the graph's one source from ``produce()`` (None: stop), ``depth`` items in flight;
        yields ``{sink: output}`` per item in input order (see ``Router.stream``)."""
        self._require_started()
        return self.router.stream(produce, depth)

    def send_control(self, edge: Edge | str, payload: Any, version: int, *, _delay_s: float = 0.0) -> None:
        """Publish ``payload`` as ``version`` on a control edge, from the driver (``TENSORS``:
        move the source node's tensors by the edge's tensor transport).
        ``_delay_s`` delays delivery of the broadcast (tests of stale rejection)."""
        self._require_started()
        e = self.graph.edge(edge)
        if not e.control:
            raise DataflowError(f"edge {e.key} is a data edge; send_control needs a control edge")
        self.board.publish(e, payload, version, src="driver", delay_s=_delay_s)

    def call_all(self, node_name: str, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every live instance of a class node (all ranks of a worker group
        together); results in instance order."""
        self._require_started()
        self._node(node_name)
        return self.router.call(node_name, method, [tuple(args)], kwargs)

    def call_each(self, node_name: str, method: str, args_per_instance: Sequence[tuple]) -> list[Any]:
        """Call ``method(*args_per_instance[i])`` on instance i (e.g. one data shard each)."""
        self._require_started()
        self._node(node_name)
        n = len(self.pool.routable[node_name])
        if len(args_per_instance) != n:
            raise DataflowError(f"call_each('{node_name}', '{method}'): {len(args_per_instance)} argument tuples "
                                f"for {n} instances; give one per instance")
        return self.router.call(node_name, method, [tuple(a) for a in args_per_instance], {})

    def instances(self, node_name: str) -> list[str]:
        self._node(node_name)
        return [i.iid for i in sorted(self.pool.routable[node_name], key=lambda i: i.index)]

    def _node(self, node_name: str) -> None:
        if node_name not in self.graph.nodes:
            raise DataflowError(f"graph '{self.graph.name}' has no node '{node_name}'"
                                f"{did_you_mean(node_name, self.graph.nodes)}; nodes: {', '.join(self.graph.nodes)}")

    # ---- runtime control -----------------------------------------------------------
    def adjust_parallelism(self, node_name: str, target_parallelism: int, reason: str = "manual",
                           drain_timeout_s: float = 600.0) -> int:
        """Scale a node live to ``target_parallelism``; returns the parallelism reached.

        A routed node gains or drains replicas at once. A node of a worker group resizes
        the whole group at the next step boundary: a new process group, the hosted nodes'
        state carried over (their ``save_checkpoint``/``load_checkpoint``), control state
        re-delivered."""
        self._require_started()
        self._node(node_name)
        if not isinstance(target_parallelism, int) or isinstance(target_parallelism, bool) or target_parallelism < 1:
            raise DataflowError(f"adjust_parallelism('{node_name}'): target {target_parallelism!r} must be an int >= 1")
        node = self.graph.nodes[node_name]
        members = self.graph.group_nodes(node.group.name) if node.group is not None else [node_name]
        for m in members:
            mn = self.graph.nodes[m]
            if target_parallelism < mn.min_parallelism or (mn.max_parallelism is not None
                                                           and target_parallelism > mn.max_parallelism):
                top = mn.max_parallelism if mn.max_parallelism is not None else "unbounded"
                raise DataflowError(f"adjust_parallelism('{node_name}', {target_parallelism}): outside "
                                    f"{m}'s min/max parallelism {mn.min_parallelism}..{top}; refused")
        with self._scale_lock:
            if node.group is not None:
                return self._resize_group(node.group.name, target_parallelism, reason)
            return self._scale_routed(node_name, target_parallelism, reason, drain_timeout_s)

    def _scale_routed(self, node_name: str, target: int, reason: str, drain_timeout_s: float) -> int:
        before = len(self.pool.routable[node_name])
        if target > before:
            added: list[Instance] = []
            for _ in range(target - before):
                free, _ = self._clusters()
                inst = self.pool.add_route_instance(node_name, free)
                if inst is None:
                    self._decide(f"Scheduling decision: cannot raise {node_name} beyond "
                                 f"{before + len(added)}: no free resources for another instance ({reason})")
                    break
                self.board.deliver_latest(node_name, [inst.proc])
                if self._ulysses.get(node_name) is False and self.graph.nodes[node_name].ulysses:
                    self._set_ulysses([inst], False)
                with self.lock:
                    self.pool.routable[node_name] = self.pool.routable[node_name] + [inst]
                added.append(inst)
            after = len(self.pool.routable[node_name])
            if added:
                where = ", ".join(f"{i.iid} on node {i.plan.ray_node_name}" for i in added)
                self._decide(f"Scheduling decision: raised {node_name} parallelism {before} -> {after} "
                             f"({reason}): {where}")
            return after
        if target < before:
            with self.lock:
                victims = sorted(self.pool.routable[node_name], key=lambda i: i.index)[target:]
                for v in victims:
                    v.draining = True
                self.pool.routable[node_name] = [i for i in self.pool.routable[node_name] if not i.draining]
            self._decide(f"Scheduling decision: lowered {node_name} parallelism {before} -> "
                         f"{target} ({reason}): draining {', '.join(v.iid for v in victims)}")
            self.pool.drain(victims, drain_timeout_s)
        return len(self.pool.routable[node_name])

    def _has(self, node: str, method: str) -> bool:
        import ray
        return bool(ray.get(self.pool.routable[node][0].handle.has_method.remote(node, method)))

    def _resize_group(self, group: str, target: int, reason: str) -> int:
        before = self.pool.world[group]
        if target == before:
            return before
        hosted = self.graph.group_nodes(group)
        with self.router.step_lock:  # the next step boundary: no item of this graph in flight
            if self.router.live:
                raise DataflowError(f"adjust_parallelism: worker group {group} cannot be resized while "
                                    f"{len(self.router.live)} item(s) are in flight; call it between steps")
            for n in hosted:
                if self._has(n, "check_world_size"):
                    problem = self.router.call(n, "check_world_size", [(target,)], {})[0]
                    if problem:
                        raise DataflowError(f"adjust_parallelism: cannot resize worker group {group} "
                                            f"{before} -> {target}: {problem}")
            carry = [n for n in hosted if self._has(n, "save_checkpoint")]
            # the routed nodes living in rank 0's process (Node(host=...)) go down with it: small state
            # travels through here
            kept = {n: self.router.call(n, "state_dict", [()], {})[0]
                    for n in self.graph.hosted_nodes(group) if self._has(n, "state_dict")}
            free = self._free_with_group(group)
            plan = place_group(self.graph, group, target, free, self.pool.bundle_prefix(group))
            scratch = tempfile.mkdtemp(prefix=f"hpcv-resize-{group}-", dir=self.scratch_dir)
            for n in carry:
                self.router.call(n, "save_checkpoint", [(f"{scratch}/{n}",)], {})
            try:
                self._restart_group(group, plan, carry, scratch, kept)
            except Exception as exc:  # noqa: BLE001 - back to the old size from the same state
                self._decide(f"Scheduling decision: resizing worker group {group} to {target} failed "
                             f"({type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); "
                             f"restarting it at {before} from the saved state")
                try:
                    old_plan = place_group(self.graph, group, before, self._free_with_group(group),
                                           self.pool.bundle_prefix(group))
                    self._restart_group(group, old_plan, carry, scratch, kept)
                except Exception:  # noqa: BLE001
                    raise DataflowError(f"adjust_parallelism: resizing worker group {group} {before} -> {target} "
                                        f"failed and so did restarting it; its state is kept in {scratch}") from None
                shutil.rmtree(scratch, ignore_errors=True)
                raise DataflowError(f"adjust_parallelism: worker group {group} could not be resized to {target} "
                                    f"({exc}); it runs at {before} again, state carried over") from None
            shutil.rmtree(scratch, ignore_errors=True)
        for line in plan.decisions:
            self._decide(line)
        kept = f"; state of {', '.join(carry)} carried over" if carry else ""
        self._decide(f"Scheduling decision: resized worker group {group} ({', '.join(hosted)}) {before} -> "
                     f"{target} ({reason}): new process group{kept}")
        return target

    def _restart_group(self, group: str, plan: PlacementPlan, carry: list[str], scratch: str,
                       kept: dict[str, Any]) -> None:
        """The group's processes replaced by ``plan``'s; saved state loaded, control state re-delivered,
        Ulysses switched off again where it was."""
        procs = self.pool.replace_group(group, plan)
        for n in carry:
            self.router.call(n, "load_checkpoint", [(f"{scratch}/{n}",)], {})
        for n, state in kept.items():
            self.router.call(n, "load_state_dict", [(state,)], {})
        for n in self.graph.group_nodes(group) + self.graph.hosted_nodes(group):
            self.board.deliver_latest(n, procs)
            if self._ulysses.get(n) is False and self.graph.nodes[n].ulysses:
                self._set_ulysses(self.pool.routable[n], False)

    def _free_with_group(self, group: str) -> list[ClusterNode]:
        """Free resources as if the group's own bundles were already given back."""
        free, _ = self._clusters()
        back: dict[str, dict[str, float]] = {}
        for bundle in self.pool.releasable(group):
            res = back.setdefault(bundle.ray_node_id, {})
            for k, v in bundle.resources.items():
                res[k] = res.get(k, 0.0) + v
        out = []
        for cn in free:
            res = dict(cn.resources)
            for k, v in back.get(cn.node_id, {}).items():
                res[k] = res.get(k, 0.0) + v
            out.append(ClusterNode(cn.node_id, cn.name, res))
        return out

    def disable_ulysses(self, node_name: str) -> bool:
        """Switch off a node's sequence-parallel mode; a warned no-op if it has none."""
        self._node(node_name)
        if not self.graph.nodes[node_name].ulysses:
            msg = f"disable_ulysses('{node_name}'): node has no sequence-parallel (Ulysses) mode; nothing to do"
            warnings.warn(msg, stacklevel=2)
            self._decide(f"Scheduling decision: {msg}")
            return False
        if self._started:
            with self.router.step_lock:   # between steps, and in the same order on every rank
                if self.router.live:
                    raise DataflowError(f"disable_ulysses('{node_name}'): {len(self.router.live)} item(s) in "
                                        f"flight; call it between steps")
                if self._has(node_name, "check_ulysses_off"):
                    problem = self.router.call(node_name, "check_ulysses_off", [()], {})[0]
                    if problem:
                        raise DataflowError(f"disable_ulysses('{node_name}'): refused: {problem}")
                self._set_ulysses(self.pool.routable[node_name], False)
        self._ulysses[node_name] = False
        self._decide(f"Scheduling decision: disabled Ulysses sequence parallelism for {node_name}")
        return True

    def _set_ulysses(self, insts: list[Instance], enabled: bool) -> None:
        import ray

        if not insts:
            return
        node = insts[0].node
        if ray.get(insts[0].handle.has_method.remote(node, "set_ulysses")):
            ray.get([i.handle.call.remote(node, "set_ulysses", (enabled,), {}) for i in insts])

    # ---- status --------------------------------------------------------------------
    def get_status(self) -> dict[str, Any]:
        """Per node workers (rank, node, devices, items and rows)/world size/queue/throughput,
        per edge latency/queue/versions, GPUs, decisions. JSON-ready."""
        if self._started:
            self.monitor.measure_queues()
            self.monitor.poll_stats()
        return self.monitor.snapshot()

    # ---- teardown ------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the monitor; kill exactly this graph's actors, placement groups and status actor."""
        import ray

        self.monitor.join()
        if not ray.is_initialized():
            return
        if self._started:  # the status file keeps the final state (what every instance did)
            try:
                self.monitor.poll_stats()
                self.monitor.publish()
            except Exception:  # noqa: BLE001 - a dead instance must not stop the teardown
                pass
        self.pool.shutdown()
        if self._hub is not None:
            try:
                ray.kill(self._hub)
            except Exception:  # noqa: BLE001
                pass
        self._hub = None
        self._started = False
        self._spawned = None

    def __enter__(self) -> "HybridScheduler":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
