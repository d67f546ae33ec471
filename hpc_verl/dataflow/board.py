"""The control board: the latest version of every control edge, and how it
reaches the destination's instances.

Object payloads are put in the object store once (by the emitting worker, or
by the driver for ``send_control``) and every destination instance is told
``(version, ref)``. A TENSORS payload (see ``context.TENSORS``) is moved by a
tensor transport before ``publish`` returns: inside each process when the two
nodes share a worker group (the hybrid engine's hand-over), otherwise by a
bucketed broadcast from the source group's rank 0 over a sync process group
(source rank 0 + every destination instance), rebuilt when either side's
membership changes. Versions only grow; a stale message is rejected.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from hpc_verl.dataflow.context import SNAPSHOT, TENSORS
from hpc_verl.dataflow.distgroup import DEFAULT_BUCKET_BYTES
from hpc_verl.dataflow.graph import DataflowGraph, Edge
from hpc_verl.dataflow.pool import InstancePool, Proc
from hpc_verl.errors import DataflowError


class ControlBoard:
    def __init__(self, graph: DataflowGraph, pool: InstancePool, lock: threading.RLock,
                 decide: Callable[[str], None], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.graph = graph
        self.pool = pool
        self.lock = lock
        self.decide = decide
        self.bucket_bytes = bucket_bytes
        self.entries: dict[str, tuple[str, int, Any]] = {}   # edge key -> (src, version, [ref] | TENSORS)
        self.transfers: dict[str, dict[str, Any]] = {}        # edge key -> last tensor transfer figures
        self._sync: dict[str, tuple[str, tuple[str, ...]]] = {}  # edge key -> (sync key, members)
        self._dtype: dict[str, str | None] = {}
        self._pending: dict[str, tuple[list[Any], int, float, int]] = {}   # SNAPSHOT transfers not waited for
        self._strong_in = {n: [e.key for e in graph.in_edges(n, control=True) if e.consistency == "strong"]
                           for n in graph.nodes}

    def required_for(self, node: str) -> dict | None:
        """What an item or call of ``node`` must hold: the latest version of each strong edge into it."""
        strong = self._strong_in[node]
        if not strong:
            return None
        with self.lock:
            return {k: self.entries[k] for k in strong if k in self.entries} or None

    def version(self, edge_key: str) -> int | None:
        entry = self.entries.get(edge_key)
        return entry[1] if entry else None

    # ---- publishing ----------------------------------------------------------------
    def publish(self, e: Edge, payload: Any, version: int, src: str, *, delay_s: float = 0.0,
                strict: bool = True, is_ref: bool = False) -> None:
        import ray

        if not isinstance(version, int) or isinstance(version, bool):
            raise DataflowError(f"control edge {e.key}: version {version!r} must be an int")
        with self.lock:
            prev = self.entries.get(e.key)
            if prev is not None and version <= prev[1]:
                if not strict:
                    self.decide(f"Scheduling decision: dropped stale control v{version} from {src} on {e.key} "
                                f"(v{prev[1]} already published)")
                    return
                raise DataflowError(f"control edge {e.key}: version {version} is not newer than the published "
                                    f"{prev[1]}; versions must grow")
        if payload is TENSORS or payload is SNAPSHOT:
            self._move_tensors(e, version, snapshot=payload is SNAPSHOT)
            with self.lock:
                self.entries[e.key] = (src, version, TENSORS)
            return
        refs = [payload] if is_ref else [ray.put(payload)]
        with self.lock:
            self.entries[e.key] = (src, version, refs)
            targets = [i for i in self.pool.instances[e.dst_name] if not i.draining]
        for inst in targets:
            inst.handle.apply_control.remote(e.dst_name, e.key, src, version, refs, delay_s)

    def deliver_latest(self, node: str, procs: list[Proc] | None = None) -> None:
        """New instances of ``node`` start from the latest state of every control edge into it."""
        import ray

        for e in self.graph.in_edges(node, control=True):
            entry = self.entries.get(e.key)
            if entry is None:
                continue
            src, version, refs = entry
            if refs is TENSORS:  # collective: every destination takes part; those up to date keep nothing
                self._move_tensors(e, version)
                continue
            insts = [i for i in self.pool.instances[node] if procs is None or i.proc in procs]
            ray.get([i.handle.apply_control.remote(node, e.key, src, version, refs) for i in insts])

    # ---- tensor transports ---------------------------------------------------------
    def _src_procs(self, e: Edge) -> list[Proc]:
        node = self.graph.nodes[e.src_name]
        if node.group is not None:
            return self.pool.group_procs(node.group.name)
        insts = self.pool.routable[e.src_name]
        if not insts:
            raise DataflowError(f"control edge {e.key}: source '{e.src_name}' has no live instance")
        return [insts[0].proc]

    def _move_tensors(self, e: Edge, version: int, snapshot: bool = False) -> None:
        import ray

        src, dst = self.graph.nodes[e.src_name], self.graph.nodes[e.dst_name]
        self.wait_pending(e.key)
        t0 = time.perf_counter()
        dst_insts = [i for i in self.pool.instances[e.dst_name] if not i.draining]
        local = src.group is not None and dst.group is not None and src.group is dst.group
        if snapshot and local:
            raise DataflowError(f"control edge {e.key}: SNAPSHOT is for a destination in another worker group; "
                                f"emit TENSORS for one in the same processes")
        if local:
            refs = [i.handle.apply_local.remote(e.dst_name, e.key, e.src_name, version) for i in dst_insts]
            results = ray.get(refs)
            self._record(e.key, "in-process", version, t0, None, len(results))
            return
        key = self._ensure_sync(e)
        dtype = self._dtype_of(e)
        dt = e.data_type or e.key
        if snapshot:   # the frozen copy goes out from source rank 0's control thread; receivers queue as usual
            sends = [self._src_procs(e)[0].handle.sync_send_snapshot.remote(key, e.src_name, dt, version, dtype,
                                                                              self.bucket_bytes)]
        else:
            sends = [p.handle.sync_send.remote(key, e.src_name, dt, dtype, self.bucket_bytes)
                     for p in self._src_procs(e)]
        recvs = [i.handle.sync_recv.remote(key, e.dst_name, e.key, version) for i in dst_insts]
        if snapshot:   # not waited for: the next item of the source runs meanwhile (checked later)
            self._pending[e.key] = (sends + recvs, version, t0, len(sends))
            return
        out = ray.get(sends + recvs)
        self._record(e.key, "broadcast", version, t0, out[0]["bytes"], len(recvs))

    def wait_pending(self, edge_key: str | None = None) -> None:
        """Finish the snapshot transfers still running (one edge, or all); raises their errors."""
        import ray

        for key in [edge_key] if edge_key else list(self._pending):
            entry = self._pending.pop(key, None)
            if entry is None:
                continue
            refs, version, t0, n_send = entry
            out = ray.get(refs)
            self._record(key, "broadcast (snapshot, overlapped)", version, t0, out[0]["bytes"], len(out) - n_send)

    def _record(self, key: str, mode: str, version: int, t0: float, nbytes: int | None, receivers: int) -> None:
        with self.lock:
            self.transfers[key] = {"mode": mode, "version": version,
                                   "seconds": round(time.perf_counter() - t0, 6), "bytes": nbytes,
                                   "receivers": receivers}

    def _dtype_of(self, e: Edge) -> str | None:
        import ray

        if e.key not in self._dtype:
            inst = self.pool.routable[e.dst_name][0]
            has = ray.get(inst.handle.has_method.remote(e.dst_name, "tensor_dtype"))
            self._dtype[e.key] = (ray.get(inst.handle.call.remote(e.dst_name, "tensor_dtype",
                                                                  (e.data_type or e.key,), {}))[0] if has else None)
        return self._dtype[e.key]

    def _ensure_sync(self, e: Edge) -> str:
        """The sync group of ``e`` for its current members (source rank 0 + destinations)."""
        import ray

        src0 = self._src_procs(e)[0]
        dsts = [i.proc for i in self.pool.instances[e.dst_name] if not i.draining]
        members = (src0.key, *[p.key for p in dsts])
        cached = self._sync.get(e.key)
        if cached is not None and cached[1] == members:
            return cached[0]
        generation = int(cached[0].rsplit("#", 1)[1]) + 1 if cached else 0
        key = f"{e.key}#{generation}"
        group = self.graph.nodes[e.src_name].group
        backend = group.backend if group is not None else "auto"
        timeout = group.timeout_s if group is not None else 600.0
        size = len(members)
        address = ray.get(src0.handle.sync_open.remote(key, size, timeout))
        joins = [src0.handle.sync_join.remote(key, 0, size, address, backend, timeout)]
        joins += [p.handle.sync_join.remote(key, r + 1, size, address, backend, timeout) for r, p in enumerate(dsts)]
        ray.get(joins)
        self._sync[e.key] = (key, members)
        self.decide(f"Scheduling decision: sync group for {e.key}: {src0.key} broadcasts to "
                    f"{', '.join(p.key for p in dsts)} ({size} members, backend {backend})")
        return key
