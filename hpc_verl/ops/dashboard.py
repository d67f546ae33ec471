"""The scheduler dashboard: reads the status snapshots that running dataflow
graphs publish (a named Ray actor per graph in the ``hpc_verl`` namespace, or
a status JSON file) and shows them live with rich, or prints one JSON snapshot.

Also the standalone ``verl-scheduler-dashboard`` command (``main``).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from hpc_verl.errors import DataflowError, HpcVerlError


def fetch_snapshots(address: str | None, graph: str | None = None, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """Connect to Ray at ``address`` and return the snapshot of every running graph."""
    import ray

    from hpc_verl.dataflow.raycluster import NAMESPACE, hub_name, list_hubs

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or _local_cluster_address()
        _probe(address)
        try:
            ray.init(address=address or "auto", namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DataflowError(f"cannot connect to Ray at {address or 'auto'}: {first}; pass --address "
                                f"HOST:PORT of a running cluster (or set RAY_ADDRESS)") from None
    names = list_hubs()
    if graph is not None:
        names = [n for n in names if n == hub_name(graph)]
    if not names:
        what = f"graph '{graph}'" if graph else "dataflow graph"
        raise DataflowError(f"no running {what} found on Ray at {address or 'auto'} (namespace '{NAMESPACE}'); "
                            f"start one with HybridScheduler(...).start()")
    actors = [ray.get_actor(n, namespace=NAMESPACE) for n in names]
    snaps = ray.get([a.get.remote() for a in actors], timeout=timeout_s)
    return [s for s in snaps if s]


def _local_cluster_address() -> str:
    """The address of the Ray cluster started on this host, as Ray records it."""
    p = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    try:
        return p.read_text().strip()
    except OSError:
        raise DataflowError("no Ray address given and no local Ray cluster found; pass --address HOST:PORT "
                            "(or set RAY_ADDRESS)") from None


def _probe(address: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds, with one line, where Ray itself would retry for minutes."""
    host, _, port = address.replace("ray://", "").rpartition(":")
    if not host or not port.isdigit():
        raise DataflowError(f"Ray address '{address}' is not HOST:PORT; pass --address like 10.0.0.1:6379")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise DataflowError(f"cannot reach Ray at {address} ({exc.strerror or exc}); is the cluster up? "
                            f"pass --address HOST:PORT of its head (GCS) port") from None


