"""The few Ray calls the scheduler needs: cluster description, pinned placement
groups, the named status actor. Ray is imported inside functions."""
from __future__ import annotations

from typing import Any

from hpc_verl.dataflow.placement import ClusterNode

NAMESPACE = "hpc_verl"
HUB_PREFIX = "hpc_verl.dataflow/"
NODE_ID_LABEL = "ray.io/node-id"


def _short_name(node: dict[str, Any]) -> str:
    host = node.get("NodeManagerHostname") or node.get("NodeManagerAddress") or "node"
    return f"{host}/{node['NodeID'][:8]}"


def cluster_from_ray() -> tuple[list[ClusterNode], list[ClusterNode]]:
    """(free, total) resources of every alive Ray node, in a stable order."""
    import ray

    alive = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])
    try:
        avail = ray._private.state.available_resources_per_node()
    except Exception:  # older Ray: treat totals as free
        avail = {}
    keep = lambda res: {k: float(v) for k, v in res.items()  # noqa: E731
                        if not k.startswith("node:") and "_group_" not in k and not k.startswith("bundle_group")
                        and k not in ("memory", "object_store_memory")}
    total = [ClusterNode(n["NodeID"], _short_name(n), keep(n.get("Resources", {}))) for n in alive]
    free = [ClusterNode(n["NodeID"], _short_name(n), keep(avail.get(n["NodeID"], n.get("Resources", {}))))
            for n in alive]
    return free, total


def pinned_placement_group(resources: dict[str, float], node_id: str, name: str) -> Any:
    """One bundle, hard-pinned to ``node_id`` (label selector; soft hint on older Ray)."""
    from ray.util.placement_group import placement_group

    try:
        return placement_group([resources], strategy="STRICT_PACK", name=name,
                               bundle_label_selector=[{NODE_ID_LABEL: node_id}])
    except TypeError:
        return placement_group([resources], strategy="STRICT_PACK", name=name, _soft_target_node_id=node_id)


def hub_name(graph: str) -> str:
    return HUB_PREFIX + graph


def make_hub_class() -> Any:
    import ray

    @ray.remote(num_cpus=0, max_concurrency=4)
    class DataflowStatusHub:
        """Holds the latest status snapshot of one running graph, for the dashboard."""

        def __init__(self) -> None:
            self.snapshot: dict[str, Any] = {}

        def set(self, snapshot: dict[str, Any]) -> None:
            self.snapshot = snapshot

        def get(self) -> dict[str, Any]:
            return self.snapshot

    return DataflowStatusHub


def list_hubs() -> list[str]:
    """Names of the status actors of running graphs (any namespace)."""
    from ray.util import list_named_actors

    names = []
    for entry in list_named_actors(all_namespaces=True):
        name = entry["name"] if isinstance(entry, dict) else entry
        ns = entry.get("namespace") if isinstance(entry, dict) else NAMESPACE
        if name.startswith(HUB_PREFIX) and ns == NAMESPACE:
            names.append(name)
    return sorted(names)
