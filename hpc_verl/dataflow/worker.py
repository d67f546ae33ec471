"""The Ray actor (one process) that hosts instances of dataflow nodes.

A routed node's instance has a process of its own; a worker group's rank ``r``
is one process hosting instance ``r`` of every node of the group (verl's hybrid
engine: actor, rollout and reference share a process per GPU). With a dist
group the process joins the group's torch.distributed process group in
``setup`` before it builds the node objects, so they can shard themselves.

Threads: handlers (``run``/``call`` and the tensor transports) run in the
default group, one at a time; object control messages arrive in the
``control`` group and are applied under the same lock, so never in the middle
of an item; ``stats``/``info`` run in the ``monitor`` group so the dashboard
sees a busy worker without waiting for it.

Items travel as envelopes ``[t_done, values, emitted]``: ``t_done`` gives the
consumer the edge latency, ``emitted`` the control messages the handler emitted
(payloads already in the object store, or the TENSORS marker). An envelope is a
list, not a tuple: Ray packs lists, floats and None with msgpack, but a tuple
falls back to cloudpickle, which cost ~40 us per call, on every hop.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections import deque
from typing import Any

import ray

from hpc_verl.dataflow import context as _context
from hpc_verl.dataflow import pieces, spmd
from hpc_verl.dataflow.context import SNAPSHOT, TENSORS, ControlMessage, WorkerContext
from hpc_verl.dataflow.graph import DataflowRunError
from hpc_verl.errors import DataflowError

LATENCY_WINDOW = 1024


def _gpu_memory() -> dict[str, Any]:
    """Per visible GPU memory in MB, or {} (no GPU, or torch not loaded by the node)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    try:
        if not torch.cuda.is_available():
            return {}
        out = {}
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out[str(i)] = {"used_mb": round((total - free) / 2**20, 1), "total_mb": round(total / 2**20, 1)}
        return out
    except Exception:  # a broken driver must not break monitoring
        return {}


def _last_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[-1] if text else ""


