"""The scheduler's eyes: queue measurement, worker stats, throughput, the
adaptive backpressure controller and the status snapshot (``get_status``) that
the monitor thread publishes for the dashboard.

It only reads the pool's, router's and board's tables (under their lock, all handed to it
as ``Tables``) and asks the scheduler to act through the few members of ``SchedulerView``
(``adjust_parallelism`` when a queue stays long); it never imports the scheduler.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger("hpc_verl.dataflow")


@dataclass(frozen=True)
class Tables:
    """What the monitor reads: the graph and the scheduler's parts, shared under ``lock``."""

    graph: Any
    pool: Any
    router: Any
    board: Any
    lock: Any
    edge_stats: dict[str, dict[str, Any]]


class SchedulerView(Protocol):
    """What the monitor asks of its scheduler (HybridScheduler provides it)."""

    decisions: list[str]

    @property
    def started(self) -> bool: ...

    @property
    def cluster_total(self) -> list[Any]: ...

    @property
    def hub(self) -> Any: ...

    def decide(self, line: str) -> None: ...

    def adjust_parallelism(self, node_name: str, target_parallelism: int, reason: str = ...) -> int: ...

    def ulysses_on(self, node_name: str) -> bool | None: ...


class Monitor:
    def __init__(self, sched: SchedulerView, tables: Tables, backpressure: bool, backpressure_window_s: float,
                 monitor_interval_s: float, stats_interval_s: float, status_file: str | None) -> None:
        self.sched = sched
        self.graph = tables.graph
        self.pool = tables.pool
        self.router = tables.router
        self.board = tables.board
        self.lock = tables.lock
        self.edge_stats = tables.edge_stats
        self.backpressure = backpressure
        self.backpressure_window_s = backpressure_window_s
        self.monitor_interval_s = monitor_interval_s
        self.stats_interval_s = stats_interval_s
        self.status_file = status_file
        self.node_rate: dict[str, dict[str, float]] = {n: {"t": 0.0, "done": 0, "rate": 0.0}
                                                       for n in self.graph.nodes}
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self._last_stats = 0.0

    # ---- the thread ----------------------------------------------------------------
    def start(self) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self._loop, name=f"dataflow-{self.graph.name}", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.stop.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)

    def _loop(self) -> None:
        warned = False
        while not self.stop.wait(self.monitor_interval_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - monitoring must never kill the run
                if not warned and not self.stop.is_set():
                    log.warning("dataflow monitor: %s", exc)
                    warned = True

    def tick(self) -> None:
        self.measure_queues()
        now = time.monotonic()
        if now - self._last_stats >= self.stats_interval_s:
            self._last_stats = now
            self.poll_stats()
            self.publish()
        if self.backpressure:
            self._backpressure(now)

    # ---- measuring -----------------------------------------------------------------
    def measure_queues(self) -> None:
        import ray

        with self.lock:
            tracks = list(self.router.live.values())
        refs = [r for t in tracks for rs in t.refs.values() for r in rs]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]) if refs else set()
        for e in self.graph.data_edges():
            per_inst: dict[str, list[int]] = {}
            for t in tracks:
                src_refs, dst_refs = t.refs.get(e.src_name), t.refs.get(e.dst_name)
                if not src_refs or not dst_refs:
                    continue
                if all(r in ready for r in src_refs) and not all(r in ready for r in dst_refs):
                    per_inst.setdefault(t.insts[e.dst_name][0].iid, []).append(t.size)
            # items delivered to an instance and not done, less the micro-batch it is working on
            q = sum(sum(sizes) - sizes[0] for sizes in per_inst.values())
            st = self.edge_stats[e.key]
            st["queue"] = q
            st["peak"] = max(st["peak"], q)

    def poll_stats(self) -> None:
        import ray

        procs = list(self.pool.procs.values())
        if not procs:
            return
        refs = [p.handle.stats.remote() for p in procs]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
        ready_set = set(ready)
        for proc, ref in zip(procs, refs):
            if ref not in ready_set:
                continue
            try:
                stats = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dying instance
                continue
            for inst in [i for n in proc.nodes for i in self.pool.instances[n] if i.proc is proc]:
                new_stats = dict(stats["nodes"].get(inst.node, {}))
                new_stats["gpu_memory"] = stats.get("gpu_memory", {})
                old = sum(inst.stats.get("stale_rejected", {}).values())
                new = sum(new_stats.get("stale_rejected", {}).values())
                for edge, version, held in new_stats.get("rejections", [])[-(new - old):] if new > old else ():
                    self.sched.decide(f"Consistency: {inst.iid} rejected stale control v{version} on {edge} "
                                       f"(holds v{held})")
                inst.stats = new_stats
        now = time.monotonic()
        for node in self.graph.nodes:
            done = self.pool.retired[node]["processed"] + sum(int(i.stats.get("processed", 0))
                                                              for i in self.pool.instances[node])
            r = self.node_rate[node]
            if r["t"]:
                dt = now - r["t"]
                if dt > 0:
                    r["rate"] = (done - r["done"]) / dt
            r["t"], r["done"] = now, done

    def _backpressure(self, now: float) -> None:
        """An edge whose queue, sampled over the last window, has a median at or over
        its threshold is a sustained bottleneck (a single sample is noise). Worker
        groups are never resized by it (a resize moves their state: ask for it)."""
        for e in self.graph.data_edges():
            st = self.edge_stats[e.key]
            samples = st.setdefault("samples", [])
            samples.append((now, st["queue"]))
            while samples and now - samples[0][0] > self.backpressure_window_s:
                samples.pop(0)
            if len(samples) < 3 or now - samples[0][0] < 0.8 * self.backpressure_window_s:
                continue
            median = sorted(q for _, q in samples)[len(samples) // 2]
            if median < e.threshold or now - st["last_action"] < self.backpressure_window_s:
                continue
            st["last_action"] = now
            samples.clear()
            dst, src = self.graph.nodes[e.dst_name], self.graph.nodes[e.src_name]
            reason = (f"backpressure: queue on {e.key} at median {median} >= threshold {e.threshold} "
                      f"over {self.backpressure_window_s:g}s")
            p_dst = len(self.pool.routable[dst.name])
            if dst.group is None and (dst.max_parallelism is None or p_dst < dst.max_parallelism):
                if self.sched.adjust_parallelism(dst.name, p_dst + 1, reason) > p_dst:
                    continue
            p_src = len(self.pool.routable[src.name])
            if src.group is None and p_src > src.min_parallelism:
                threading.Thread(target=self.sched.adjust_parallelism, args=(src.name, p_src - 1, reason),
                                 daemon=True).start()
            else:
                self.sched.decide(f"Scheduling decision: {reason}, but {dst.name} cannot grow and "
                                   f"{src.name} cannot shrink; the bounded channel holds the producer back")

    # ---- status --------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        nodes: dict[str, Any] = {}
        with self.lock:
            for name, node in self.graph.nodes.items():
                workers = []
                for inst in sorted(self.pool.instances[name], key=lambda i: i.index):
                    workers.append({"id": inst.iid, "rank": inst.index if node.group is not None else None,
                                    "process": inst.proc.key, "pid": inst.info.get("pid"),
                                    "ray_node_id": inst.ray_node_id, "ray_node": inst.plan.ray_node_name,
                                    "hostname": inst.info.get("hostname"),
                                    "gpu_ids": list(inst.info.get("gpu_ids", [])),
                                    "cuda_visible_devices": inst.info.get("cuda_visible_devices"),
                                    "planned_gpu_slots": list(inst.plan.gpu_slots),
                                    "stage": inst.plan.stage, "bundle": inst.plan.bundle,
                                    "draining": inst.draining, "outstanding": inst.outstanding,
                                    "processed": int(inst.stats.get("processed", 0)),
                                    "rows": int(inst.stats.get("rows", 0)),
                                    "versions": inst.stats.get("versions", {}),
                                    "timings": inst.stats.get("timings", {}),
                                    "fetched_rows": int(inst.stats.get("fetched_rows", 0))})
                group = node.group
                nodes[name] = {"parallelism": len(self.pool.routable[name]), "workers": workers,
                               "world_size": self.pool.world.get(group.name, group.world_size) if group else 1,
                               "group": group.name if group else None, "dispatch": node.dispatch,
                               "dist_backend": (self.pool.instances[name][0].info.get("dist_backend")
                                                if self.pool.instances[name] else None),
                               "resources": dict(node.resources),
                               "queue_length": sum(self.edge_stats[e.key]["queue"]
                                                   for e in self.graph.in_edges(name)),
                               "items_per_s": round(self.node_rate[name]["rate"], 3),
                               "processed": self.pool.retired[name]["processed"] + sum(w["processed"]
                                                                                       for w in workers),
                               "rows": self.pool.retired[name]["rows"] + sum(w["rows"] for w in workers),
                               "ulysses": self.sched.ulysses_on(name)}
            edges: dict[str, Any] = {}
            for e in self.graph.edges:
                st = self.edge_stats[e.key]
                lat = [(i.stats.get("latency", {}).get(e.key)) for i in self.pool.instances[e.dst_name]]
                lat = [x for x in lat if x]
                n = sum(x["n"] for x in lat)
                entry = {"src": e.src_name, "dst": e.dst_name, "data_type": e.data_type, "control": e.control,
                         "consistency": e.consistency, "co_located": e.colocated,
                         "queue_length": st["queue"], "peak_queue_length": st["peak"], "capacity": e.capacity,
                         "threshold": e.threshold, "items": st["items"], "cross_node_items": st["cross_node"],
                         "latency_ms_mean": round(sum(x["mean_ms"] * x["n"] for x in lat) / n, 3) if n else None,
                         "latency_ms_p95": round(max(x["p95_ms"] for x in lat), 3) if n else None}
                if e.control:
                    entry["version"] = self.board.version(e.key)
                    entry["stale_rejected"] = sum(int(i.stats.get("stale_rejected", {}).get(e.key, 0))
                                                  for i in self.pool.instances[e.dst_name])
                    if e.key in self.board.transfers:
                        entry["transfer"] = dict(self.board.transfers[e.key])
                edges[e.key] = entry
            decisions = list(self.sched.decisions)
            items_in, items_out = self.router.items_in, self.router.items_out
        return {"graph": self.graph.name, "time": time.time(), "started": self.sched.started, "nodes": nodes,
                "edges": edges, "gpus": self._gpu_table(nodes), "decisions": decisions,
                "items_in": items_in, "items_out": items_out, "window": self.router.window}

    def _gpu_table(self, nodes: dict[str, Any]) -> dict[str, Any]:
        table: dict[str, Any] = {}
        for cn in self.sched.cluster_total:
            for g in range(int(cn.gpus)):
                table[f"{cn.name}:{g}"] = {"ray_node_id": cn.node_id, "gpu": str(g), "memory": "n/a", "users": []}
        for name in nodes:
            for inst in self.pool.instances[name]:
                mem = inst.stats.get("gpu_memory") or {}
                for local, gid in enumerate(inst.info.get("gpu_ids", [])):
                    key = f"{inst.plan.ray_node_name}:{gid}"
                    row = table.setdefault(key, {"ray_node_id": inst.ray_node_id, "gpu": str(gid),
                                                 "memory": "n/a", "users": []})
                    row["users"].append(inst.iid)
                    if str(local) in mem:
                        row["memory"] = mem[str(local)]
        return table

    def publish(self) -> None:
        snap = self.snapshot()
        hub = self.sched.hub
        if hub is not None:
            hub.set.remote(snap)
        if self.status_file:
            from hpc_verl.util.fs import atomic_write_json

            atomic_write_json(self.status_file, snap)
