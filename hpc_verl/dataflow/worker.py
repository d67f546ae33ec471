"""The Ray actor that hosts one instance of a dataflow node.

Threads: the node's handler (``run``/``call``) runs in the default group, one at
a time; control messages arrive in the ``control`` group and are applied under
the same lock, so never in the middle of an item; ``stats``/``info`` run in the
``monitor`` group so the dashboard sees a busy worker without waiting for it.

Items travel as envelopes ``(t_done, value, emitted)``: ``t_done`` gives the
consumer the edge latency, ``emitted`` carries control messages the handler
emitted (the driver publishes them).
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
from hpc_verl.dataflow.context import ControlMessage, WorkerContext
from hpc_verl.dataflow.graph import DataflowRunError
from hpc_verl.errors import DataflowError

LATENCY_WINDOW = 1024


def _gpu_memory() -> dict[str, Any]:
    """Per visible GPU memory in MB, or 'n/a' (no GPU, or torch not loaded by the node)."""
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


@ray.remote(concurrency_groups={"control": 2, "monitor": 1}, max_concurrency=1)
class DataflowWorker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.lock = threading.Lock()
        ctx = ray.get_runtime_context()
        self.ctx = WorkerContext(node_name=spec["node"], instance_id=spec["instance_id"], index=spec["index"],
                                 ray_node_id=ctx.get_node_id(),
                                 gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                                 out_control=list(spec.get("out_control", [])))
        for key in spec.get("in_control", []):
            self.ctx.versions[key] = -1
        _context._CONTEXT = self.ctx
        target = spec["target"]
        if spec["is_class"]:
            self.obj = target(*spec.get("init_args", ()), **spec.get("init_kwargs", {}))
            self.handler = getattr(self.obj, spec["method"])
            self.on_control = getattr(self.obj, spec["control_method"], None)
        else:
            self.obj = None
            self.handler = target
            self.on_control = None
        self.in_keys = tuple(spec.get("in_keys", ()))
        self.in_srcs = tuple(spec.get("in_srcs", ()))
        self.join = len(self.in_keys) > 1
        self.edge_of = dict(spec.get("edge_of", {}))  # control edge key -> data_type
        self.processed = 0
        self.busy_s = 0.0
        self.stale_rejected: dict[str, int] = {}
        self.rejections: list[tuple[str, int, int]] = []  # (edge, stale version, version held)
        self.latency: dict[str, deque] = {}
        self.errors = 0

    # ---- monitor group ------------------------------------------------------------
    @ray.method(concurrency_group="monitor")
    def info(self) -> dict[str, Any]:
        return {"instance_id": self.ctx.instance_id, "ray_node_id": self.ctx.ray_node_id,
                "gpu_ids": list(self.ctx.gpu_ids), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "pid": os.getpid(), "hostname": socket.gethostname()}

    @ray.method(concurrency_group="monitor")
    def stats(self) -> dict[str, Any]:
        lat = {}
        for key, buf in list(self.latency.items()):
            vals = sorted(buf)
            if vals:
                lat[key] = {"n": len(vals), "mean_ms": 1000 * sum(vals) / len(vals),
                            "p95_ms": 1000 * vals[min(len(vals) - 1, int(0.95 * len(vals)))]}
        return {"processed": self.processed, "busy_s": self.busy_s, "latency": lat,
                "versions": dict(self.ctx.versions), "stale_rejected": dict(self.stale_rejected),
                "rejections": list(self.rejections[-64:]),
                "gpu_memory": _gpu_memory(), "errors": self.errors}

    # ---- control group ------------------------------------------------------------
    @ray.method(concurrency_group="control")
    def apply_control(self, edge: str, src: str, version: int, refs: list, delay_s: float = 0.0) -> bool:
        """Apply a broadcast control message unless it is stale. ``delay_s`` injects a
        delivery delay (tests of stale-version rejection)."""
        if delay_s:
            time.sleep(delay_s)
        with self.lock:
            return self._apply(edge, src, version, refs)

    def _apply(self, edge: str, src: str, version: int, refs: list) -> bool:
        current = self.ctx.versions.get(edge, -1)
        if version <= current:
            if version < current:
                self.stale_rejected[edge] = self.stale_rejected.get(edge, 0) + 1
                self.rejections.append((edge, version, current))
            return False
        payload = ray.get(refs[0])
        data_type = self.edge_of.get(edge, edge)
        if self.on_control is not None:
            self.on_control(ControlMessage(edge=edge, data_type=data_type, version=version, payload=payload, src=src))
        self.ctx.control[data_type] = payload
        self.ctx.versions[edge] = version
        if data_type != edge:
            self.ctx.versions[data_type] = version
        return True

    # ---- default group: items and calls -------------------------------------------
    def run(self, *inputs: Any) -> tuple[float, list, Any]:
        """Process one micro-batch. Inputs: one envelope per incoming data edge (in
        the order of ``spec['in_keys']``), or the raw list of items at a source."""
        return self._run(None, inputs)

    def run_required(self, required: dict, *inputs: Any) -> tuple[float, list, Any]:
        """Like run, but first catch up to the required version of each strong control edge."""
        return self._run(required, inputs)

    def _run(self, required: dict | None, inputs: tuple) -> tuple[float, list, Any]:
        t0 = time.time()
        keys = self.in_keys
        if keys:
            for key, env in zip(keys, inputs):
                buf = self.latency.get(key)
                if buf is None:
                    buf = self.latency[key] = deque(maxlen=LATENCY_WINDOW)
                buf.append(t0 - env[0])
            if self.join:
                batch = [dict(zip(self.in_srcs, vals)) for vals in zip(*[env[1] for env in inputs])]
            else:
                batch = inputs[0][1]
        else:
            batch = inputs[0]
        handler = self.handler
        with self.lock:
            if required:
                for edge, (src, version, refs) in required.items():
                    if self.ctx.versions.get(edge, -1) < version:
                        self._apply(edge, src, version, refs)
            emitted = self.ctx._emitted = []
            try:
                outs = [handler(x) for x in batch]
            except Exception as exc:
                self.errors += 1
                text = str(exc).strip()
                first = text.splitlines()[-1] if text else ""
                raise DataflowRunError(f"a node failed in {self.ctx.instance_id}: {type(exc).__name__}: "
                                       f"{first}") from None
            finally:
                self.ctx._emitted = []
        t1 = time.time()
        self.processed += len(batch)
        self.busy_s += t1 - t0
        return (t1, outs, emitted or None)

    def call(self, method: str, args: tuple, kwargs: dict, required: dict | None = None) -> tuple[Any, Any]:
        """Call a method of the instance's object; returns (result, emitted control)."""
        with self.lock:
            for edge, (src, version, refs) in (required or {}).items():
                if self.ctx.versions.get(edge, -1) < version:
                    self._apply(edge, src, version, refs)
            target = self.obj
            if target is None or not hasattr(target, method):
                kind = type(target).__name__ if target is not None else "a function node"
                raise DataflowError(f"node '{self.ctx.node_name}' ({kind}) has no method '{method}'")
            emitted = self.ctx._emitted = []
            try:
                return getattr(target, method)(*args, **kwargs), (emitted or None)
            finally:
                self.ctx._emitted = []

    def has_method(self, method: str) -> bool:
        return self.obj is not None and callable(getattr(self.obj, method, None))
