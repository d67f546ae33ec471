"""Can a Ray cluster place this job? verl's request against the cluster's nodes, before sending it.

verl's resource pool asks for ``trainer.nnodes`` nodes with ``trainer.n_gpus_per_node``
GPU bundles each (on a CPU profile: logical GPU slots, and the CPUs its actors hold,
``verl_upstream.cpu.rules``). A cluster without them leaves the job pending or failing
deep in verl ("Total available GPUs 0 is less than total desired GPUs 1"); here it is one
line that names what to change. Pure: the nodes come from the Jobs API (``rayjobs_api``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence


@dataclass(frozen=True)
class Need:
    """What the job asks of the cluster: ``nodes`` nodes, each with ``gpus`` GPU and ``cpus`` CPU slots."""

    nodes: int
    gpus: float
    cpus: float = 0.0
    why: str = "verl"
    python: str = "python3"  # the cluster's Python that runs the driver
    modules: tuple[str, ...] = ()  # what that Python must import

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "gpus": self.gpus, "cpus": self.cpus, "why": self.why, "python": self.python,
                "modules": list(self.modules)}


def _fits(resources: Mapping[str, float], need: Need) -> bool:
    return resources.get("GPU", 0.0) >= need.gpus and resources.get("CPU", 0.0) >= need.cpus


def placement_problem(nodes: Sequence[Mapping[str, Any]], need: Need, address: str) -> Optional[str]:
    """One line when ``nodes`` (Ray's node records: ``state``, ``node_ip``, ``resources_total``)
    cannot hold ``need``; None when they can."""
    alive = [n for n in nodes if str(n.get("state", "ALIVE")).upper() == "ALIVE"]
    fitting = [n for n in alive if _fits(n.get("resources_total") or {}, need)]
    if len(fitting) >= need.nodes:
        return None
    have = "; ".join(f"{n.get('node_ip', '?')}: {_fmt((n.get('resources_total') or {}).get('GPU', 0))} GPU, "
                     f"{_fmt((n.get('resources_total') or {}).get('CPU', 0))} CPU" for n in alive) or "no live node"
    per_node = f"{_fmt(need.gpus)} GPU slot(s)" + (f" and {_fmt(need.cpus)} CPUs" if need.cpus else "")
    fix = (f"start its Ray with --num-gpus={_fmt(need.gpus)}" + (f" --num-cpus={_fmt(need.cpus)}" if need.cpus else "")
           + " on each node (on CPU nodes the GPU slots are logical), or lower trainer.nnodes / "
             "trainer.n_gpus_per_node to what it has")
    return (f"the Ray cluster at {address} cannot place this job: {need.why} asks for {need.nodes} node(s) with "
            f"{per_node} each, {len(fitting)} node(s) have that ({have}); {fix}")


def _fmt(x: Any) -> str:
    return f"{float(x):g}"