class _Hosted:
    """One node's instance inside this process: its object, context and counters."""

    def __init__(self, spec: dict[str, Any], ctx: WorkerContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.dispatch = spec["dispatch"]
        self.split_key = spec.get("split_key")
        self.inputs = list(spec.get("inputs", ()))
        self.row_plans = dict(spec.get("row_plans") or {})   # consumer -> its take_rows (pieces.cut)
        self.edge_of = dict(spec.get("edge_of", {}))  # control edge key -> data_type
        self.obj: Any = None
        self.handler: Any = None
        self.on_control: Any = None
        self.processed = 0
        self.rows = 0
        self.fetched_rows = 0   # rows handed to it through take_rows (its own rows of split items)
        self.busy_s = 0.0
        self.stale_rejected: dict[str, int] = {}
        self.rejections: list[tuple[str, int, int]] = []  # (edge, stale version, version held)
        self.latency: dict[str, deque] = {}
        self.errors = 0

    def build(self) -> None:
        spec = self.spec
        target = spec["target"]
        if spec["is_class"]:
            self.obj = target(*spec.get("init_args", ()), **spec.get("init_kwargs", {}))
            self.handler = getattr(self.obj, spec["method"])
            self.on_control = getattr(self.obj, spec["control_method"], None)
        else:
            self.handler = target

    def stats(self) -> dict[str, Any]:
        lat = {}
        for key, buf in list(self.latency.items()):
            vals = sorted(buf)
            if vals:
                lat[key] = {"n": len(vals), "mean_ms": 1000 * sum(vals) / len(vals),
                            "p95_ms": 1000 * vals[min(len(vals) - 1, int(0.95 * len(vals)))]}
        return {"processed": self.processed, "rows": self.rows, "busy_s": self.busy_s, "latency": lat,
                "versions": dict(self.ctx.versions), "stale_rejected": dict(self.stale_rejected),
                "rejections": list(self.rejections[-64:]), "errors": self.errors, "timings": self.timings(),
                "fetched_rows": self.fetched_rows}

    def timings(self) -> dict[str, float]:
        """The node's own seconds per phase of its last item (``obj.timings()``, optional): what the
        dashboard shows per rank. A node that has none, or fails to say, shows none."""
        fn = getattr(self.obj, "timings", None)
        if fn is None:
            return {}
        try:
            return {str(k): float(v) for k, v in dict(fn()).items()}
        except Exception:  # noqa: BLE001 - a status poll must never break a worker
            return {}


@ray.remote(concurrency_groups={"control": 2, "monitor": 1}, max_concurrency=1)
class DataflowWorker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.lock = threading.Lock()
        rt = ray.get_runtime_context()
        self.ray_node_id = rt.get_node_id()
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.rank = int(spec.get("rank", 0))
        self.world_size = int(spec.get("world_size", 1))
        self.host = ray.util.get_node_ip_address()
        self.store: Any = None          # this group's rendezvous store (rank 0: the master)
        self.process_group: Any = None
        self.sync: dict[str, dict[str, Any]] = {}   # sync-group key -> {"pg", "rank", "store"}
        self.hosted: dict[str, _Hosted] = {}
        for node, nspec in spec["nodes"].items():
            ctx = WorkerContext(node_name=node, instance_id=nspec["instance_id"], index=nspec["index"],
                                ray_node_id=self.ray_node_id, gpu_ids=list(self.gpu_ids),
                                out_control=list(nspec.get("out_control", [])), rank=self.rank,
                                world_size=self.world_size, group=spec.get("group"))
            for key in nspec.get("in_control", []):
                ctx.versions[key] = -1
            self.hosted[node] = _Hosted(nspec, ctx)
            preload = getattr(nspec["target"], "preload", None) if nspec["is_class"] else None
            if callable(preload):   # a class's slow imports, now: nobody waits for __init__ yet
                preload()

    # ---- start-up -----------------------------------------------------------------
    def open_rendezvous(self) -> tuple[str, int]:
        """Rank 0: start the group's store; returns (address, port) for the other ranks."""
        from hpc_verl.dataflow import distgroup

        self.store, port = distgroup.open_store(self.host, self.world_size, self.spec["dist"]["timeout_s"])
        return self.host, port

    def setup(self, rendezvous: tuple[str, int] | None,
              inits: dict[str, tuple[tuple, dict]] | None = None) -> dict[str, Any]:
        """Join the group's process group (dist groups), then build the hosted node objects
        (``inits``: each node's init arguments)."""
        for node, (args, kwargs) in (inits or {}).items():
            self.hosted[node].spec.update(init_args=args, init_kwargs=kwargs)
        dist_spec = self.spec.get("dist")
        if dist_spec is not None:
            from hpc_verl.dataflow import distgroup

            timeout = dist_spec["timeout_s"]
            if self.store is None:
                assert rendezvous is not None
                self.store = distgroup.connect_store(rendezvous[0], rendezvous[1], self.world_size, timeout)
            distgroup.init_default_group(self.store, self.rank, self.world_size, dist_spec["backend"], timeout)
            import torch.distributed as dist
            self.process_group = dist.group.WORLD
            for h in self.hosted.values():
                h.ctx.process_group = self.process_group
        for h in self.hosted.values():
            _context._CONTEXT = h.ctx
            h.build()
        return self.info()

    # ---- monitor group ------------------------------------------------------------
    @ray.method(concurrency_group="monitor")
    def info(self) -> dict[str, Any]:
        return {"ray_node_id": self.ray_node_id, "gpu_ids": list(self.gpu_ids),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(),
                "hostname": socket.gethostname(), "address": self.host, "rank": self.rank,
                "world_size": self.world_size, "group": self.spec.get("group"),
                "dist_backend": self._backend()}

    def _backend(self) -> str | None:
        if self.process_group is None:
            return None
        import torch.distributed as dist
        return str(dist.get_backend(self.process_group))

    @ray.method(concurrency_group="monitor")
    def stats(self) -> dict[str, Any]:
        return {"nodes": {n: h.stats() for n, h in self.hosted.items()}, "gpu_memory": _gpu_memory()}

    # ---- control messages (object payloads) ---------------------------------------
    @ray.method(concurrency_group="control")
    def apply_control(self, node: str, edge: str, src: str, version: int, refs: list, delay_s: float = 0.0) -> bool:
        """Apply a broadcast control message unless it is stale. ``delay_s`` injects a
        delivery delay (tests of stale-version rejection)."""
        if delay_s:
            time.sleep(delay_s)
        with self.lock:
            return self._apply(self.hosted[node], edge, src, version, refs)

    def _stale(self, h: _Hosted, edge: str, version: int) -> bool:
        current = h.ctx.versions.get(edge, -1)
        if version <= current:
            if version < current:
                h.stale_rejected[edge] = h.stale_rejected.get(edge, 0) + 1
                h.rejections.append((edge, version, current))
            return True
        return False

    def _set_version(self, h: _Hosted, edge: str, version: int) -> None:
        data_type = h.edge_of.get(edge, edge)
        h.ctx.versions[edge] = version
        if data_type != edge:
            h.ctx.versions[data_type] = version

    def _apply(self, h: _Hosted, edge: str, src: str, version: int, refs: list) -> bool:
        if self._stale(h, edge, version):
            return False
        payload = ray.get(refs[0])
        data_type = h.edge_of.get(edge, edge)
        _context._CONTEXT = h.ctx
        if h.on_control is not None:
            h.on_control(ControlMessage(edge=edge, data_type=data_type, version=version, payload=payload, src=src))
        h.ctx.control[data_type] = payload
        self._set_version(h, edge, version)
        return True

    def _catch_up(self, h: _Hosted, required: dict | None) -> None:
        """Strong edges: hold at least the required version before handling anything."""
        for edge, (src, version, refs) in (required or {}).items():
            if h.ctx.versions.get(edge, -1) >= version:
                continue
            if refs is TENSORS:  # tensor transports deliver before publish returns; missing means broken
                raise DataflowError(f"{h.ctx.instance_id} holds {edge} v{h.ctx.versions.get(edge, -1)} but "
                                    f"v{version} is required; the tensor sync did not arrive (stale replica)")
            self._apply(h, edge, src, version, refs)

    # ---- tensor transports ----------------------------------------------------------
    def apply_local(self, node: str, edge: str, src_node: str, version: int) -> dict[str, Any]:
        """Both ends hosted here: the source's tensors go straight into the destination."""
        with self.lock:
            h, src = self.hosted[node], self.hosted[src_node]
            data_type = h.edge_of.get(edge, edge)
            t0 = time.perf_counter()
            _context._CONTEXT = h.ctx
            # the source's gathers are collective: a stale destination still takes part
            return self._install(h, edge, src.obj.export_tensors(data_type), version, t0)

    def sync_open(self, key: str, size: int, timeout_s: float) -> tuple[str, int]:
        """Sync rank 0 (a source rank 0): the store for a new sync group."""
        from hpc_verl.dataflow import distgroup

        store, port = distgroup.open_store(self.host, size, timeout_s)
        self.sync[key] = {"store": store}
        return self.host, port

    def sync_join(self, key: str, rank: int, size: int, address: tuple[str, int], backend: str,
                  timeout_s: float) -> bool:
        from hpc_verl.dataflow import distgroup

        for old in [k for k in self.sync if k.split("#")[0] == key.split("#")[0] and k != key]:
            self.sync.pop(old, None)  # an older membership of the same edge
        entry = self.sync.setdefault(key, {})
        if "store" not in entry:
            entry["store"] = distgroup.connect_store(address[0], address[1], size, timeout_s)
        entry["pg"] = distgroup.new_sync_group(entry["store"], key, rank, size, backend, timeout_s)
        entry["rank"] = rank
        entry["device"] = distgroup.device_for(distgroup.resolve_backend(backend))
        return True

    def sync_send(self, key: str | None, src_node: str, data_type: str, dtype: str | None,
                  bucket_bytes: int) -> dict[str, Any]:
        """Every source rank iterates its tensors (FSDP gathers are collective); sync rank 0 broadcasts."""
        from hpc_verl.dataflow import distgroup

        with self.lock:
            src = self.hosted[src_node]
            t0 = time.perf_counter()
            _context._CONTEXT = src.ctx
            named = src.obj.export_tensors(data_type)
            entry = self.sync.get(key) if key else None
            if entry is not None and entry.get("rank") == 0:
                import torch
                sent = distgroup.send_buckets(entry["pg"], named, entry["device"],
                                              getattr(torch, dtype) if dtype else None, bucket_bytes)
            else:
                sent = 0
                for _ in named:
                    pass
            return {"bytes": sent, "seconds": time.perf_counter() - t0}

    @ray.method(concurrency_group="control")
    def sync_send_snapshot(self, key: str, src_node: str, data_type: str, version: int, dtype: str | None,
                           bucket_bytes: int) -> dict[str, Any]:
        """Broadcast the source's frozen copy of ``version`` (SNAPSHOT), beside whatever item the
        default thread runs: the snapshot is not the live model, so no lock is needed."""
        import torch

        from hpc_verl.dataflow import distgroup

        src = self.hosted[src_node]
        entry = self.sync[key]
        t0 = time.perf_counter()
        sent = distgroup.send_buckets(entry["pg"], src.obj.export_snapshot(data_type, version), entry["device"],
                                      getattr(torch, dtype) if dtype else None, bucket_bytes)
        return {"bytes": sent, "seconds": time.perf_counter() - t0}

    def sync_recv(self, key: str, node: str, edge: str, version: int) -> dict[str, Any]:
        from hpc_verl.dataflow import distgroup

        with self.lock:
            h = self.hosted[node]
            entry = self.sync[key]
            t0 = time.perf_counter()
            _context._CONTEXT = h.ctx
            # a stale destination still takes part in the broadcast, and keeps nothing
            return self._install(h, edge, distgroup.recv_buckets(entry["pg"], entry["device"]), version, t0)

    def _install(self, h: _Hosted, edge: str, named: Any, version: int, t0: float) -> dict[str, Any]:
        """Stream ``named`` into the destination, or drain it (stale): collectives must complete."""
        if self._stale(h, edge, version):
            for _ in named:
                pass
            return {"applied": False}
        h.obj.load_tensors(h.edge_of.get(edge, edge), named, version)
        self._set_version(h, edge, version)
        return {"applied": True, "seconds": time.perf_counter() - t0}

    # ---- default group: items and calls -------------------------------------------
    def run_sole(self, *inputs: Any) -> list:
        """``run`` of the one node this process hosts, with no control version to wait for: the
        router's call for a routed instance, two arguments fewer to serialise per micro-batch."""
        return self.run(next(iter(self.hosted)), None, *inputs)

    def run(self, node: str, required: dict | None, *inputs: Any, plans: dict[str, int] | None = None) -> list:
        """Process one micro-batch of ``node``. Inputs: per incoming data edge an envelope,
        or the list of shard envelope refs of a split producer; at a source the items.
        ``plans``: the current world size of each take_rows consumer (pieces.cut)."""
        h = self.hosted[node]
        t0 = time.time()
        held: list[list[int]] | None = None   # take_rows: each item's rows this rank fetched
        if h.inputs:
            per_edge = []
            for desc, arg in zip(h.inputs, inputs):
                t_in = t0
                if desc["src_dispatch"] == "split":   # shard refs: this handler waits for the producer here
                    envs = ray.get(list(arg))
                    t_done = max(e[0] for e in envs)
                    got = (pieces.fetch(envs, node, self.rank, self.world_size, desc["src_collect"])
                           if desc.get("planned") else None)
                    if got is not None:
                        values, held = got
                        h.fetched_rows += sum(len(r) for r in held)
                    else:
                        values = spmd.gather_items([pieces.outputs(e) for e in envs], desc["src_collect"])
                    t_in = time.time()
                else:
                    t_done, values = arg[0], arg[1]
                buf = h.latency.get(desc["key"])
                if buf is None:
                    buf = h.latency[desc["key"]] = deque(maxlen=LATENCY_WINDOW)
                buf.append(t_in - t_done)
                per_edge.append(values)
                t0 = t_in   # busy from when the inputs are here
            if len(per_edge) > 1:
                srcs = [d["src"] for d in h.inputs]
                batch = [dict(zip(srcs, vals)) for vals in zip(*per_edge)]
            else:
                batch = per_edge[0]
        else:
            batch = inputs[0]
        with self.lock:
            self._catch_up(h, required)
            _context._CONTEXT = h.ctx
            emitted = h.ctx._emitted = []
            rows = 0
            spans: list[tuple[int, int, int]] = []
            try:
                outs = []
                for j, item in enumerate(batch):
                    if h.dispatch == "split":
                        bounds = spmd.split_bounds(item, self.world_size, h.split_key)
                        start, stop = bounds[self.rank]
                        h.ctx.shard_rows = (start, stop)
                        n = spmd.num_rows(item)
                        spans.append((start, stop, n))
                        item = spmd.take_rows(item, start, stop, n)
                        rows += stop - start
                    elif h.dispatch == "spmd":
                        rows += _rows_of(item) // self.world_size   # this rank's share of the work
                    else:
                        rows += _rows_of(item)
                    h.ctx.row_ids = held[j] if held is not None else None
                    outs.append(h.handler(item))
            except Exception as exc:
                h.errors += 1
                raise DataflowRunError(f"a node failed in {h.ctx.instance_id}: {type(exc).__name__}: "
                                       f"{_last_line(exc)}") from None
            finally:
                h.ctx._emitted = []
                h.ctx.shard_rows = None
                h.ctx.row_ids = None
        t1 = time.time()
        h.processed += len(batch)
        h.rows += rows
        h.busy_s += t1 - t0
        if h.dispatch == "spmd" and self.rank:
            return [t1, [None] * len(outs), None]   # rank 0's result is the node's; nothing to ship
        planned = (pieces.cut(outs, spans, {d: h.row_plans[d] for d in plans if d in h.row_plans}, plans)
                   if plans and h.row_plans and spans else None)
        if planned is not None:   # each consumer rank fetches its own rows (pieces)
            return [t1, None, self._ship(emitted), planned]
        return [t1, outs, self._ship(emitted)]     # (a list: see the module docstring)

    def _ship(self, emitted: list) -> list | None:
        """Emitted payloads go to the object store from here, never through the driver."""
        if not emitted:
            return None
        if self.spec.get("group") and self.rank:
            return None  # every rank of a group emits the same; rank 0 speaks for it
        return [(dt, v, p if p is TENSORS or p is SNAPSHOT else ray.put(p)) for dt, v, p in emitted]

    def call(self, node: str, method: str, args: tuple, kwargs: dict, required: dict | None = None) -> list:
        """Call a method of a hosted object; returns [result, emitted control]."""
        with self.lock:
            h = self.hosted[node]
            self._catch_up(h, required)
            target = h.obj
            if target is None or not hasattr(target, method):
                kind = type(target).__name__ if target is not None else "a function node"
                raise DataflowError(f"node '{node}' ({kind}) has no method '{method}'")
            _context._CONTEXT = h.ctx
            emitted = h.ctx._emitted = []
            try:
                result = getattr(target, method)(*args, **kwargs)
            finally:
                h.ctx._emitted = []
        return [result, self._ship(emitted)]

    def has_method(self, node: str, method: str) -> bool:
        obj = self.hosted[node].obj
        return obj is not None and callable(getattr(obj, method, None))


_ONE_ROW = frozenset({int, float, str, bytes, bool, type(None)})


def _rows_of(item: Any) -> int:
    """Rows of an item for the stats: a join counts its first input's rows; anything else 1."""
    if type(item) in _ONE_ROW:   # (per item: the cheap answer first)
        return 1
    if isinstance(item, dict) and item and all(isinstance(v, dict) for v in item.values()):
        item = next(iter(item.values()))
    return spmd.rows_or_one(item)
