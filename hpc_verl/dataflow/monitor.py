"""The scheduler's eyes: queue measurement, worker stats, throughput, the
adaptive backpressure controller and the status snapshot (``get_status``) that
the monitor thread publishes for the dashboard.

A mixin of ``HybridScheduler``: it uses the scheduler's tables and locks.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("hpc_verl.dataflow")


class MonitorMixin:
    """Monitoring half of HybridScheduler (see scheduler.py for the state it reads)."""

    # ---- monitoring ----------------------------------------------------------------
    def _monitor_loop(self) -> None:
        warned = False
        while not self._stop.wait(self.monitor_interval_s):
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - monitoring must never kill the run
                if not warned and not self._stop.is_set():
                    log.warning("dataflow monitor: %s", exc)
                    warned = True

    def _measure_queues(self) -> None:
        import ray

        with self._lock:
            tracks = list(self._live.values())
        refs = [r for t in tracks for r in t.refs.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]) if refs else set()
        for e in self.graph.data_edges():
            per_inst: dict[str, list[int]] = {}
            for t in tracks:
                src_ref, dst_ref = t.refs.get(e.src_name), t.refs.get(e.dst_name)
                if src_ref in ready and dst_ref not in ready:
                    per_inst.setdefault(t.insts[e.dst_name].iid, []).append(t.size)
            # items delivered to an instance and not done, less the micro-batch it is working on
            q = sum(sum(sizes) - sizes[0] for sizes in per_inst.values())
            st = self._edge[e.key]
            st["queue"] = q
            st["peak"] = max(st["peak"], q)

    def _poll_stats(self) -> None:
        import ray

        insts = [i for insts in self._instances.values() for i in insts]
        if not insts:
            return
        refs = [i.handle.stats.remote() for i in insts]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
        ready_set = set(ready)
        for inst, ref in zip(insts, refs):
            if ref in ready_set:
                try:
                    stats = ray.get(ref)
                except Exception:  # noqa: BLE001 - a dying instance
                    continue
                old = sum(inst.stats.get("stale_rejected", {}).values())
                new = sum(stats.get("stale_rejected", {}).values())
                for edge, version, held in stats.get("rejections", [])[-(new - old):] if new > old else ():
                    self._decide(f"Consistency: {inst.iid} rejected stale control v{version} on {edge} "
                                 f"(holds v{held})")
                inst.stats = stats
        now = time.monotonic()
        for node in self.graph.nodes:
            done = self._retired[node] + sum(int(i.stats.get("processed", 0)) for i in self._instances[node])
            r = self._node_rate[node]
            if r["t"]:
                dt = now - r["t"]
                if dt > 0:
                    r["rate"] = (done - r["done"]) / dt
            r["t"], r["done"] = now, done

    def _tick(self) -> None:
        self._measure_queues()
        now = time.monotonic()
        if now - self._last_stats >= self.stats_interval_s:
            self._last_stats = now
            self._poll_stats()
            self._publish_status()
        if self.backpressure:
            self._backpressure(now)

    def _backpressure(self, now: float) -> None:
        """An edge whose queue, sampled over the last window, has a median at or over
        its threshold is a sustained bottleneck (a single sample is noise)."""
        for e in self.graph.data_edges():
            st = self._edge[e.key]
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
            p_dst = len(self._routable[dst.name])
            if dst.max_parallelism is None or p_dst < dst.max_parallelism:
                if self.adjust_parallelism(dst.name, p_dst + 1, reason) > p_dst:
                    continue
            p_src = len(self._routable[src.name])
            if p_src > src.min_parallelism:
                threading.Thread(target=self.adjust_parallelism, args=(src.name, p_src - 1, reason),
                                 daemon=True).start()
            else:
                self._decide(f"Scheduling decision: {reason}, but {dst.name} is at its maximum and "
                             f"{src.name} at its minimum; the bounded channel holds the producer back")

    # ---- status --------------------------------------------------------------------
    def get_status(self) -> dict[str, Any]:
        """Per node workers/GPUs/queue/throughput, per edge latency/queue, GPUs, decisions. JSON-ready."""
        if self._started:
            self._measure_queues()
            self._poll_stats()
        return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        nodes: dict[str, Any] = {}
        with self._lock:
            for name, node in self.graph.nodes.items():
                workers = []
                for inst in sorted(self._instances[name], key=lambda i: i.index):
                    workers.append({"id": inst.iid, "ray_node_id": inst.ray_node_id,
                                    "ray_node": inst.plan.ray_node_name,
                                    "gpu_ids": list(inst.info.get("gpu_ids", [])),
                                    "cuda_visible_devices": inst.info.get("cuda_visible_devices"),
                                    "planned_gpu_slots": list(inst.plan.gpu_slots),
                                    "stage": inst.plan.stage, "bundle": inst.plan.bundle,
                                    "draining": inst.draining, "outstanding": inst.outstanding,
                                    "processed": int(inst.stats.get("processed", 0)),
                                    "versions": inst.stats.get("versions", {})})
                nodes[name] = {"parallelism": len(self._routable[name]), "workers": workers,
                               "resources": dict(node.resources),
                               "queue_length": sum(self._edge[e.key]["queue"] for e in self._in_data[name]),
                               "items_per_s": round(self._node_rate[name]["rate"], 3),
                               "processed": self._retired[name] + sum(w["processed"] for w in workers),
                               "ulysses": self._ulysses[name] if node.ulysses is not None else None}
            edges: dict[str, Any] = {}
            for e in self.graph.edges:
                st = self._edge[e.key]
                lat = [(i.stats.get("latency", {}).get(e.key)) for i in self._instances[e.dst_name]]
                lat = [x for x in lat if x]
                n = sum(x["n"] for x in lat)
                entry = {"src": e.src_name, "dst": e.dst_name, "data_type": e.data_type, "control": e.control,
                         "consistency": e.consistency, "co_located": e.colocated,
                         "queue_length": st["queue"], "peak_queue_length": st["peak"], "capacity": e.capacity,
                         "threshold": e.threshold, "items": st["items"], "cross_node_items": st["cross_node"],
                         "latency_ms_mean": round(sum(x["mean_ms"] * x["n"] for x in lat) / n, 3) if n else None,
                         "latency_ms_p95": round(max(x["p95_ms"] for x in lat), 3) if n else None}
                if e.control:
                    board = self._board.get(e.key)
                    entry["version"] = board[1] if board else None
                    entry["stale_rejected"] = sum(int(i.stats.get("stale_rejected", {}).get(e.key, 0))
                                                  for i in self._instances[e.dst_name])
                edges[e.key] = entry
            decisions = list(self.decisions)
            items_in, items_out = self._items_in, self._items_out
        return {"graph": self.graph.name, "time": time.time(), "started": self._started, "nodes": nodes,
                "edges": edges, "gpus": self._gpu_table(nodes), "decisions": decisions,
                "items_in": items_in, "items_out": items_out, "window": self.window}

    def _gpu_table(self, nodes: dict[str, Any]) -> dict[str, Any]:
        table: dict[str, Any] = {}
        for cn in self._total:
            for g in range(int(cn.gpus)):
                table[f"{cn.name}:{g}"] = {"ray_node_id": cn.node_id, "gpu": str(g), "memory": "n/a", "users": []}
        for name in nodes:
            for inst in self._instances[name]:
                mem = inst.stats.get("gpu_memory") or {}
                for local, gid in enumerate(inst.info.get("gpu_ids", [])):
                    key = f"{inst.plan.ray_node_name}:{gid}"
                    row = table.setdefault(key, {"ray_node_id": inst.ray_node_id, "gpu": str(gid),
                                                 "memory": "n/a", "users": []})
                    row["users"].append(inst.iid)
                    if str(local) in mem:
                        row["memory"] = mem[str(local)]
        return table

    def _publish_status(self) -> None:
        snap = self._snapshot()
        if self._hub is not None:
            self._hub.set.remote(snap)
        if self.status_file:
            from hpc_verl.util.fs import atomic_write_json

            atomic_write_json(self.status_file, snap)
