"""A simulated multi-node Ray cluster in one process (``ray.cluster_utils.Cluster``)
for tests and benchmarks (users may start one too, to try a graph on fake GPUs):
fake GPU counts, small CPU counts, no dashboard, and
every port picked free (never Ray's defaults, so other clusters on the host are
never met)."""
from __future__ import annotations

import os
from typing import Any

from hpc_verl.testbed.ports import free_ports


def _node_args(num_cpus: float, num_gpus: int, head: bool) -> dict[str, Any]:
    agent, metrics, dashboard, gcs = free_ports(4)   # distinct: Ray refuses a node whose components share one
    args: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus,
                            "dashboard_agent_listen_port": agent, "metrics_export_port": metrics,
                            "object_store_memory": 80 * 1024 * 1024}
    if head:
        args.update(include_dashboard=False, dashboard_port=dashboard, gcs_server_port=gcs)
    return args


def start_sim_cluster(nodes: list[tuple[float, int]], connect: bool = True) -> Any:
    """Start ``[(num_cpus, num_gpus), ...]`` Ray nodes; connect this process as driver."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.cluster_utils import Cluster

    cpus, gpus = nodes[0]
    cluster = Cluster(initialize_head=True, head_node_args=_node_args(cpus, gpus, head=True))
    try:
        for cpus, gpus in nodes[1:]:
            cluster.add_node(**_node_args(cpus, gpus, head=False))
        cluster.wait_for_nodes()
        if connect:
            ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


def stop_sim_cluster(cluster: Any) -> None:
    """Disconnect and stop exactly the nodes ``start_sim_cluster`` started."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()