def read_status_file(path: str) -> list[dict[str, Any]]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise DataflowError(f"status file {path} does not exist; pass the status_file the scheduler writes") from None
    except json.JSONDecodeError as exc:
        raise DataflowError(f"status file {path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    return data if isinstance(data, list) else [data]


def _heat(mem: Any) -> tuple[str, str]:
    if not isinstance(mem, dict) or not mem.get("total_mb"):
        return "n/a", "grey50"
    frac = mem["used_mb"] / mem["total_mb"]
    style = "green" if frac < 0.5 else "yellow" if frac < 0.8 else "red"
    return f"{mem['used_mb'] / 1024:.1f}/{mem['total_mb'] / 1024:.0f}G", style


def render(snapshots: list[dict[str, Any]]) -> Any:
    """A rich renderable: nodes, GPU heat map, edges, decision log per graph."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    for snap in snapshots:
        nodes = Table(title="nodes", expand=True)
        for col in ("node", "dispatch", "world", "workers (rank@ray node: GPUs, rows)", "queue", "items/s",
                    "items/rows", "ulysses"):
            nodes.add_column(col)
        for name, n in snap.get("nodes", {}).items():
            workers = ", ".join(
                f"{w['id'] if w.get('rank') is None else 'r' + str(w['rank'])}@{w.get('ray_node', '?')}:"
                f"{','.join(w.get('gpu_ids') or []) or '-'} ({w.get('rows', 0)})" for w in n.get("workers", []))
            uly = "-" if n.get("ulysses") is None else ("on" if n["ulysses"] else "off")
            world = str(n.get("world_size", n.get("parallelism")))
            if n.get("group"):
                world += f" ({n['group']}{', ' + n['dist_backend'] if n.get('dist_backend') else ''})"
            nodes.add_row(name, str(n.get("dispatch", "route")), world, workers, str(n.get("queue_length")),
                          f"{n.get('items_per_s', 0):.1f}", f"{n.get('processed')}/{n.get('rows', '-')}", uly)
        heat = Table(title="GPU memory (used/total)", expand=True)
        heat.add_column("ray node")
        by_node: dict[str, list[tuple[str, dict]]] = {}
        for key, row in snap.get("gpus", {}).items():
            by_node.setdefault(key.rsplit(":", 1)[0], []).append((row["gpu"], row))
        width = max((len(v) for v in by_node.values()), default=0)
        for i in range(width):
            heat.add_column(f"GPU {i}")
        for rn, gpus in sorted(by_node.items()):
            cells: list[Any] = [rn]
            for gid, row in sorted(gpus, key=lambda x: int(x[0]) if x[0].isdigit() else 0):
                label, style = _heat(row.get("memory"))
                users = ",".join(row.get("users", [])) or "idle"
                cells.append(Text(f"{label}\n{users}", style=style))
            heat.add_row(*cells)
        edges = Table(title="edges", expand=True)
        for col in ("edge", "kind", "queue/peak/cap", "latency ms mean/p95", "items", "version"):
            edges.add_column(col)
        for key, e in snap.get("edges", {}).items():
            kind = f"control/{e['consistency']}" if e.get("control") else ("data/co-located" if e.get("co_located")
                                                                           else "data")
            lat = "-" if e.get("latency_ms_mean") is None else f"{e['latency_ms_mean']:.1f}/{e['latency_ms_p95']:.1f}"
            qs = "-" if e.get("control") else f"{e.get('queue_length')}/{e.get('peak_queue_length')}/{e.get('capacity')}"
            ver = "-"
            if e.get("control"):
                ver = "none yet" if e.get("version") is None else f"v{e['version']}"
                ver += f" (stale rejected {e.get('stale_rejected', 0)})"
                if e.get("transfer"):
                    ver += f", {e['transfer']['mode']} {1000 * e['transfer']['seconds']:.1f} ms"
            edges.add_row(key, kind, qs, lat, str(e.get("items")), ver)
        ranks = _timings_table(snap)
        log = Text("\n".join(snap.get("decisions", [])[-12:]) or "(no decisions yet)")
        age = time.time() - float(snap.get("time", time.time()))
        title = (f"graph {snap.get('graph')}  items in {snap.get('items_in')} / out {snap.get('items_out')}  "
                 f"(snapshot {age:.1f}s old)")
        body = [nodes, heat, edges] + ([ranks] if ranks is not None else []) + [Panel(log, title="decision log")]
        parts.append(Panel(Group(*body), title=title))
    return Group(*parts)


def _timings_table(snap: dict[str, Any]) -> Any:
    """Per rank, the phase times of its last update (forward, backward, the all-reduce it waited
    for, optimizer): where a slow rank loses its time; None when no node reports any."""
    from rich.table import Table

    rows = [(name, w, w["timings"]) for name, n in snap.get("nodes", {}).items() for w in n.get("workers", [])
            if w.get("timings")]
    if not rows:
        return None
    cols = list(dict.fromkeys(k for _, _, t in rows for k in t))
    table = Table(title="per-rank phase times of the last update (s)", expand=True)
    for col in ("node", "rank", *cols):
        table.add_column(col)
    slowest = {c: max(t.get(c, 0.0) for _, _, t in rows) for c in cols}
    for name, w, t in rows:
        cells = [f"[bold]{t[c]:.3f}[/bold]" if c in t and t[c] == slowest[c] and len(rows) > 1
                 else (f"{t[c]:.3f}" if c in t else "-") for c in cols]
        table.add_row(name, "-" if w.get("rank") is None else str(w["rank"]), *cells)
    return table


def run_dashboard(address: str | None = None, graph: str | None = None, once: bool = False, as_json: bool = False,
                  status_file: str | None = None, interval_s: float = 1.0) -> int:
    """The dashboard verb: one snapshot (``once``/``as_json``) or a live view until Ctrl-C."""
    def get() -> list[dict[str, Any]]:
        if status_file:
            return read_status_file(status_file)
        return fetch_snapshots(address, graph)

    if as_json:
        print(json.dumps({"graphs": get()}, indent=2, sort_keys=True, default=str))
        return 0
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if once:
        console.print(render(get()))
        return 0
    try:
        with Live(render(get()), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval_s)
                live.update(render(get()))
    except KeyboardInterrupt:
        return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="Ray address HOST:PORT (default: RAY_ADDRESS or the local cluster)")
    parser.add_argument("--graph", help="show only this graph")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="print the snapshot as JSON (for scripts)")
    parser.add_argument("--file", dest="status_file", help="read a status JSON file instead of Ray")
    parser.add_argument("--interval", type=float, default=1.0, help="refresh period in seconds (live view)")


def main(argv: Sequence[str] | None = None) -> int:
    """``verl-scheduler-dashboard``: the same as ``hpc-verl dashboard``."""
    from hpc_verl.util.argparser import OneLineParser

    parser = OneLineParser(prog="verl-scheduler-dashboard", description="Live view of running dataflow graphs.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_dashboard(args.address, args.graph, args.once, args.json, args.status_file, args.interval)
    except HpcVerlError as exc:
        print(f"verl-scheduler-dashboard: error: {exc}", file=sys.stderr)
        return exc.exit_code


def console_main() -> None:
    sys.exit(main())


if __name__ == "__main__":
    console_main()
